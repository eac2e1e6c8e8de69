"""The judge on columns (rollback/columns.py) against the plain per-outcome definitions: every
metric's values agree with ``rollback.metrics.METRICS`` request for request, a window's columns
kept record by record equal the columns built at once, and ``judge()`` reaches the same verdict,
figure for figure, whether the caller hands it columns or only outcomes."""

from __future__ import annotations

import random

import numpy as np
import pytest

from rollback.columns import ColumnBuilder, columns_from, metric_values
from rollback.judge import judge
from rollback.metrics import METRICS
from rollback.types import CohortData, ErrorCount, JudgePolicy, RequestOutcome

T0 = 1.9e9


def outcomes(n: int, users: int, rng: random.Random, shift: float = 0.0, prefix: str = "u",
             ) -> list[RequestOutcome]:
    kinds = ["edit", "edit", "question", "empty"]
    return [RequestOutcome(
        user_key=f"{prefix}{int(rng.paretovariate(1.2)) % users}", reward=rng.gauss(0.4 + shift, 0.3),
        latency_ms=rng.lognormvariate(6.0, 0.5), persistence=rng.random() if rng.random() < 0.4 else None,
        accepted=rng.choice([True, False, None]), error=rng.random() < 0.01,
        dissatisfied=rng.choice([0, 0, 0, 1, 2]), completion_kind=rng.choice(kinds),  # type: ignore[arg-type]
        tool_calls=rng.randrange(4), invalid_tool_calls=rng.randrange(2),
        completion_tokens=rng.randrange(300),
        ts=T0 + rng.uniform(0, 7200)) for _ in range(n)]


@pytest.mark.parametrize("name", sorted(METRICS))
def test_every_metric_has_the_plain_definitions_values(name: str) -> None:
    outs = outcomes(2000, 300, random.Random(name))
    values, counted = metric_values(columns_from(outs), name)
    plain = [METRICS[name](o) for o in outs]
    want_counted = np.array([v is not None for v in plain])
    got_counted = np.ones(len(outs), dtype=bool) if counted is None else counted
    assert (got_counted == want_counted).all()
    want = np.array([v for v in plain if v is not None], dtype=np.float64)
    assert np.array_equal(values[want_counted], want)


def test_a_growing_window_keeps_the_columns_built_at_once_and_old_views_stay_put() -> None:
    rng = random.Random(3)
    outs = outcomes(5000, 700, rng)
    b = ColumnBuilder(capacity=4)
    views = []
    at = 0
    for size in (1, 3, 700, 0, 2000, 2296):  # growth past the capacity several times
        for o in outs[at:at + size]:
            b.add(o)
        at += size
        views.append((at, b.columns()))
    assert at == len(outs) == len(b)
    whole = columns_from(outs)
    for n, view in views:
        first = columns_from(outs[:n])
        assert view.user.size == n and view.user_keys == first.user_keys
        for field in ("user", "kind", "ts", "reward", "latency_ms", "persistence", "accepted", "dissatisfied",
                      "tool_calls", "invalid_tool_calls", "completion_tokens", "has_persistence",
                      "has_accepted", "error"):
            assert np.array_equal(getattr(view, field), getattr(first, field)), field
            assert np.array_equal(getattr(view, field), getattr(whole, field)[:n]), field


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_the_verdict_is_the_same_with_columns_or_outcomes(seed: int) -> None:
    rng = random.Random(seed)
    shift = [0.0, -0.15, 0.1, 0.0][seed - 1]
    s_out, c_out = outcomes(3000, 400, rng, prefix="s"), outcomes(1500, 200, rng, shift, prefix="c")
    errs = tuple(ErrorCount(f"c{rng.randrange(250)}", T0 + rng.uniform(0, 7200), rng.randrange(1, 4))
                 for _ in range(30))
    plain = (CohortData("stable", tuple(s_out), requests=3100, errors=5),
             CohortData("canary", tuple(c_out), requests=1600, errors=70, user_errors=errs))
    builders = (ColumnBuilder(), ColumnBuilder())
    for b, outs in zip(builders, (s_out, c_out), strict=True):
        for o in outs:
            b.add(o)
    kept = tuple(CohortData(p.arm, p.outcomes, p.requests, p.errors, p.user_errors, columns=b.columns())
                 for p, b in zip(plain, builders, strict=True))
    policy = JudgePolicy(min_users=30)
    bounds = (T0, T0 + 60, T0 + 1800)
    a = judge(*plain, policy, None, elapsed_s=7200, boundaries=bounds)
    b = judge(*kept, policy, None, elapsed_s=7200, boundaries=bounds)
    assert repr(a) == repr(b)
    assert a.users_stable == plain[0].users() == kept[0].users()
    assert plain[1].error_count() == kept[1].error_count()


def test_the_scale_benchmark_grows_one_window_through_its_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import judge_scale

    points = judge_scale.run((400, 2000), seed=5, ticks_per_size=4)
    assert [p.requests for p in points] == [400, 2000]
    assert points[0].tick_requests == 100 and points[1].tick_requests == 500
    assert all(p.judge_cpu_s >= 0 and p.baseline_cpu_s > 0 for p in points)
    assert judge_scale.main(["--sizes", "300,600", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "judge() per tick at 600 requests" in out and "\n300 | " in out
    with pytest.raises(SystemExit):
        judge_scale.main(["--sizes", "ten"])
