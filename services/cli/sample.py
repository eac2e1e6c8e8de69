"""``rtrl sample``: stream sample events through ingest and reward on the embedded stack.

Assumes ``rtrl up`` ran (connections come from ``.rtrl/stack.env`` via settings). Starts
``rtrl serve ingest`` and ``rtrl serve reward`` as subprocesses (reward windows compressed
with ``--time-scale``), sends a few hundred signed events of every type plus some bad input
to the raw topic, waits for the rewards, prints what happened and stops both services. With ``--json`` the
progress goes to stderr and stdout gets one JSON document with the same facts. A broker that
does not answer within ``RTRL_CLI__TIMEOUT_S`` is one line on stderr and exit code 4.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kafka import TopicPartition

from ingest.events import (
    CompletionServed,
    EditAccepted,
    EditPersistence,
    EditRejected,
    FollowupDissatisfied,
    ModelRef,
)
from ingest.reward.spec import load_spec
from services.cli import exit_codes
from services.cli.backends import BackendUnavailableError, message
from services.cli.probes import probe_broker
from services.runtime.event_producer import EventProducer
from services.runtime.kafka_io import ensure_topics, make_consumer
from services.settings.model import Settings, get_settings

KEY_ID = "sample"


def sample_events(run: str, n_requests: int, rng: random.Random) -> tuple[list[Any], int]:
    """Valid events of every type for ``n_requests`` requests; returns (events, served count)."""
    now = datetime.now(UTC)
    events: list[Any] = []
    for i in range(n_requests):
        rid = f"{run}-r{i}"
        arm = "canary" if i % 3 == 0 else "stable"
        kind = rng.choices(["edit", "question", "empty"], weights=[8, 1, 1])[0]
        n_tok = rng.randint(1, 8)
        invalid = 1 if rng.random() < 0.08 else 0
        events.append(CompletionServed(
            event_id=f"{rid}-s", request_id=rid, ts=now, session_id=f"{run}-sess{i % 7}",
            user_key=f"user{i % 23}",
            model=ModelRef(name="rtrl-policy", version="1" if arm == "stable" else "2"),
            arm=arm, prompt_tokens=[rng.randint(0, 255) for _ in range(6)],
            completion_tokens=[rng.randint(0, 255) for _ in range(n_tok)],
            logprobs=[-rng.random() * 3 for _ in range(n_tok)], latency_ms=rng.uniform(200, 3500),
            tool_calls=invalid + rng.randint(0, 1), invalid_tool_calls=invalid, completion_kind=kind,
        ))
        ts = now + timedelta(seconds=1)
        if kind == "edit":
            fate = rng.random()
            if fate < 0.6:
                ins = rng.randint(10, 200)
                events.append(EditAccepted(event_id=f"{rid}-a", request_id=rid, ts=ts, inserted_chars=ins))
                kept = ins
                for h in (30, 600, 3600):
                    kept = rng.randint(0, kept)
                    events.append(EditPersistence(event_id=f"{rid}-p{h}", request_id=rid, ts=ts,
                                                  horizon_s=h, retained_chars=kept, inserted_chars=ins))
            elif fate < 0.85:
                events.append(EditRejected(event_id=f"{rid}-x", request_id=rid, ts=ts))
            # else: no feedback at all -> the spec's default reward at the due time
        if rng.random() < 0.1:
            events.append(FollowupDissatisfied(event_id=f"{rid}-d", request_id=rid, ts=ts, reason="wrong"))
    return events, n_requests


def send_bad(prod: EventProducer, good: Any, run: str) -> int:
    """Input ingest must dead-letter (plus one duplicate it must drop)."""
    body = good.model_dump_json().encode()
    doc = json.loads(body)
    bad_latency = json.dumps({**doc, "event_id": f"{run}-neg", "latency_ms": -5}).encode()
    missing = json.dumps(
        {k: v for k, v in doc.items() if k != "user_key"} | {"event_id": f"{run}-m"}).encode()
    wrong_version = json.dumps({**doc, "event_id": f"{run}-v", "schema_version": 9}).encode()
    cases = [
        (b"{not json", True), (missing, True), (bad_latency, True), (wrong_version, True),
        (json.dumps({**doc, "event_id": f"{run}-u"}).encode(), False),  # unsigned
    ]
    for value, signed in cases:
        prod.send_raw(value, key=good.request_id.encode(), sign_value=signed)
    prod.send_raw(body, key=good.request_id.encode(),
                  headers=[("rtrl-key-id", KEY_ID.encode()), ("rtrl-signature", b"0" * 64)])  # bad signature
    prod.send(good)  # duplicate of an event already sent
    return len(cases) + 2


def _end_offsets(settings: Settings, topic: str) -> dict[int, int]:
    c = make_consumer(settings.kafka, None)
    try:
        parts = c.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in parts]
        return {tp.partition: off for tp, off in c.end_offsets(tps).items()}
    finally:
        c.close()


def _read_from(settings: Settings, topic: str, start: dict[int, int], timeout_s: float,
               until: Any = None) -> list[Any]:
    c = make_consumer(settings.kafka, None)
    tps = [TopicPartition(topic, p) for p in start]
    c.assign(tps)
    for tp in tps:
        c.seek(tp, start[tp.partition])
    out: list[Any] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            for recs in c.poll(timeout_ms=300).values():
                out += recs
            if until is not None and until(out):
                break
    finally:
        c.close()
    return out


def _spawn(name: str, args: list[str], env: dict[str, str], logdir: Path) -> subprocess.Popen[bytes]:
    rtrl = Path(sys.executable).parent / "rtrl"
    with open(logdir / f"{name}.log", "ab") as out:  # the child keeps its own descriptor
        return subprocess.Popen([str(rtrl), "serve", *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _stop(proc: subprocess.Popen[bytes], name: str) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return f"{name}: killed after 30 s"
    return f"{name}: exit {proc.returncode}"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rtrl sample", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=80, help="served completions to simulate")
    ap.add_argument("--time-scale", type=float, default=0.005,
                    help="reward window compression (0.005: the 1 h horizon closes after 18 s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true",
                    help="progress on stderr; the outcome as one JSON document on stdout")
    args = ap.parse_args(argv)
    settings = get_settings()
    try:
        probe_broker(settings)
    except BackendUnavailableError as exc:
        line = message("sample", exc.failure, settings, settings.cli.timeout_s)
        print(f"{line}; run `rtrl up` first", file=sys.stderr)
        return exit_codes.UNAVAILABLE
    progress = sys.stderr if args.json else sys.stdout
    t = settings.topics
    ensure_topics(settings)
    run = f"sample{uuid.uuid4().hex[:6]}"
    rng = random.Random(args.seed)
    secret = secrets.token_hex(16)
    logdir = settings.stack.data_dir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RTRL_AUTH__KEYS": json.dumps({KEY_ID: secret}),
           "RTRL_REWARD__TIME_SCALE": str(args.time_scale)}
    start = {topic: _end_offsets(settings, topic) for topic in (t.events, t.rewards, t.dlq)}
    spec = load_spec(settings.reward_spec)
    window_s = spec.window_s * args.time_scale
    print(f"rtrl sample {run}: broker {settings.kafka.bootstrap_servers}, spec {spec.version}, "
          f"windows close within {window_s:.0f} s (time scale {args.time_scale:g})",
          file=progress, flush=True)
    procs = {
        "ingest": _spawn("ingest", ["ingest", "--instance-id", "sample-ingest-0"], env, logdir),
        "reward": _spawn("reward", ["reward", "--instance-id", "sample-reward-0"], env, logdir),
    }
    try:
        events, n_served = sample_events(run, args.requests, rng)
        with EventProducer(settings, key_id=KEY_ID, secret=secret) as prod:
            for ev in events:
                prod.send(ev)
            n_bad = send_bad(prod, events[0], run)
            prod.flush()
        print(f"sent {len(events)} valid events ({n_served} served completions) and {n_bad} bad or "
              f"duplicate records to {t.raw}; waiting for rewards ...", file=progress, flush=True)

        def mine(recs: list[Any]) -> list[dict[str, Any]]:
            return [d for d in (json.loads(r.value) for r in recs) if d["request_id"].startswith(run + "-")]

        def done(recs: list[Any]) -> bool:  # every reward, or a service gone (no more will come)
            return len(mine(recs)) >= n_served or any(p.poll() is not None for p in procs.values())

        rewards = mine(_read_from(settings, t.rewards, start[t.rewards], window_s + 90, until=done))
        gone = [n for n, p in procs.items() if p.poll() is not None]
        if gone and len(rewards) < n_served:
            print(f"stopped waiting: {', '.join(gone)} exited early (logs in {logdir})", file=progress)
        forwarded = [r for r in _read_from(settings, t.events, start[t.events], 3)
                     if r.key and r.key.decode().startswith(run + "-")]
        dlq = _read_from(settings, t.dlq, start[t.dlq], 3)
        reasons = collections.Counter(json.loads(r.value)["reason"] for r in dlq)
    finally:
        stopped = [_stop(p, n) for n, p in procs.items()]
    code = exit_codes.OK if len(rewards) == n_served else exit_codes.FAILED
    doc = summary(len(events) + n_bad, len(forwarded), reasons, rewards, n_served)
    if args.json:
        doc.update(run=run, broker=settings.kafka.bootstrap_servers, reward_spec=spec.version,
                   time_scale=args.time_scale, services_stopped=stopped, logs=str(logdir), exit_code=code)
        print(json.dumps(doc, indent=2, sort_keys=True))
        return code
    _print_summary(doc)
    print("services stopped: " + ", ".join(stopped) + f" (logs in {logdir})")
    return code


def _outcome(r: dict[str, Any]) -> str:
    if r["defaulted"]:
        return "no feedback (default)"
    if r["accepted"] is not None:
        return "accepted" if r["accepted"] else "rejected"
    return f"{r['completion_kind']}, follow-up only"


def _examples(rewards: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One reward record per (kind, accepted, defaulted), at most 4."""
    shown: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rewards:
        label = (r["completion_kind"], r["accepted"], r["defaulted"])
        if label not in shown and len(shown) < 4:
            shown[label] = r
    return list(shown.values())


