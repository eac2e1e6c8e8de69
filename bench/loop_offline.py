"""The closed loop without services: the demo's simulated users, reward maths and RL
increments run in one process, so trainer settings can be compared in minutes.

    rtrl bench loop-offline --increments 3 --requests 3000
    rtrl bench loop-offline --lr 1e-3 --epochs 2 --latency-weight 1.0
    rtrl bench loop-offline --spread 10 --seed 101         # how much one increment varies
    rtrl bench loop-offline --spread 10 --kl-band 0.5:1.5   # ... with another KL band

Per increment it serves ``--requests`` completions from the current policy to the simulated
users (latency = ``--ms-per-token`` x tokens + ``--gen-ms``), computes each reward with the
real reward maths and the demo's spec, trains one increment exactly as the trainer does
(group advantages, the PPO-style objective, KL to the parent) and serves again. It prints, per
policy, what the live report measures (edit persistence, mean latency, acceptance, mean
reward, completion length), and the change of the last policy against the bootstrap: a
quick, load-independent check of whether the demo's settings can meet its targets. The live
demo adds real generation time, the canary judge and the champions-only data rule on top.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import mean
from typing import Any, cast

from ingest.events import RewardRecord
from ingest.reward.maths import Feedback, compute_reward, persistence_ratio
from ingest.reward.spec import RewardSpec, default_spec_text, parse_spec
from rollback.detectors import DETECTORS, drift_check, tolerance
from rollback.types import DetectorPolicy, JudgePolicy
from services.demo.config import demo_spec_text, demo_trainer_env, toml_text
from services.report.cohorts import Row, cohort, relative_change
from services.settings.model import Settings, settings_from_env
from services.sim.users import (
    bootstrap_corpus,
    draw_task,
    make_population,
    make_prompt,
    make_world,
    react,
)
from trainer.gate import GateConfig, GateResult, evaluate
from trainer.increment import score_heldout
from trainer.loop import LoopConfig, rl_train, sft_train, summarize
from trainer.objective import ObjectiveConfig
from trainer.policy import TinyConfig, TinyTransformer, load_policy
from trainer.samples import build_samples, to_samples
from trainer.tokens import completion_kind
from trainer.trust_region import KLBand, stop_name

HELDOUT = 300
"""Records of each window kept out of training to measure the gate's KL on."""


@dataclass(frozen=True)
class ServedRec:
    """The parts of a reward record the increment and the report use."""

    prompt_tokens: list[int]
    completion_tokens: list[int]
    behavior_logprobs: list[float]
    reward: float
    latency_ms: float
    completion_kind: str
    accepted: bool | None
    persistence: float | None
    invalid_tool_calls: int = 0
    dissatisfied: int = 0


@dataclass(frozen=True)
class Figures:
    persistence: float
    latency_ms: float
    acceptance: float
    reward: float
    length: float
    edits: float = 1.0
    """Share of completions that propose an edit (a fall is the reward hack's sign)."""
    questions: float = 0.0
    """Share of completions that are clarifying questions."""
    empty: float = 0.0
    """Share of completions that propose nothing."""

    kl: float | None = None
    """The offline gate's KL(parent || candidate) per completion on held-out records."""

    def line(self) -> str:
        kl = "" if self.kl is None else f" gate_kl={self.kl:.2f}"
        return (f"persistence={self.persistence:.3f} latency={self.latency_ms:.0f}ms "
                f"acceptance={self.acceptance:.3f} reward={self.reward:+.3f} length={self.length:.2f} "
                f"edits={self.edits:.1%}{kl}")


def figures(recs: list[ServedRec]) -> Figures:
    """The live report's cohort metrics (services/report/cohorts.py) over served records, plus length."""
    c = cohort([Row(0.0, "", "", r.completion_kind, r.accepted, r.persistence, r.latency_ms, r.reward,
                    r.dissatisfied) for r in recs])
    return Figures(c.edit_persistence, c.latency_ms, c.acceptance, c.reward,
                   mean(len(r.completion_tokens) for r in recs), c.edit_rate,
                   mean(r.completion_kind == "question" for r in recs),
                   mean(r.completion_kind == "empty" for r in recs))


BEHAVIOUR = {"edit_rate": "edits", "question_rate": "questions", "abstention_rate": "empty",
             "completion_length": "length"}
"""The live detectors (rollback/detectors.py) this bench can evaluate, and the Figures field each watches."""


