"""The suite's sizes: the soak scale meets the figures the reliability issue asks for."""

from __future__ import annotations

import pytest

from tests.reliability import scale


def test_soak_scale_meets_the_required_sizes() -> None:
    s = scale.SCALES["soak"]
    assert s.crash_events >= 100_000
    assert s.fuzz_bad >= 10_000
    assert s.judge_canaries >= 1_000


def test_unknown_scale_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RTRL_RELIABILITY_SCALE", "huge")
    with pytest.raises(ValueError, match="expected one of"):
        scale.current()
