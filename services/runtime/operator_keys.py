"""The deployer's operator keys, read from the settings at every tick (so a rotated Secret
applies without a restart)."""

from __future__ import annotations

from deployer.operators import Authority, parse_keys
from services.settings.operators import OperatorSettings


def authority(s: OperatorSettings) -> Authority:
    """Keys from ``keys_file`` and ``keys``; a file that cannot be read or parsed yields an
    Authority whose every verdict is a refusal naming the problem (the canary goes on)."""
    keys: dict[str, tuple[bytes, ...]] = {}
    try:
        texts = [s.keys_file.read_text()] if s.keys_file is not None else []
        if s.keys is not None:
            texts.append(s.keys.get_secret_value())
        for text in texts:
            for name, found in parse_keys(text).items():
                keys[name] = (*keys.get(name, ()), *found)
    except (OSError, ValueError) as exc:
        where = f" ({s.keys_file})" if s.keys_file is not None else ""
        return Authority({}, s.max_age_s, s.allow_unauthenticated, error=f"{exc}{where}")
    return Authority(keys, s.max_age_s, s.allow_unauthenticated)

