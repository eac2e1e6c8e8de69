"""``rtrl bench judge --schedule``: the command. Whole canaries on the deployer's schedule
(bench/judge_schedule.py), and with ``--baselines`` the Kayenta- and Flagger-style judges on
the same traffic (bench/judge_schedule_baselines.py); per shape and judge how the canaries
ended, and for the two-MDE regressions the users to a decision against a fixed-horizon test
sized to catch one MDE with 95 % power at the judge's per-test α (from the per-user variance
the judge saw): the users a fixed design would have to wait for, whatever the effect."""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor

from bench.judge_schedule import HOURS, SHAPES, Result, fixed_horizon_users, policy_for, run_canary, summarise
from bench.judge_schedule_baselines import BASELINES, LABEL, run_baseline

JUDGES = ("ours", *BASELINES)


def run_one(judge_name: str, shape: str, seed: int, tick_s: float, users_per_min: float,
            hours: float = HOURS) -> Result:
    if judge_name == "ours":
        return run_canary(shape, seed, tick_s, users_per_min, hours)
    return run_baseline(judge_name, shape, seed, tick_s, users_per_min)


def users_ratio(out: dict[str, dict[str, dict[str, object]]], shape: str) -> dict[str, float] | None:
    """Our median canary users to the rollback, and the users of a fixed-horizon test sized to
    catch one MDE with 95 % power (from the per-user variance our judge saw, median)."""
    ours, var = (out[shape].get("ours", {}).get(k)
                 for k in ("median_users_to_rollback", "median_var_per_user"))
    if not (isinstance(ours, float) and isinstance(var, float)):
        return None
    fixed = fixed_horizon_users(var, SHAPES[shape].metric, policy_for(SHAPES[shape]))
    return {"ours": ours, "fixed_horizon": fixed, "ratio": ours / fixed}


def _table(out: dict[str, dict[str, dict[str, object]]]) -> None:
    print(f"{'shape':<32}{'judge':<34}{'n':>5}{'promoted':>10}{'rolled back':>13}{'(upper 95%)':>13}"
          f"{'aborted':>9}{'undecided':>11}{'users→promote':>15}{'users→rollback':>16}{'h→promote':>11}"
          f"{'h→rollback':>12}")
    for name, judges in out.items():
        for judge_name, s in judges.items():
            def f(key: str, fmt: str, s: dict[str, object] = s) -> str:
                v = s[key]
                return "-" if v is None else format(v, fmt)
            label = LABEL.get(judge_name, "ours")
            print(f"{name:<32}{label:<34}{s['canaries']:>5}{s['promotion_rate']:>10.1%}"
                  f"{s['rollback_rate']:>13.1%}{s['rollback_upper95']:>13.1%}{s['aborted']:>9}"
                  f"{s['undecided']:>11}{f('median_users_to_promotion', ',.0f'):>15}"
                  f"{f('median_users_to_rollback', ',.0f'):>16}{f('median_hours_to_promotion', '.2f'):>11}"
                  f"{f('median_hours_to_rollback', '.2f'):>12}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rtrl bench judge --schedule", description=__doc__.split("\n")[0])
    ap.add_argument("--canaries", type=int, default=500, help="canaries per shape (default 500)")
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--tick-s", type=float, default=30.0, help="the deployer's tick (default 30 s)")
    ap.add_argument("--users-per-min", type=float, default=60.0, help="new users per minute (default 60)")
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), metavar="NAME",
                    help="run only this shape (repeatable; default: all)")
    ap.add_argument("--baselines", action="store_true",
                    help="also the Kayenta- and Flagger-style judges, on the same traffic")
    ap.add_argument("--hours", type=float, default=HOURS,
                    help="stop each canary of our judge after this many hours (default: the deployer's "
                         "6-hour cap); shorter counts the early decisions at a fine --tick-s cheaply, "
                         "the rest end undecided")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.canaries < 1 or args.tick_s <= 0 or args.users_per_min <= 0 or not 0 < args.hours <= HOURS:
        ap.error(f"--canaries >= 1, --tick-s > 0, --users-per-min > 0 and 0 < --hours <= {HOURS:g} "
                 "are required")
    t0 = time.perf_counter()
    out: dict[str, dict[str, dict[str, object]]] = {}
    judges = JUDGES if args.baselines else ("ours",)
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        for i, name in enumerate(args.shape or list(SHAPES)):
            seeds = [args.seed + 100_000 * i + k for k in range(args.canaries)]
            out[name] = {}
            # the baselines watch the per-request metrics a proxy exports, not sessions
            for judge_name in ("ours",) if SHAPES[name].agent else judges:
                n = len(seeds)
                results = list(pool.map(run_one, [judge_name] * n, [name] * n, seeds, [args.tick_s] * n,
                                        [args.users_per_min] * n, [args.hours] * n, chunksize=4))
                out[name][judge_name] = summarise(results)
            if not args.json:
                print(f"  {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    ratios = {name: users_ratio(out, name) for name in out if "2 MDE" in name}
    if args.json:
        print(json.dumps({"shapes": out, "users_vs_fixed_horizon": ratios}, indent=2))
        return 0
    _table(out)
    for name, r in ratios.items():
        if r is not None:
            print(f"{name}: ours decided at {r['ours']:,.0f} canary users (median), {r['ratio']:.2f}x the "
                  f"{r['fixed_horizon']:,.0f} of a fixed-horizon test powered (95%) for one MDE")
    print(f"{args.canaries} canaries per shape, seed {args.seed}, tick {args.tick_s:g} s, "
          f"{args.users_per_min:g} new users/min, {args.hours:g} h per canary, "
          f"{time.perf_counter() - t0:.0f} s")
    return 0
