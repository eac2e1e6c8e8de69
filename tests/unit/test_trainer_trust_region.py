"""The steady step (trainer/trust_region.py): the band's rule as a table, the probe's KL
against the offline gate's plain reference, and rl_train stopping at the target, backing off
from an overshoot and resuming where it stopped."""

from __future__ import annotations

import copy
import math
import random
from typing import Any

import pytest
import torch
from torch.optim import Optimizer

from tests.unit.test_trainer_increment import one_thread, served  # noqa: F401 (autouse fixture)
from trainer.gate import kl_parent_candidate
from trainer.loop import LoopConfig, Sample, rl_train
from trainer.policy import TinyConfig, TinyTransformer
from trainer.samples import build_samples
from trainer.trust_region import (
    LENGTH_SEED,
    STOP_CODES,
    KLBand,
    LengthProbe,
    Probe,
    Snapshot,
    Steady,
    completion_kl,
    decide,
    length_change,
    lr_at,
    split_probe,
    stalled,
    stop_reason,
)
from trainer.window import parse_records

pytestmark = pytest.mark.unit

SMALL = TinyConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=32)
BAND = KLBand(0.08, 0.2, probe_every=2, probe_size=64, max_epochs=4, max_backoffs=2)


@pytest.mark.parametrize(("kl", "backoffs", "action"), [
    (0.0, 0, "continue"),
    (0.139, 0, "continue"),    # below the target (0.14)
    (0.14, 0, "stop"),         # at the target
    (0.2, 0, "stop"),          # at the high edge: still inside
    (0.21, 0, "back_off"),     # above it
    (0.21, 1, "back_off"),
    (0.21, 2, "stop"),         # backoffs used up
    (math.nan, 0, "back_off"),
    (math.inf, 2, "stop"),
])
def test_decide_table(kl: float, backoffs: int, action: str) -> None:
    assert decide(kl, BAND, backoffs) == action


GUARDED = KLBand(0.08, 0.2, probe_every=2, max_backoffs=2, max_length_change=0.2)


@pytest.mark.parametrize(("kl", "moved", "backoffs", "action"), [
    (0.1, 0.0, 0, "continue"),
    (0.1, 0.2, 0, "continue"),       # at the guard: still inside
    (0.1, -0.2, 0, "continue"),
    (0.1, 0.21, 0, "back_off"),      # longer answers
    (0.1, -0.21, 0, "back_off"),     # shorter answers
    (0.15, -0.19, 0, "stop"),        # at the KL target, length inside
    (0.15, -0.3, 2, "stop"),         # backoffs used up
    (0.1, math.nan, 0, "back_off"),
])
def test_decide_table_with_a_length_guard(kl: float, moved: float, backoffs: int, action: str) -> None:
    assert decide(kl, GUARDED, backoffs, moved) == action
    assert decide(kl, BAND, backoffs, moved) == decide(kl, BAND, backoffs)  # no guard: length ignored


@pytest.mark.parametrize(("kl", "stalls", "action"), [
    (0.1, 0, "continue"),
    (0.1, 1, "continue"),
    (0.1, 2, "stall"),         # two probes in a row without progress after a back-off
    (0.1, 5, "stall"),
    (0.15, 2, "stop"),         # at the target: the target wins
    (0.21, 2, "back_off"),     # an overshoot is an overshoot
])
def test_decide_table_with_stalls(kl: float, stalls: int, action: str) -> None:
    assert decide(kl, BAND, 1, stalls=stalls) == action
    assert decide(kl, KLBand(0.08, 0.2, stall_probes=None), 1, stalls=stalls) == \
        decide(kl, BAND, 1)  # no stall rule: the count is ignored


@pytest.mark.parametrize(("kl", "kept", "backoffs", "want"), [
    (0.1, 0.12, 1, True), (0.12, 0.12, 2, True),   # no higher than the kept state, after a back-off
    (0.13, 0.12, 1, False),                         # progress
    (0.05, 0.12, 0, False),                         # before any back-off the KL may wander
])
def test_a_stall_is_no_progress_after_a_back_off(kl: float, kept: float, backoffs: int, want: bool) -> None:
    assert stalled(kl, kept, backoffs) is want


