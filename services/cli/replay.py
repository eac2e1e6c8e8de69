"""``rtrl replay --spec NEW.toml``: the rewards past requests would have had under another spec.

Reads the events topic (with the broker's append times) and the rewards topic, rebuilds each
request's live window with the same join and closes it under the new spec
(ingest/reward/replay.py), and reports:

- **the check**: the same replay under the live spec, and how many live records it
  reproduces exactly (all of them, unless the reward workers lagged: see the module above);
- **rewards**: how many changed or changed sign, the means, per version and arm;
- **advantages**: the trainer's group-relative advantages (same groups) under both, how
  much they move and how many flip sign;
- **past canaries** (from the MLflow ledger): the judge re-run on each decided canary's window
  with the live and with the replayed rewards, and whether its verdict would have changed.
  A canary whose decision recorded what it was judged on (``judged_on`` in its
  ``decision.json``: the strata boundaries, the decision tick's time, the gateway's counts and
  how far the rewards topic had been read) is judged on exactly the records and inputs the
  deployer judged, through the same call (``deployer.cohorts.judge_window``), so the live
  side reproduces the recorded verdict (``reproduces``); an older record without it is judged
  on its start alone (``exact: false``).

The replayed records go to a JSON-lines file (default ``replay-<version>.jsonl``) or to a
Kafka topic of their own (``--topic``; never the live rewards topic), and each carries the new
spec's ``reward_spec_version``: nothing trains on them by accident. The new spec must have a
version of its own unless it is the live spec itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from deployer.cohorts import CohortWindow, JudgedOn, judge_window
from ingest.events import Event, RewardRecord, parse_event
from ingest.reward.replay import Pair, ReplayResult, advantage_shift, replay, reproduced, summarize
from ingest.reward.spec import RewardSpec, SpecError, load_spec
from rollback.types import JudgePolicy
from services.cli import exit_codes
from services.cli.backends import (
    BackendUnavailableError,
    backend_failure,
    bound_mlflow_env,
    bounded_settings,
    message,
)
from services.cli.probes import preflight
from services.runtime.json_doc import strict_json
from services.runtime.kafka_io import make_producer, read_topic
from services.settings.model import Settings, get_settings


def _time(text: str) -> float:
    """ISO 8601 (``2026-11-26T10:00:00Z``) or Unix seconds."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a time: {text!r} (ISO 8601 or Unix seconds)") from exc
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()


Position = tuple[int, int]
"""(partition, offset) of a live record on the rewards topic."""
Inputs = tuple[list[tuple[float, Event]], list[RewardRecord], dict[str, int], dict[str, Position]]


def read_inputs(settings: Settings, start: float | None, end: float | None) -> Inputs:
    """The events with their append times, the live records served in [start, end), counts
    of what could not be read, and where each live record is (request id -> position)."""
    unreadable = {"events": 0, "rewards": 0}
    where: dict[str, Position] = {}
    events: list[tuple[float, Event]] = []
    for rec in read_topic(settings.kafka, settings.topics.events):
        try:
            events.append((rec.timestamp / 1000.0, parse_event(rec.value)))
        except (ValidationError, ValueError, TypeError):
            unreadable["events"] += 1
    live: list[RewardRecord] = []
    for rec in read_topic(settings.kafka, settings.topics.rewards):
        try:
            r = RewardRecord.model_validate_json(rec.value)
        except (ValidationError, ValueError, TypeError):
            unreadable["rewards"] += 1
            continue
        served = r.served_ts.timestamp()
        if (start is None or served >= start) and (end is None or served < end):
            live.append(r)
            where.setdefault(r.request_id, (rec.partition, rec.offset))
    return events, live, unreadable, where


def advantages(pairs: Sequence[Pair], settings: Settings) -> dict[str, float]:
    """The trainer's advantages of these records under both rewards, grouped as the trainer
    groups the live records (trainer.samples.record_advantages)."""
    from trainer.samples import record_advantages  # torch

    t, live = settings.trainer, [p.live for p in pairs]
    return advantage_shift(
        record_advantages(live, [p.live.reward for p in pairs], t.group_size, t.normalize_std),
        record_advantages(live, [p.replayed.reward for p in pairs], t.group_size, t.normalize_std))


def judged(row: dict[str, Any]) -> bool:
    """Whether a ledger row is a canary the judge decided on (not a holdout, a refused command
    or a manual change, and not still running)."""
    return bool(row.get("decided_at") and row.get("started_ms") and row.get("candidate")
                and (row.get("kind") or "") in ("", "canary"))