def summary(sent: int, forwarded: int, reasons: collections.Counter[str],
            rewards: list[dict[str, Any]], n_served: int) -> dict[str, Any]:
    """What ``rtrl sample --json`` prints (besides the run's identity): the facts of the text
    summary."""
    by_arm: dict[str, list[float]] = collections.defaultdict(list)
    for r in rewards:
        by_arm[r["arm"]].append(r["reward"])
    return {
        "events_sent": sent, "forwarded_by_ingest": forwarded,
        "dead_lettered": sum(reasons.values()), "dead_lettered_by_reason": dict(sorted(reasons.items())),
        "rewards_emitted": len(rewards), "served_completions": n_served,
        "mean_reward_by_arm": {arm: {"mean": sum(v) / len(v), "n": len(v)}
                               for arm, v in sorted(by_arm.items())},
        "rewards_by_outcome": dict(sorted(collections.Counter(map(_outcome, rewards)).items())),
        "example_rewards": _examples(rewards),
    }


def _print_summary(doc: dict[str, Any]) -> None:
    """The text form of :func:`summary`."""
    print(f"\nevents sent         {doc['events_sent']}")
    print(f"forwarded by ingest {doc['forwarded_by_ingest']}")
    print(f"dead-lettered       {doc['dead_lettered']}" + "".join(
        f"\n  {reason:22s} {n}" for reason, n in doc["dead_lettered_by_reason"].items()))
    print(f"rewards emitted     {doc['rewards_emitted']} of {doc['served_completions']} served completions")
    for arm, m in doc["mean_reward_by_arm"].items():
        print(f"  mean reward {arm:7s} {m['mean']:+.3f}  (n={m['n']})")
    print("  by outcome: " + ", ".join(f"{k} {v}" for k, v in doc["rewards_by_outcome"].items()))
    print("\nexample reward records:")
    for r in doc["example_rewards"]:
        comps = ", ".join(f"{k} {v:+.3f}" for k, v in r["components"].items() if v)
        print(f"  {r['request_id']}  {r['completion_kind']:8s} arm={r['arm']:6s} v{r['model']['version']} "
              f"reward {r['reward']:+.3f}  [{comps or 'all terms 0'}]  spec {r['reward_spec_version']}")