def test_length_change_is_relative_to_the_parent() -> None:
    assert length_change(9.0, 12.0) == pytest.approx(-0.25)
    assert length_change(15.0, 12.0) == pytest.approx(0.25)
    assert length_change(3.0, 0.0) == 0.0
    with pytest.raises(ValueError, match="max_length_change"):
        KLBand(0.1, 1.0, max_length_change=1.5)
    with pytest.raises(ValueError, match="target"):
        KLBand(0.1, 1.0, target_kl=1.5)
    assert decide(0.5, KLBand(0.1, 1.0, target_kl=0.5), 0) == "stop"
    assert decide(0.5, KLBand(0.1, 1.0, target_kl=0.6), 0) == "continue"


@pytest.mark.parametrize(("kept", "overshoot", "action", "last", "reason"), [
    (0.15, False, "stop", False, "target"),
    (0.1, True, "stop", False, "backoffs_exhausted"),
    (0.1, False, "continue", True, "window_exhausted_in_band"),
    (0.05, False, "continue", True, "window_exhausted_below_band"),
    (0.05, True, "back_off", True, "window_exhausted_below_band"),
    (0.1, False, "continue", False, "running"),
    (0.12, False, "stall", False, "stalled"),
    (0.05, False, "stall", True, "stalled"),
])
def test_stop_reason_table(kept: float, overshoot: bool, action: str, last: bool, reason: str) -> None:
    assert stop_reason(kept, overshoot, action, last, BAND) == reason  # type: ignore[arg-type]
    assert reason in STOP_CODES


@pytest.mark.parametrize("bad", [(1.0, 1.0), (-0.1, 1.0), (0.5, math.inf), (2.0, 1.0)])
def test_band_rejects_nonsense(bad: tuple[float, float]) -> None:
    with pytest.raises(ValueError, match="KL band"):
        KLBand(*bad)
    with pytest.raises(ValueError, match="probe_every"):
        KLBand(0.1, 1.0, probe_every=0)
    with pytest.raises(ValueError, match="stall_probes"):
        KLBand(0.1, 1.0, stall_probes=0)


def test_completion_kl_matches_the_gates_reference() -> None:
    rng = random.Random(3)
    lens = [5, 3, 1, 4]
    rows = [([rng.uniform(-3, -0.1) for _ in range(n)], [rng.uniform(-3, -0.1) for _ in range(n)],
             [rng.uniform(-3, -0.1) for _ in range(n)]) for n in lens]
    width = max(lens)

    def pad(i: int) -> torch.Tensor:
        return torch.tensor([r[i] + [0.0] * (width - len(r[i])) for r in rows], dtype=torch.float64)

    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lens], dtype=torch.float64)
    got = completion_kl(pad(1), pad(0), pad(2), mask, truncate=2.0)
    want = sum(kl_parent_candidate(p, c, b, 2.0) for p, c, b in rows) / len(rows)
    assert got == pytest.approx(want, rel=1e-12)
    assert completion_kl(pad(0), pad(0), pad(2), mask, 2.0) == 0.0  # the parent itself


def test_the_probe_set_is_fixed_by_the_seed_kept_out_of_training_and_bounded() -> None:
    train, probe = split_probe(100, 10, 1)
    assert (train, probe) == split_probe(100, 10, 1) and probe != split_probe(100, 10, 2)[1]
    assert len(probe) == 10 and not set(train) & set(probe) and sorted(train + probe) == list(range(100))
    assert len(split_probe(100, 256, 1)[1]) == 20  # at most a fifth of the window
    assert split_probe(4, 10, 1) == ([0, 1, 2, 3], [0, 1, 2, 3])  # too small to spare any


def _world() -> tuple[TinyTransformer, list[Sample]]:
    torch.manual_seed(0)
    champion = TinyTransformer(SMALL)
    parsed = parse_records(served(champion, 320, seed=1), 0.0)
    return champion, build_samples(parsed.train, group_size=8, normalize_std=False)