def ledger_rows(settings: Settings, limit: int = 50) -> list[dict[str, Any]]:
    """The latest canaries of the MLflow ledger (``rtrl history``'s rows), each decided
    canary's with what its decision was judged on (``judged_on``, None when not recorded)."""
    from deployer.adapters.ledger_mlflow import MlflowLedger  # mlflow

    led = MlflowLedger(settings.mlflow.tracking_uri, settings.mlflow.deployments_experiment)
    rows = led.history(limit)
    for row in rows:
        if judged(row):
            doc = led.decision(row["run_id"]) or {}
            row["judged_on"] = doc.get("judged_on") or None
    return rows


def recorded_inputs(row: dict[str, Any]) -> JudgedOn | None:
    """The row's recorded ``judged_on``; None when absent or unreadable."""
    doc = row.get("judged_on")
    if not isinstance(doc, dict):
        return None
    try:
        return JudgedOn.from_doc(doc)
    except (KeyError, ValueError, TypeError):
        return None


def canaries(pairs: Sequence[Pair], rows: Sequence[dict[str, Any]], policy: JudgePolicy,
             where: dict[str, Position] | None = None) -> list[dict[str, Any]]:
    """Each decided canary judged again with the live and with the replayed rewards: would its
    verdict have been another? With its recorded inputs (and ``where``: the live records'
    positions) on exactly the records the deployer had read at its decision; without them on
    every record served from its start to its decision, boundaries its start alone."""
    out = []
    for row in rows:
        if not judged(row):
            continue
        on = recorded_inputs(row)
        exact = on is not None and where is not None
        if on is None or where is None:
            started = row["started_ms"] / 1000.0
            decided = datetime.fromisoformat(row["decided_at"]).timestamp()
            on = JudgedOn(started, decided)
            chosen = [p for p in pairs if p.live.served_ts.timestamp() <= decided]
        else:
            seen = on.saw
            chosen = [p for p in pairs if (pos := where.get(p.live.request_id)) is not None and seen(*pos)]
        verdicts = {}
        for side in ("live", "replayed"):
            window = CohortWindow(row["stable"], row["candidate"], on.started_at,
                                  horizon_s=policy.persistence_horizon_s)
            window.add_all(getattr(p, side) for p in chosen)
            v = judge_window(window, policy, on).verdict
            reward = next((e for e in v.metrics if e.metric == "reward"), None)
            verdicts[side] = {"verdict": v.decision.value, "users": [v.users_stable, v.users_canary],
                              "reward_difference": reward.estimate if reward else None}
        out.append({"canary_id": row["canary_id"], "candidate": row["candidate"], "stable": row["stable"],
                    "outcome": row["outcome"], "live": verdicts["live"], "replayed": verdicts["replayed"],
                    "changed": verdicts["live"]["verdict"] != verdicts["replayed"]["verdict"],
                    "exact": exact, "recorded_verdict": on.verdict if exact else None,
                    "reproduces": (verdicts["live"]["verdict"] == on.verdict) if exact else None})
    return out


def write(result: ReplayResult, settings: Settings, out: Path | None, topic: str | None, version: str) -> str:
    """Write the replayed records; where they went."""
    if topic:
        producer = make_producer(settings.kafka)
        try:
            for p in result.pairs:
                producer.send(topic, key=p.replayed.request_id.encode(),
                              value=p.replayed.model_dump_json().encode())
            producer.flush()
        finally:
            producer.close()
        return f"topic {topic}"
    path = out or Path(f"replay-{version}.jsonl")
    with path.open("w") as fh:
        fh.writelines(p.replayed.model_dump_json() + "\n" for p in result.pairs)
    return str(path)


def report(check: ReplayResult, new: ReplayResult, live_spec: RewardSpec, spec: RewardSpec,
           unreadable: dict[str, int]) -> dict[str, Any]:
    return {
        "live_spec": live_spec.version, "spec": spec.version,
        "check": {"records": len(check.pairs), "reproduced": sum(reproduced(p) for p in check.pairs)},
        "rewards": summarize(new.pairs),
        "skipped": {"events_without_live_record": new.without_live_record,
                    "events_after_close": new.after_close, "records_without_served_event": new.missing_served,
                    "unreadable_events": unreadable["events"], "unreadable_rewards": unreadable["rewards"]},
    }


