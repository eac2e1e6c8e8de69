"""``rtrl bench judge --scale``: the judge's CPU per tick as a canary's window grows to a
million requests.

A window grows tick by tick as the deployer's does: each tick's new outcomes are appended to
the window's columns (``rollback.columns.ColumnBuilder``, what ``deployer.cohorts.CohortWindow``
keeps), then ``judge()`` runs on the whole window. At each reported size the benchmark times,
in CPU seconds of this process, (1) appending that tick's outcomes, (2) ``judge()`` on the
kept columns, and (3) as the baseline in the same run, ``judge()`` handed only the outcomes,
which must first turn every request into columns (what each tick cost before the window kept
them).

Traffic (its own generator, not the judge's test fixtures): users with Zipf-like activity
(a few heavy users), requests spread uniformly over a 4-hour window with the deployer's
default ramp boundaries (a step every 10 minutes), log-normal latency, a persistence report
on 40 % of requests, 1 % failed requests. The canary gets a quarter of the requests.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from rollback.columns import ColumnBuilder
from rollback.judge import judge
from rollback.types import CohortData, JudgePolicy, RequestOutcome

SIZES = (10_000, 100_000, 300_000, 1_000_000)
"""Window sizes (requests, both arms) at which a tick is timed."""
WINDOW_S = 4 * 3600.0
KINDS = ("edit", "edit", "edit", "question", "empty")


@dataclass(frozen=True)
class Point:
    requests: int
    users: int
    tick_requests: int
    append_cpu_s: float
    judge_cpu_s: float
    baseline_cpu_s: float
    decision: str


def traffic(n: int, rng: np.random.Generator, arm: str, t0: float) -> list[RequestOutcome]:
    """``n`` requests of one arm: Zipf users, uniform serving times over the window."""
    users = rng.zipf(1.6, n) % max(1, n // 20)
    ts = t0 + rng.uniform(0, WINDOW_S, n)
    lat = rng.lognormal(6.0, 0.5, n)
    reward = rng.normal(0.4, 0.3, n)
    pers = rng.random(n)
    has_p = rng.random(n) < 0.4
    acc = rng.random(n)
    kinds = rng.integers(0, len(KINDS), n)
    err = rng.random(n) < 0.01
    dis = rng.poisson(0.05, n)
    tools = rng.integers(0, 3, n)
    toks = rng.integers(1, 400, n)
    return [RequestOutcome(
        user_key=f"{arm}-{users[i]}", reward=float(reward[i]), latency_ms=float(lat[i]),
        persistence=float(pers[i]) if has_p[i] else None, accepted=bool(acc[i] < 0.6), error=bool(err[i]),
        dissatisfied=int(dis[i]), completion_kind=KINDS[kinds[i]],  # type: ignore[arg-type]
        tool_calls=int(tools[i]), invalid_tool_calls=0, completion_tokens=int(toks[i]), ts=float(ts[i]))
        for i in range(n)]


def cpu(fn: Any) -> tuple[float, Any]:
    t = time.process_time()
    out = fn()
    return time.process_time() - t, out


def run(sizes: tuple[int, ...], seed: int, ticks_per_size: int = 20) -> list[Point]:
    """Grow one window through ``sizes``; time a tick at each."""
    rng = np.random.default_rng(seed)
    t0 = 1.9e9
    boundaries = tuple(t0 + 600.0 * k for k in range(4))
    policy = JudgePolicy()
    outcomes: dict[str, list[RequestOutcome]] = {"stable": [], "canary": []}
    builders = {"stable": ColumnBuilder(), "canary": ColumnBuilder()}
    points = []
    have = 0

    def arrivals(n: int) -> dict[str, list[RequestOutcome]]:
        """``n`` new requests, three quarters on stable."""
        return {arm: traffic(round(n * share), rng, arm, t0)
                for arm, share in (("stable", 0.75), ("canary", 0.25))}

    def append(news: dict[str, list[RequestOutcome]]) -> None:
        for arm, batch in news.items():
            outcomes[arm] += batch
            for o in batch:
                builders[arm].add(o)
            builders[arm].columns()

    for size in sizes:
        tick = max(1, size // ticks_per_size)  # the last tick before the checkpoint
        append(arrivals(size - tick - have))  # the earlier ticks' appends, not timed
        news = arrivals(tick)
        append_s, _ = cpu(partial(append, news))
        have = sum(len(v) for v in outcomes.values())
        kept = [CohortData(arm, tuple(outcomes[arm]), columns=builders[arm].columns())
                for arm in ("stable", "canary")]
        plain = [CohortData(arm, tuple(outcomes[arm])) for arm in ("stable", "canary")]
        judge_s, verdict = cpu(partial(judge, kept[0], kept[1], policy, None, elapsed_s=WINDOW_S,
                                       boundaries=boundaries))
        base_s, _ = cpu(partial(judge, plain[0], plain[1], policy, None, elapsed_s=WINDOW_S,
                                boundaries=boundaries))
        points.append(Point(have, kept[0].users() + kept[1].users(), sum(len(b) for b in news.values()),
                            append_s, judge_s, base_s, verdict.decision.value))
    return points


def table(points: list[Point]) -> str:
    lines = ["requests in window | users | tick's new requests | append CPU | judge CPU | "
             "judge CPU without kept columns (baseline) | ratio",
             "---:|---:|---:|---:|---:|---:|---:"]
    for p in points:
        lines.append(f"{p.requests:,} | {p.users:,} | {p.tick_requests:,} | "
                     f"{p.append_cpu_s * 1000:,.0f} ms | "
                     f"{p.judge_cpu_s * 1000:,.0f} ms | {p.baseline_cpu_s * 1000:,.0f} ms | "
                     f"{p.judge_cpu_s / p.baseline_cpu_s if p.baseline_cpu_s else math.nan:.2f}x")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rtrl bench judge --scale", description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES),
                    help="window sizes in requests, comma-separated (default %(default)s)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        sizes = tuple(sorted({int(s) for s in args.sizes.split(",") if s.strip()}))
    except ValueError:
        ap.error(f"--sizes takes comma-separated integers, not {args.sizes!r}")
    if not sizes or sizes[0] < 100:
        ap.error("--sizes: each window needs at least 100 requests")
    points = run(sizes, args.seed)
    if args.json:
        print(json.dumps([p.__dict__ for p in points], indent=2))
    else:
        print(table(points))
        worst = points[-1]
        print(f"\njudge() per tick at {worst.requests:,} requests: {worst.judge_cpu_s:.2f} s CPU "
              f"(target <= 1 s), {worst.baseline_cpu_s:.2f} s without kept columns; seed {args.seed}")
    return 0