def test_snapshot_restores_trainable_parameters_and_optimizer() -> None:
    champion, _ = _world()
    policy = champion.clone()
    opt = torch.optim.Adam(policy.module.parameters(), lr=1e-3)
    snap = Snapshot.take(0, 0.0, policy, opt)
    before = [p.detach().clone() for p in policy.module.parameters()]
    with torch.no_grad():
        for p in policy.module.parameters():
            p.add_(1.0)
    opt.param_groups[0]["lr"] = 9.0
    snap.restore(policy, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, policy.module.parameters(), strict=True))
    assert opt.param_groups[0]["lr"] == 1e-3


def test_the_band_stops_training_at_its_target_and_lands_inside() -> None:
    champion, samples = _world()
    free = champion.clone()
    rl_train(free, champion.clone(), samples, LoopConfig(batch_size=16, epochs=4, lr=3e-3, seed=1))
    probe = Probe(champion, [samples[i] for i in split_probe(len(samples), BAND.probe_size, 1)[1]], 2.0)
    assert probe.kl(free) > BAND.high, "without the band the step must overshoot, or this test proves nothing"

    policy = champion.clone()
    history = rl_train(policy, champion.clone(), samples,
                       LoopConfig(batch_size=16, epochs=1, lr=3e-3, seed=1, band=BAND))
    kl = probe.kl(policy)
    assert BAND.low <= kl <= BAND.high, kl
    last = history[-1]
    assert last["probe_kl_kept"] == pytest.approx(kl, rel=1e-6)
    assert last["band_stop"] in (STOP_CODES["target"], STOP_CODES["backoffs_exhausted"])
    assert len(history) < last["total_steps"]
    assert all("lr" in h for h in history)


