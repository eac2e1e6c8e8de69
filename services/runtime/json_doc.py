"""JSON documents other programs parse (``--json`` output)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def strict_json(value: Any) -> Any:
    """``value`` with every NaN or infinity replaced by None: strict JSON has no NaN, and
    ``jq`` and most parsers refuse Python's ``NaN``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value