def render(doc: dict[str, Any]) -> str:
    r, c = doc["rewards"], doc["check"]
    lines = [f"rtrl replay: {doc['spec']} over the live windows of {r['records']} requests "
             f"(live: {doc['live_spec']})",
             f"check: the live spec reproduces {c['reproduced']} of {c['records']} live records exactly",
             f"rewards: {r['changed']} changed, {r['sign_flips']} changed sign; mean {r['mean_live']:+.4f} "
             f"-> {r['mean_replayed']:+.4f} (mean |change| {r['mean_abs_change']:.4f})"]
    for row in r["by_version_arm"]:
        lines.append(f"  v{row['version']} {row['arm']:<7} {row['records']:>7} records: mean "
                     f"{row['mean_live']:+.4f} -> {row['mean_replayed']:+.4f}")
    adv = doc.get("advantages")
    if adv:
        lines.append(f"advantages: mean |change| {adv['mean_abs_change']:.4f}, "
                     f"{adv['sign_flip_share']:.1%} change sign")
    for k in doc.get("canaries") or []:
        if k["reproduces"] is None:
            how = " (judged on its start alone: its decision recorded no inputs)"
        elif k["reproduces"]:
            how = f" (the deployer's verdict, {k['recorded_verdict']}, reproduced)"
        else:
            how = f" (NOT the deployer's verdict, {k['recorded_verdict']}: were records deleted?)"
        lines.append(f"canary {k['canary_id']} ({k['outcome']}): judge {k['live']['verdict']} with the live "
                     f"rewards{how}, {k['replayed']['verdict']} with the replayed ones"
                     + ("  <- CHANGED" if k["changed"] else ""))
    lines.append(f"records written to {doc['written_to']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="rtrl replay", description="Recompute past rewards under another reward spec (same join, "
        "same windows) and report what would have changed.",
        epilog=exit_codes.epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", required=True, help="the reward spec to replay under (TOML)")
    ap.add_argument("--live-spec", default=None,
                    help="the spec the live rewards were made with "
                         "(default: RTRL_REWARD_SPEC, else the packaged one)")
    ap.add_argument("--from", dest="start", type=_time, default=None,
                    help="only requests served at or after T (ISO 8601 or Unix seconds)")
    ap.add_argument("--to", dest="end", type=_time, default=None, help="only requests served before T")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON-lines file for the replayed records (default replay-<spec version>.jsonl)")
    ap.add_argument("--topic", default=None, help="write the replayed records to this topic instead")
    ap.add_argument("--no-canaries", action="store_true", help="do not re-judge past canaries (no MLflow)")
    ap.add_argument("--strict", action="store_true",
                    help="exit 1 unless the live spec reproduces every live record")
    ap.add_argument("--json", action="store_true", help="print the report as one JSON document")
    args = ap.parse_args(argv)
    settings = bounded_settings(get_settings())
    bound_mlflow_env(settings.cli.timeout_s)
    try:
        spec, live_spec = load_spec(args.spec), load_spec(args.live_spec or settings.reward_spec)
    except SpecError as exc:
        print(f"rtrl replay: {exc}", file=sys.stderr)
        return exit_codes.USAGE
    if spec.version == live_spec.version and spec != live_spec:
        print(f"rtrl replay: {args.spec} differs from the live spec but has its version ({spec.version}); "
              "give it a version of its own so its records are never taken for live ones", file=sys.stderr)
        return exit_codes.USAGE
    if args.topic in (settings.topics.rewards, settings.topics.events, settings.topics.raw):
        print(f"rtrl replay: --topic {args.topic} is a live topic; name a topic of its own", file=sys.stderr)
        return exit_codes.USAGE
    try:
        preflight(settings, ("kafka",) if args.no_canaries else ("kafka", "mlflow"))
        events, live, unreadable, where = read_inputs(settings, args.start, args.end)
        check, new = replay(events, live, live_spec), replay(events, live, spec)
        doc = report(check, new, live_spec, spec, unreadable)
        doc["advantages"] = advantages(new.pairs, settings) if new.pairs else None
        doc["canaries"] = None
        if not args.no_canaries:
            from services.wiring.deployer import judge_policy_for  # the deployer's own

            doc["canaries"] = canaries(new.pairs, ledger_rows(settings),
                                       judge_policy_for(settings), where)
        doc["written_to"] = write(new, settings, args.out, args.topic, spec.version)
    except BackendUnavailableError as exc:
        print(message("replay", exc.failure, settings, settings.cli.timeout_s), file=sys.stderr)
        return exit_codes.UNAVAILABLE
    except Exception as exc:
        failure = backend_failure(exc)
        if failure is None:
            raise
        print(message("replay", failure, settings, settings.cli.timeout_s), file=sys.stderr)
        return exit_codes.UNAVAILABLE
    print(json.dumps(strict_json(doc), indent=2, sort_keys=True) if args.json else render(doc))
    ok = doc["check"]["reproduced"] == doc["check"]["records"]
    return exit_codes.FAILED if args.strict and not ok else exit_codes.OK