def test_a_given_probe_set_is_where_the_band_measures_and_every_sample_trains() -> None:
    """The increment passes the gate's held-out records: the band lands inside on them (the
    gate's own KL), and no training sample is split off."""
    champion, samples = _world()
    probe_set, train = samples[:64], samples[64:]
    policy = champion.clone()
    cfg = LoopConfig(batch_size=16, epochs=1, lr=3e-3, seed=1, band=BAND)
    history = rl_train(policy, champion.clone(), train, cfg, probe=probe_set)
    kl = Probe(champion, probe_set, 2.0).kl(policy)
    assert BAND.low <= kl <= BAND.high and history[-1]["probe_kl_kept"] == pytest.approx(kl, rel=1e-6)
    steps_per_pass = -(-len(train) // 16)
    assert history[-1]["total_steps"] == BAND.max_epochs * steps_per_pass  # all of train, none split off


def test_an_overshoot_backs_off_and_halves_the_learning_rate() -> None:
    champion, samples = _world()
    band = KLBand(0.05, 0.3, probe_every=3, probe_size=64, max_epochs=4, max_backoffs=3)
    policy = champion.clone()
    history = rl_train(policy, champion.clone(), samples,
                       LoopConfig(batch_size=16, lr=3e-2, seed=2, band=band))
    assert max(h.get("backoffs", 0.0) for h in history) >= 1, "lr 3e-2 must overshoot a 0.3 band"
    lrs = sorted({h["lr"] for h in history}, reverse=True)
    assert lrs[0] == pytest.approx(3e-2) and lrs[1] == pytest.approx(1.5e-2)
    probe = [samples[i] for i in split_probe(len(samples), band.probe_size, 2)[1]]
    kl = Probe(champion, probe, 2.0).kl(policy)
    assert kl <= band.high, kl  # what is kept is never the overshoot
    assert history[-1]["probe_kl_kept"] == pytest.approx(kl, rel=1e-6)


def test_the_length_probe_samples_as_served_with_fixed_seeds() -> None:
    champion, samples = _world()
    probe = LengthProbe(champion, samples, 40)
    picked = samples[:40]
    lengths = [len(s.completion) for s in picked]
    assert probe.max_new == max(lengths) and probe.min_new == (1 if min(lengths) > 0 else 0)
    want = sum(len(champion.sample(list(s.prompt), max(lengths), 1.0, seed=LENGTH_SEED + i,
                                   min_new_tokens=probe.min_new)[0]) for i, s in enumerate(picked)) / 40
    assert probe.parent_mean == pytest.approx(want)
    assert probe.change(champion.clone()) == 0.0  # the parent's own samples, seed for seed


def test_a_step_past_the_length_guard_is_undone_like_a_kl_overshoot() -> None:
    """Steady's bookkeeping with scripted probe figures: a step that moved the mean length past
    the guard goes back to the last state inside, counts a back-off and reports what was kept."""
    champion, samples = _world()
    band = KLBand(0.08, 0.2, probe_every=2, max_backoffs=2, max_length_change=0.2, length_probe_size=16)
    steady = Steady(band, champion, samples[:32], 2.0)
    assert steady.lengths is not None
    script = iter([(0.05, -0.1), (0.1, -0.3), (0.15, 0.05)])
    figures: tuple[float, float] = (0.0, 0.0)

    def next_figures(_policy: object) -> float:
        nonlocal figures
        figures = next(script)
        return figures[0]

    steady.probe.kl = next_figures  # type: ignore[method-assign]
    steady.lengths.change = lambda _policy: figures[1]  # type: ignore[method-assign]
    policy = champion.clone()
    opt = torch.optim.Adam(policy.module.parameters(), lr=1e-3)
    assert steady.start(0, policy, opt)
    stats: dict[str, float] = {}
    assert not steady.after_step(2, False, policy, opt, stats)  # inside: snapshot here
    assert stats["probe_length_change_kept"] == -0.1
    kept = [p.detach().clone() for p in policy.module.parameters()]
    with torch.no_grad():
        for p in policy.module.parameters():
            p.add_(0.5)
    stats = {}
    assert not steady.after_step(4, False, policy, opt, stats)  # -30%: past the guard
    assert stats["backoffs"] == 1 and stats["probe_length_change"] == -0.3
    assert stats["probe_length_change_kept"] == -0.1 and stats["probe_kl_kept"] == 0.05
    assert all(torch.equal(a, b) for a, b in zip(kept, policy.module.parameters(), strict=True))
    stats = {}
    assert steady.after_step(6, False, policy, opt, stats)  # at the KL target, length inside: stop
    assert stats["band_stop"] == STOP_CODES["target"] and stats["probe_length_change_kept"] == 0.05


def scripted(steady: Steady, kls: list[float]) -> None:
    """Make ``steady``'s probe report ``kls`` in turn (the length guard, if any, sees no change)."""
    script = iter(kls)
    steady.probe.kl = lambda _policy: next(script)  # type: ignore[method-assign]
    if steady.lengths is not None:
        steady.lengths.change = lambda _policy: 0.0  # type: ignore[method-assign]


def nudged(policy: Any) -> list[torch.Tensor]:
    """Move every parameter (a training step's stand-in); the parameters before the move."""
    before = [p.detach().clone() for p in policy.module.parameters()]
    with torch.no_grad():
        for p in policy.module.parameters():
            p.add_(0.01)
    return before


@pytest.mark.parametrize("stall_probes", [1, 2, 3])
def test_an_increment_that_stalls_after_a_back_off_ends_at_its_kept_state(stall_probes: int) -> None:
    """Steady's bookkeeping with scripted probe KLs: after a back-off, ``stall_probes`` probes in
    a row no higher than the kept state's end the increment there, with the kept parameters
    restored; a probe that progresses resets the count."""
    champion, samples = _world()
    band = KLBand(0.08, 0.2, probe_every=2, max_backoffs=3, stall_probes=stall_probes)
    steady = Steady(band, champion, samples[:32], 2.0)
    # in band below target (kept) -> overshoot (back off to it) -> progress (kept) -> crawl down
    scripted(steady, [0.1, 0.3, 0.12, *[0.11 - 0.01 * i for i in range(stall_probes)]])
    policy = champion.clone()
    opt = torch.optim.Adam(policy.module.parameters(), lr=1e-3)
    assert steady.start(0, policy, opt)
    step, outcomes, kept = 0, [], None
    for _ in range(3 + stall_probes):
        step += 2
        before = nudged(policy)
        if len(outcomes) == 3:
            kept = before  # the state the third probe (0.12) kept
        stats: dict[str, float] = {}
        outcomes.append((steady.after_step(step, False, policy, opt, stats), stats))
    assert [done for done, _ in outcomes] == [False] * (2 + stall_probes) + [True]
    assert outcomes[1][1]["backoffs"] == 1
    last = outcomes[-1][1]
    assert last["band_stop"] == STOP_CODES["stalled"] and last["probe_kl_kept"] == 0.12
    assert kept is not None
    assert all(torch.equal(a, b) for a, b in zip(kept, policy.module.parameters(), strict=True))


def test_without_the_stall_rule_a_crawling_increment_goes_on() -> None:
    champion, samples = _world()
    steady = Steady(KLBand(0.08, 0.2, probe_every=2, stall_probes=None), champion, samples[:32], 2.0)
    scripted(steady, [0.1, 0.3, 0.09, 0.08, 0.07, 0.06])
    policy = champion.clone()
    opt = torch.optim.Adam(policy.module.parameters(), lr=1e-3)
    assert steady.start(0, policy, opt)
    for step in (2, 4, 6, 8, 10):
        nudged(policy)
        stats: dict[str, float] = {}
        assert not steady.after_step(step, False, policy, opt, stats)
        assert stats["band_stop"] == STOP_CODES["running"]
    stats = {}
    nudged(policy)
    assert steady.after_step(12, True, policy, opt, stats)  # the window's end
    assert stats["band_stop"] == STOP_CODES["window_exhausted_below_band"] and stats["probe_kl_kept"] == 0.06


def test_a_stalled_window_end_keeps_the_furthest_state() -> None:
    """The window ends while the KL crawls down after a back-off: what is kept is the state the
    run had reached, not where it crawled to."""
    champion, samples = _world()
    steady = Steady(KLBand(0.08, 0.2, probe_every=2, stall_probes=3), champion, samples[:32], 2.0)
    scripted(steady, [0.1, 0.3, 0.09])
    policy = champion.clone()
    opt = torch.optim.Adam(policy.module.parameters(), lr=1e-3)
    assert steady.start(0, policy, opt)
    for step in (2, 4):
        nudged(policy)
        assert not steady.after_step(step, False, policy, opt, {})
    kept = [p.detach().clone() for p in policy.module.parameters()]  # restored by the overshoot
    nudged(policy)
    stats: dict[str, float] = {}
    assert steady.after_step(6, True, policy, opt, stats)
    assert stats["band_stop"] == STOP_CODES["window_exhausted_in_band"] and stats["probe_kl_kept"] == 0.1
    assert all(torch.equal(a, b) for a, b in zip(kept, policy.module.parameters(), strict=True))


def test_a_window_too_small_ends_below_the_band_and_says_so() -> None:
    champion, samples = _world()
    band = KLBand(50.0, 60.0, probe_every=2, probe_size=32, max_epochs=1)
    history = rl_train(champion.clone(), champion.clone(), samples[:64],
                       LoopConfig(batch_size=16, lr=1e-4, seed=3, band=band))
    assert len(history) == 4 and history[-1]["band_stop"] == STOP_CODES["window_exhausted_below_band"]


def test_a_resumed_run_that_had_reached_its_target_takes_no_more_steps() -> None:
    champion, samples = _world()
    cfg = LoopConfig(batch_size=16, lr=3e-3, seed=1, band=BAND)
    policy = champion.clone()
    history = rl_train(policy, champion.clone(), samples, cfg)
    assert history[-1]["band_stop"] == STOP_CODES["target"]
    again = rl_train(policy, champion.clone(), samples, cfg, start_step=len(history))
    assert again == []


@pytest.mark.parametrize(("step", "warmup", "backoffs", "want"), [
    (1, 0, 0, 1e-3), (50, 0, 0, 1e-3), (1, 10, 0, 1e-4), (5, 10, 0, 5e-4), (10, 10, 0, 1e-3),
    (40, 10, 0, 1e-3), (5, 10, 1, 2.5e-4), (40, 0, 2, 2.5e-4),
])
def test_learning_rate_schedule(step: int, warmup: int, backoffs: int, want: float) -> None:
    assert lr_at(step, 1e-3, warmup, backoffs) == pytest.approx(want)


def test_a_resumed_run_keeps_its_backoffs_and_warms_up_by_the_global_step() -> None:
    champion, samples = _world()
    band = KLBand(0.05, 0.3, probe_every=3, probe_size=64, max_epochs=4, max_backoffs=3)
    cfg = LoopConfig(batch_size=16, lr=3e-2, seed=2, band=band, warmup_steps=2)
    saved: list[tuple[int, dict[str, Any]]] = []

    def crash_after_a_backoff(step: int, stats: dict[str, float], _p: object, opt: Optimizer) -> None:
        if stats.get("backoffs", 0.0) >= 1 and not saved:
            saved.append((step, copy.deepcopy(opt.state_dict())))
            raise KeyboardInterrupt

    policy = champion.clone()
    with pytest.raises(KeyboardInterrupt):
        rl_train(policy, champion.clone(), samples, cfg, on_step=crash_after_a_backoff)
    assert saved, "lr 3e-2 must overshoot a 0.3 band"
    step, opt_state = saved[0]
    history = rl_train(policy, champion.clone(), samples, cfg, start_step=step, optimizer_state=opt_state)
    assert history and history[0]["step"] == step + 1
    assert history[0]["lr"] <= 1.5e-2 + 1e-12  # not back to the full rate


def test_the_trainers_band_settings_make_its_band() -> None:
    from pydantic import ValidationError

    from services.settings.services import BandSettings
    from services.wiring.trainer import band_from

    band = band_from(BandSettings(low=0.4, high=2.0, target=1.5, max_length_change=0.2, length_probe_size=64,
                                  stall_probes=3))
    assert band == KLBand(0.4, 2.0, max_length_change=0.2, length_probe_size=64, target_kl=1.5,
                          stall_probes=3)
    assert band_from(BandSettings()) == KLBand(1.0, 2.0)  # defaults: no guard, target the midpoint, 2 stalls
    assert band_from(BandSettings(stall_probes=None)) == KLBand(1.0, 2.0, stall_probes=None)
    assert band_from(BandSettings(enabled=False)) is None
    for bad in ({"target": 2.5}, {"max_length_change": 1.0}, {"low": 2.0}, {"stall_probes": 0}):
        with pytest.raises(ValidationError):
            BandSettings(**bad)


@pytest.mark.parametrize(("every", "probe_every", "banded", "want"),
                         [(50, 4, True, 52), (48, 4, True, 48), (1, 4, True, 4), (5, 1, True, 5),
                          (50, 4, False, 50), (7, 3, False, 7)])
def test_checkpoints_fall_on_probe_steps_with_a_band(every: int, probe_every: int, banded: bool,
                                                     want: int) -> None:
    """A checkpoint holds a state the band probed and kept, so a resumed increment never starts
    between a probe and the overshoot the next one would have undone."""
    band = KLBand(0.5, 2.0, probe_every=probe_every) if banded else None
    assert LoopConfig(checkpoint_every=every, band=band).checkpoint_interval == want


@pytest.mark.parametrize(("kl", "moved", "goes_on"), [(0.1, 0.05, True), (0.1, -0.3, False),
                                                       (0.25, 0.0, False), (0.15, 0.0, False)])
def test_a_resumed_start_counts_the_length_guard_as_well_as_the_kl(kl: float, moved: float,
                                                                     goes_on: bool) -> None:
    """Resuming from a checkpoint: past the length guard or the band's high edge, or at the
    target, training does not go on; the snapshot records the length change it started at."""
    champion, samples = _world()
    band = KLBand(0.08, 0.2, probe_every=2, max_length_change=0.2, length_probe_size=16)
    steady = Steady(band, champion, samples[:32], 2.0)
    assert steady.lengths is not None
    steady.probe.kl = lambda _policy: kl  # type: ignore[method-assign]
    steady.lengths.change = lambda _policy: moved  # type: ignore[method-assign]
    policy = champion.clone()
    opt = torch.optim.Adam(policy.module.parameters(), lr=1e-3)
    assert steady.start(6, policy, opt) is goes_on
    assert steady.snapshot is not None and steady.snapshot.moved == moved and steady.snapshot.kl == kl