def rejections(parent: Figures, child: Figures, gate: GateResult, d: DetectorPolicy) -> list[str]:
    """What would stop ``child`` before promotion: the offline gate's reasons, and every live
    reward-hacking detector whose tolerance the point estimate of the change exceeds in its
    suspicious direction (which holds promotion back live, and rolls back once confident)."""
    policy = JudgePolicy(detectors=d)
    out = list(gate.reasons)
    for name in (n for n in d.enabled if n in BEHAVIOUR):
        before, after = getattr(parent, BEHAVIOUR[name]), getattr(child, BEHAVIOUR[name])
        moved, tol = after - before, tolerance(name, policy, before)
        if drift_check(DETECTORS[name], moved, moved, moved, tol)[0]:
            out.append(f"{name} moved {moved:+.3g} (tolerance {tol:.3g})")
    return out


def serve(policy: TinyTransformer, n: int, world: Any, users: list[Any], spec: RewardSpec,
          args: argparse.Namespace, seed: int) -> list[ServedRec]:
    rng = random.Random(seed)
    horizons = list(spec.persistence.horizons_s)
    out = []
    for i in range(n):
        user, task = rng.choice(users), draw_task(world, rng)
        prompt = make_prompt(task, world, rng)
        tokens, logps = policy.sample(prompt, args.max_tokens, temperature=1.0, seed=seed * 1_000_003 + i,
                                      min_new_tokens=args.min_tokens)
        latency = args.ms_per_token * len(tokens) + args.gen_ms
        o = react(user, task, tokens, latency, horizons, world, rng)
        fb = Feedback(accepted=o.accepted,
                      persistence={h: (kept, o.inserted_chars) for h, kept in o.retained.items()},
                      dissatisfied=int(o.dissatisfied))
        kind = completion_kind(tokens)
        rec = ServedRec(prompt, tokens, logps, 0.0, latency, kind, o.accepted, None)
        reward, _ = compute_reward(fb, cast(Any, rec), spec)
        ratio = persistence_ratio(fb.persistence, spec.persistence.primary_horizon_s) if o.accepted else None
        out.append(ServedRec(prompt, tokens, logps, reward, latency, kind, o.accepted, ratio,
                             dissatisfied=int(o.dissatisfied)))
    return out


