"""`rtrl bench loop-offline`'s verdict on one increment: which live detector or gate check
would stop it (the point estimate against each detector's tolerance), the --kl-band flag and
the spread's summary line."""

from __future__ import annotations

import pytest

from bench.loop_offline import Figures, band_arg, rejections, spread_line
from rollback.types import DetectorPolicy
from trainer.gate import GateResult
from trainer.trust_region import KLBand

pytestmark = pytest.mark.unit

BASE = Figures(persistence=0.4, latency_ms=500.0, acceptance=0.3, reward=0.0, length=12.0,
               edits=1.0, questions=0.0, empty=0.0)
PASS = GateResult(True)


def child(**kw: float) -> Figures:
    return Figures(**{**BASE.__dict__, **kw})


@pytest.mark.parametrize(("kw", "fired"), [
    ({}, []),
    ({"length": 9.01}, []),                       # -24.9%: inside ±25%
    ({"length": 8.9}, ["completion_length"]),     # -25.8%: the CI failure's kind of step
    ({"length": 15.1}, ["completion_length"]),    # either way
    ({"edits": 0.951}, []),
    ({"edits": 0.94}, ["edit_rate"]),
    ({"questions": 0.06, "edits": 0.94}, ["edit_rate", "question_rate"]),
    ({"empty": 0.031}, ["abstention_rate"]),
    ({"latency_ms": 300.0, "persistence": 0.6}, []),  # big gains are not suspicious by themselves
])
def test_rejections_are_the_live_detectors_tolerances(kw: dict[str, float], fired: list[str]) -> None:
    got = rejections(BASE, child(**kw), PASS, DetectorPolicy())
    assert [g.split()[0] for g in got] == fired


def test_gate_reasons_and_disabled_detectors() -> None:
    gate = GateResult(False, ["KL to parent 3.1 nats/completion exceeds budget 2"])
    assert rejections(BASE, BASE, gate, DetectorPolicy()) == gate.reasons
    quiet = DetectorPolicy(enabled=("edit_rate",))
    assert rejections(BASE, child(length=3.0), PASS, quiet) == []


def test_band_flag() -> None:
    assert band_arg("off", 4, 3) is None
    assert band_arg("1:2", 5, 2) == KLBand(1.0, 2.0, probe_every=5, max_epochs=2)
    assert band_arg("0.4:2:1.5", 4, 3, "0.2") == KLBand(0.4, 2.0, probe_every=4, max_epochs=3,
                                                         max_length_change=0.2, target_kl=1.5)
    assert band_arg("0.4:2:1.5", 4, 3).target == 1.5 and band_arg("1:2", 4, 3).target == 1.5
    for bad in ("2:1", "1", "a:b", "1:2:3", "1:2:1.5:1"):
        with pytest.raises(SystemExit, match="--kl-band"):
            band_arg(bad, 4, 3)
    with pytest.raises(SystemExit, match="--length-guard"):
        band_arg("1:2", 4, 3, "1.5")


def test_spread_line_counts_what_met_the_targets_and_the_kl_inside_the_band() -> None:
    rows = [{"kl": 1.2, "met": True}, {"kl": 2.4, "met": False}, {"kl": None, "met": False}]
    line = spread_line(rows, KLBand(1.0, 2.0))
    assert line.startswith("spread: 1 of 3 reach")
    assert "gate KL 1.20..2.40 nats, 1 of 2 inside the band [1, 2]" in line
    assert spread_line(rows, None).endswith("(no band)")


def test_a_window_meets_the_targets_only_with_both_changes_and_no_rejection() -> None:
    from bench.loop_offline import row_text, window_row

    st, d = {"steps": 12.0, "band_stop": 1.0, "band_probe_kl": 1.52}, DetectorPolicy()
    good = window_row(BASE, child(persistence=0.45, latency_ms=445.0, length=10.9), PASS, st, d)
    assert good["met"] and good["band_stop"] == "target" and good["steps"] == 12
    assert row_text(good) == "persistence +12.5% latency -11.0% steps=12 probe_kl=1.52 stop=target"
    slow = window_row(BASE, child(persistence=0.45, latency_ms=455.0), PASS, st, d)
    assert not slow["met"]  # latency -9%
    hacked = window_row(BASE, child(persistence=0.45, latency_ms=300.0, length=7.0), PASS, {}, d)
    assert not hacked["met"] and hacked["band_stop"] is None
    assert "REJECTED: completion_length" in row_text(hacked)
