"""One flag name per concept across the ``rtrl`` commands and services, and old spellings kept
as hidden aliases that still work and say which name to use.

The names: ``--port`` for the one port a process listens on, a ``-s`` suffix for durations in
seconds (``--tick-s``, ``--interval-s``, ``--slack-s``), ``--json`` for one JSON document on
stdout, ``--group-id``, ``--instance-id``, ``--time-scale``, ``--spec`` as the services name them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


class _DeprecatedAlias(argparse.Action):
    """Stores the value under the new flag's name and prints one line to stderr."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, instead: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, **kw)
        self.instead = instead

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"{parser.prog}: {option_string} is deprecated, use {self.instead}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Accept ``old`` as a hidden spelling of the already added flag ``new`` (same type)."""
    action = next(a for a in parser._actions if new in a.option_strings)
    kw: dict[str, Any] = {} if action.type is None else {"type": action.type}
    parser.add_argument(old, dest=action.dest, action=_DeprecatedAlias, instead=new, help=argparse.SUPPRESS,
                        default=argparse.SUPPRESS, metavar=action.metavar, **kw)