def parser() -> argparse.ArgumentParser:
    base = settings_from_env(demo_trainer_env()).trainer  # the demo's trainer settings
    ap = argparse.ArgumentParser(prog="rtrl bench loop-offline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--increments", type=int, default=3)
    ap.add_argument("--requests", type=int, default=3000, help="served completions per increment window")
    ap.add_argument("--eval-requests", type=int, default=3000)
    ap.add_argument("--users", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--min-tokens", type=int, default=1, help="as the demo's gateway (1: no empty answers)")
    ap.add_argument("--ms-per-token", type=float, default=40.0)
    ap.add_argument("--gen-ms", type=float, default=30.0, help="stand-in for real generation time")
    ap.add_argument("--latency-weight", type=float, default=None, help="override the demo spec's")
    ap.add_argument("--latency-slo", type=float, default=None, help="override the demo spec's")
    ap.add_argument("--latency-cap", type=float, default=None, help="override the demo spec's")
    ap.add_argument("--no-edit-penalty", type=float, default=Settings().demo.no_edit_penalty,
                    help="the demo spec's penalty for a question or an empty answer (default %(default)s)")
    ap.add_argument("--lr", type=float, default=base.lr, help="default: the demo's (%(default)s)")
    ap.add_argument("--epochs", type=int, default=base.epochs)
    ap.add_argument("--batch-size", type=int, default=base.batch_size)
    ap.add_argument("--group-size", type=int, default=base.group_size)
    ap.add_argument("--kl-coef", type=float, default=base.kl_coef)
    ap.add_argument("--normalize-std", action="store_true")
    ap.add_argument("--spread", type=int, default=0, metavar="N",
                    help="instead of a chain of increments, N single increments from the same bootstrap, "
                         "each on its own window: how much one increment's step varies")
    band = base.band
    edges = f"{band.low:g}:{band.high:g}" + (f":{band.target:g}" if band.target is not None else "")
    ap.add_argument("--kl-band", default=edges if band.enabled else "off",
                    metavar="LOW:HIGH[:TARGET]|off",
                    help="aim each increment at a KL to its parent in [LOW, HIGH] nats, stopping at "
                    "TARGET (default: the demo's RTRL_TRAINER__BAND__*, %(default)s)")
    ap.add_argument("--warmup", type=int, default=base.warmup_steps,
                    help="learning-rate warm-up steps (default: the demo's, %(default)s)")
    ap.add_argument("--probe-every", type=int, default=band.probe_every)
    ap.add_argument("--probe", choices=("heldout", "train"), default="heldout",
                    help="where the band measures the KL: the gate's held-out records (as the trainer "
                         "does) or samples split off the training window")
    ap.add_argument("--max-epochs", type=int, default=band.max_epochs)
    guard = band.max_length_change
    ap.add_argument("--length-guard", default=f"{guard:g}" if guard is not None else "off",
                    metavar="FRACTION|off",
                    help="a step that changes the mean sampled completion length by more than this "
                         "fraction is an overshoot (default: the demo's, %(default)s)")
    ap.add_argument("--gate-max-kl", type=float, default=GateConfig().max_kl)
    ap.add_argument("--cache", default=None, metavar="DIR",
                    help="keep the bootstrap policy here and reuse it on the next run with the same flags")
    ap.add_argument("--json", action="store_true")
    return ap


def band_arg(text: str, probe_every: int, max_epochs: int, length_guard: str = "off") -> KLBand | None:
    """``--kl-band``: ``off`` or ``LOW:HIGH[:TARGET]``; ``--length-guard``: ``off`` or a fraction."""
    if text == "off":
        return None
    try:
        edges = [float(x) for x in text.split(":")]
        if len(edges) not in (2, 3):
            raise ValueError("two or three numbers")
        guard = None if length_guard == "off" else float(length_guard)
        return KLBand(edges[0], edges[1], probe_every=probe_every, max_epochs=max_epochs,
                      max_length_change=guard, target_kl=edges[2] if len(edges) == 3 else None)
    except ValueError as exc:
        raise SystemExit(f"--kl-band {text!r} / --length-guard {length_guard!r}: expected off or "
                         f"LOW:HIGH[:TARGET] with 0 <= LOW <= TARGET <= HIGH, and off or a fraction "
                         f"in (0, 1) ({exc})") from exc


def window_row(first: Figures, f: Figures, gate: GateResult, st: dict[str, float],
               detectors: DetectorPolicy) -> dict[str, Any]:
    """One single increment of a spread against the bootstrap: its changes, KL, steps, what
    would reject it, and whether it met the targets."""
    dp = relative_change(first.persistence, f.persistence)
    dl = relative_change(first.latency_ms, f.latency_ms)
    why = rejections(first, f, gate, detectors)
    banded = "band_stop" in st
    return {"persistence": dp, "latency": dl, "kl": f.kl, "steps": int(st.get("steps", 0)), "rejected": why,
            "band_stop": stop_name(st["band_stop"]) if banded else None,
            "probe_kl": st["band_probe_kl"] if banded else None,
            "probe_length_change": st.get("band_length_change"),
            "met": dp >= 0.10 and dl <= -0.10 and not why}


def row_text(r: dict[str, Any]) -> str:
    band = f" probe_kl={r['probe_kl']:.2f} stop={r['band_stop']}" if r["band_stop"] else ""
    if r.get("probe_length_change") is not None:
        band += f" probe_length={r['probe_length_change']:+.1%}"
    rejected = "  REJECTED: " + "; ".join(r["rejected"]) if r["rejected"] else ""
    return (f"persistence {r['persistence']:+.1%} latency {r['latency']:+.1%} steps={r['steps']}"
            f"{band}{rejected}")


def spread_line(spread: list[dict[str, Any]], band: KLBand | None) -> str:
    """The spread's verdict: how many single increments met the targets, and their KL."""
    kls = [x["kl"] for x in spread if x["kl"] is not None]
    inside = (f", {sum(band.low <= k <= band.high for k in kls)} of {len(kls)} inside the band "
              f"[{band.low:g}, {band.high:g}]") if band else " (no band)"
    span = f"{min(kls):.2f}..{max(kls):.2f}" if kls else "n/a"
    return (f"spread: {sum(x['met'] for x in spread)} of {len(spread)} reach persistence >= +10% and "
            f"latency <= -10% with no detector or gate rejection; gate KL {span} nats{inside}")


def bootstrap(args: argparse.Namespace, world: Any, users: list[Any],
              spec: RewardSpec) -> tuple[TinyTransformer, Figures]:
    """The bootstrap policy and its figures; with ``--cache DIR`` kept there for the next run
    with the same seed and serving flags (the bootstrap is most of a short run's time)."""
    key = (f"bootstrap-s{args.seed}-u{args.users}-e{args.eval_requests}-t{args.max_tokens}-m{args.min_tokens}"
           f"-{args.ms_per_token:g}-{args.gen_ms:g}-{hash_spec(spec)}")
    where = Path(args.cache) / key if args.cache else None
    if where is not None and (where / "figures.json").exists():
        cached = json.loads((where / "figures.json").read_text())
        return cast(TinyTransformer, load_policy(where)), Figures(**cached)
    policy = TinyTransformer(TinyConfig())
    sft = LoopConfig(batch_size=32, epochs=2, lr=1e-3, seed=args.seed)
    sft_train(policy, bootstrap_corpus(2500, args.seed), sft)
    boot = figures(serve(policy, args.eval_requests, world, users, spec, args, 10_000))
    if where is not None:
        policy.save(where)
        (where / "figures.json").write_text(json.dumps(boot.__dict__))
    return policy, boot


def hash_spec(spec: RewardSpec) -> str:
    return hashlib.sha256(repr(spec).encode()).hexdigest()[:12]


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    band = band_arg(args.kl_band, args.probe_every, args.max_epochs, args.length_guard)
    gate_cfg = GateConfig(max_kl=args.gate_max_kl)
    detectors = DetectorPolicy()

    spec_doc = tomllib.loads(demo_spec_text(default_spec_text(), args.no_edit_penalty))
    if args.latency_weight is not None:
        spec_doc["latency"]["weight"] = args.latency_weight
    if args.latency_slo is not None:
        spec_doc["latency"]["slo_ms"] = args.latency_slo
    if args.latency_cap is not None:
        spec_doc["latency"]["cap"] = args.latency_cap
    spec = parse_spec(toml_text(spec_doc), "demo spec")
    world = make_world(args.seed)
    users = make_population(world, args.users, args.seed)
    t0 = time.monotonic()
    policy, boot = bootstrap(args, world, users, spec)
    rows = [("bootstrap", boot)]
    print(f"{rows[0][0]:>12}: {rows[0][1].line()}  ({time.monotonic() - t0:.0f}s)", flush=True)
    loop = LoopConfig(batch_size=args.batch_size, epochs=args.epochs, lr=args.lr, seed=args.seed,
                      checkpoint_every=10**9, objective=ObjectiveConfig(kl_coef=args.kl_coef), band=band,
                      warmup_steps=args.warmup)

    def increment(parent: TinyTransformer, k: int) -> tuple[TinyTransformer, Figures, GateResult,
                                                              dict[str, float]]:
        """One increment from ``parent`` on window ``k`` (served by the parent), measured."""
        window = serve(parent, args.requests, world, users, spec, args, k)
        heldout, window = window[-HELDOUT:], window[:-HELDOUT]
        samples = build_samples(cast(list[RewardRecord], window), args.group_size, args.normalize_std)
        child = parent.clone()
        held = cast(list[RewardRecord], heldout)
        probe = to_samples(held, [0.0] * len(held)) if args.probe == "heldout" else []
        history = rl_train(child, parent, samples, replace(loop, seed=args.seed + k), probe=probe)
        gate = evaluate(score_heldout(child, parent, cast(list[RewardRecord], heldout)),
                        [h["loss"] for h in history], gate_cfg)
        served = figures(serve(child, args.eval_requests, world, users, spec, args, 10_000 + k))
        return child, replace(served, kl=gate.figures.get("kl_parent")), gate, summarize(history)

    first = rows[0][1]
    spread: list[dict[str, Any]] = []
    for k in range(1, args.spread + 1):  # single increments, each from the bootstrap
        _, f, gate, st = increment(policy, k)
        rows.append((f"window {k}", f))
        spread.append(window_row(first, f, gate, st, detectors))
        print(f"{rows[-1][0]:>12}: {f.line()}  {row_text(spread[-1])}  ({time.monotonic() - t0:.0f}s)",
              flush=True)
    if spread:
        print(spread_line(spread, band), flush=True)
    for k in range(1, (0 if args.spread else args.increments) + 1):  # a chain of increments
        policy, f, _, _ = increment(policy, k)
        rows.append((f"increment {k}", f))
        print(f"{rows[-1][0]:>12}: {rows[-1][1].line()}  ({time.monotonic() - t0:.0f}s)", flush=True)
    last = rows[-1][1]
    change = {"persistence": relative_change(first.persistence, last.persistence),
              "latency_ms": relative_change(first.latency_ms, last.latency_ms),
              "acceptance": relative_change(first.acceptance, last.acceptance)}
    if not args.spread:
        print("last vs bootstrap: " + ", ".join(f"{k} {v:+.1%}" for k, v in change.items()))
    if args.json:
        print(json.dumps({"rows": [{"policy": n, **f.__dict__} for n, f in rows], "change": change,
                          "spread": spread}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
