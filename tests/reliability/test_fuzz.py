"""The fuzz run: a seeded corpus of ``fuzz_bad`` hostile records mixed with
``fuzz_valid_requests`` valid requests goes to the raw topic, through real ``rtrl serve
ingest`` and ``rtrl serve reward`` processes on the real broker and Redis.

Asserted: no worker dies (and each exits 0 on SIGTERM at the end); every bad record is in
the DLQ exactly once with the reason the corpus expects (and the original bytes); replays of
valid events are dropped by dedup, neither forwarded nor dead-lettered (docs/ingest.md,
``DLQ_DUPLICATES`` off); every valid event is forwarded exactly once and nothing else is;
every valid request gets exactly one reward, equal to what the pure reward maths gives for
its plan; the ingest metrics agree with the DLQ.
"""

from __future__ import annotations

import base64
import json
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ingest.auth import AuthPolicy
from ingest.reward.spec import load_spec
from ingest.validate import REASONS, Limits, validate
from services.runtime.kafka_io import ensure_topics, make_producer
from services.settings.model import Settings
from tests.reliability import fuzz_corpus, procs, scale

KEYS = {"gateway": b"fuzz-gateway-secret", "ide": b"fuzz-ide-secret"}
SEED = 20261122
TIME_SCALE = 0.01
"""Reward windows: 3630 s x 0.01 = 36 s at most."""


def test_fuzz_corpus_through_ingest_and_reward(settings: Settings, tmp_path: Path) -> None:
    size = scale.current()
    t_start = time.monotonic()
    corpus = fuzz_corpus.build(SEED, size.fuzz_bad, size.fuzz_valid_requests, datetime.now(UTC), KEYS)
    recs = corpus.records
    expected = corpus.count()
    n_bad = sum(n for k, n in expected.items() if k != "valid")
    assert n_bad >= size.fuzz_bad
    assert set(REASONS) - {"duplicate"} <= set(expected), "every reason code must be exercised"

    # the pure validator agrees with the corpus (a disagreement is a corpus or validator bug)
    policy = AuthPolicy(keys=KEYS)
    now = datetime.now(UTC)
    pure: Counter[tuple[str, str, str]] = Counter()
    for r in recs:
        want = "valid" if r.expect == "duplicate" else r.expect
        reason = getattr(validate(r.value, r.headers, r.key, now, Limits(), policy), "reason", "valid")
        pure[(r.case, want, reason)] += reason != want
    assert not +pure, f"pure validator disagrees with the corpus: {dict(+pure)}"

    s = settings
    ensure_topics(s)
    env = procs.base_env(s, tmp_path, RTRL_AUTH__KEYS=json.dumps({k: v.decode() for k, v in KEYS.items()}),
                         RTRL_INGEST__GROUP_ID=f"ingest-{s.topics.raw}",
                         RTRL_INGEST__POLL_TIMEOUT_MS="100",
                         RTRL_REWARD__GROUP_ID=f"reward-{s.topics.raw}")
    ingest = procs.start("ingest", ["--port", "0"], env, tmp_path)
    reward = procs.start("reward", ["--port", "0", "--time-scale", str(TIME_SCALE)], env, tmp_path)
    services = [ingest, reward]
    dlq = procs.TopicReader(s, s.topics.dlq)
    events = procs.TopicReader(s, s.topics.events)
    rewards = procs.TopicReader(s, s.topics.rewards)
    try:
        procs.wait_until(lambda: ingest.get("/readyz")[0] == 200, 60, "ingest ready", services)
        procs.wait_until(lambda: "reward worker up" in reward.text(), 60, "reward worker up", services)

        # ---- send everything, remembering where each record landed
        producer = make_producer(s.kafka, linger_ms=20, max_request_size=2 * 1024 * 1024)
        futures = [producer.send(s.topics.raw, value=r.value, key=r.key, headers=r.headers) for r in recs]
        producer.flush(120)
        producer.close()
        position: dict[tuple[int, int], int] = {}
        for i, fut in enumerate(futures):
            md = fut.get(timeout=30)
            position[(md.partition, md.offset)] = i
        sent_s = time.monotonic() - t_start

        n_dlq = sum(n for k, n in expected.items() if k not in ("valid", "duplicate"))
        dlq_recs = dlq.read(n_dlq, timeout_s=120, services=services)
        ev_recs = events.read(expected["valid"], timeout_s=60, services=services)
        rw_recs = rewards.read(len(corpus.plans), timeout_s=150, settle_s=3, services=services)
        assert ingest.alive() and reward.alive()
        ingest_metrics = ingest.get("/metrics")[1]
        reward_metrics = reward.get("/metrics")[1]
        health = {svc.name: (svc.get("/healthz")[0], svc.get("/readyz")[0]) for svc in services}
    finally:
        for reader in (dlq, events, rewards):
            reader.close()
        codes = {svc.name: svc.stop() for svc in services}
    assert codes == {"ingest": 0, "reward": 0}, codes
    assert health == {"ingest": (200, 200), "reward": (200, 200)}, health

    # ---- DLQ: every bad record once, with its expected reason and its original bytes
    dlq_docs = [json.loads(r.value) for r in dlq_recs]
    seen: Counter[int] = Counter()
    wrong: Counter[tuple[str, str, str]] = Counter()
    for rec, doc in zip(dlq_recs, dlq_docs, strict=True):
        src = doc["source"]
        assert src["topic"] == s.topics.raw
        i = position[(src["partition"], src["offset"])]
        seen[i] += 1
        bad = recs[i]
        if doc["reason"] != bad.expect:
            wrong[(bad.case, bad.expect, doc["reason"])] += 1
        assert dict(rec.headers)["rtrl-reason"] == doc["reason"].encode()
        assert doc["detail"], doc
        original = bad.value or b""
        assert doc["original_size"] == len(original)
        assert base64.b64decode(doc["original_b64"]) == original[: 512 * 1024]
        assert doc["original_truncated"] == (len(original) > 512 * 1024)
    assert not wrong, f"DLQ reasons differ from the corpus (case, expected, got): {dict(wrong)}"
    assert max(seen.values()) == 1, "a record was dead-lettered twice"
    should = {i for i, r in enumerate(recs) if r.expect not in ("valid", "duplicate")}
    assert set(seen) == should, (f"{len(should - set(seen))} bad records missing from the DLQ, "
                                 f"{len(set(seen) - should)} good ones in it")
    dlq_by_reason = Counter(d["reason"] for d in dlq_docs)

    # ---- events: each valid event forwarded once; no bad record and no replay forwarded
    forwarded: Counter[str] = Counter()
    for rec in ev_recs:
        _topic, part, off = dict(rec.headers)["rtrl-source"].decode().rsplit(":", 2)
        src_rec = recs[position[(int(part), int(off))]]
        assert src_rec.expect == "valid", f"forwarded a {src_rec.case} record"
        forwarded[json.loads(rec.value)["event_id"]] += 1
    valid_ids = {r.event_id for r in recs if r.expect == "valid"}
    assert set(forwarded) == valid_ids and max(forwarded.values()) == 1

    # ---- rewards: exactly one per valid request, equal to the pure maths on its plan
    spec = load_spec()
    got: Counter[str] = Counter(json.loads(r.value)["request_id"] for r in rw_recs)
    assert set(got) == set(corpus.plans), (f"missing {sorted(set(corpus.plans) - set(got))[:5]}, "
                                           f"unexpected {sorted(set(got) - set(corpus.plans))[:5]}")
    assert max(got.values()) == 1, f"requests rewarded twice: {[k for k, v in got.items() if v > 1][:5]}"
    mismatches: list[dict[str, Any]] = []
    for rec in rw_recs:
        doc = json.loads(rec.value)
        plan = corpus.plans[doc["request_id"]]
        reward_v, comps = corpus.expected_reward(doc["request_id"], spec)
        fb = plan.feedback()
        ok = (abs(doc["reward"] - reward_v) < 1e-9
              and all(abs(doc["components"][k] - v) < 1e-9 for k, v in comps.items())
              and doc["served_event_id"] == plan.served.event_id
              and doc["arm"] == plan.served.arm and doc["latency_ms"] == plan.served.latency_ms
              and doc["behavior_logprobs"] == list(plan.served.logprobs)
              and doc["dissatisfied"] == fb.dissatisfied
              and doc["accepted"] == (fb.accepted if plan.served.completion_kind == "edit" else None)
              and doc["reward_spec_version"] == spec.version)
        if not ok:
            mismatches.append({"request": doc["request_id"], "scenario": plan.scenario, "got": doc["reward"],
                               "want": reward_v, "components": doc["components"], "want_components": comps})
    assert not mismatches, f"{len(mismatches)} wrong rewards, e.g. {mismatches[:3]}"

    # ---- the ingest metrics agree (counted after each batch's commit)
    m = procs.metric
    assert m(ingest_metrics, "rtrl_ingest_events_total", result="valid") == expected["valid"]
    assert m(ingest_metrics, "rtrl_ingest_events_total", result="duplicate") == expected["duplicate"]
    assert m(ingest_metrics, "rtrl_ingest_events_total", result="rejected") == n_dlq
    for reason, n in dlq_by_reason.items():
        assert m(ingest_metrics, "rtrl_ingest_rejected_total", reason=reason) == n, reason
    assert m(reward_metrics, "rtrl_reward_events_total", type="invalid") == 0
    assert m(reward_metrics, "rtrl_reward_orphan_events_total") == 0

    scenarios = Counter(p.scenario for p in corpus.plans.values())
    scale.record("fuzz", {
        "corpus_records": len(recs),
        "corpus_bad": n_bad,
        "corpus_bad_by_category": corpus.by_category(),
        "corpus_cases": len({r.case for r in recs if r.expect != "valid"}),
        "valid_requests": len(corpus.plans),
        "valid_events": expected["valid"],
        "valid_scenarios": dict(sorted(scenarios.items())),
        "dlq_by_reason": dict(sorted(dlq_by_reason.items())),
        "dlq_total": len(dlq_recs),
        "duplicates_dropped": int(m(ingest_metrics, "rtrl_ingest_events_total", result="duplicate")),
        "events_forwarded": len(ev_recs),
        "requests_rewarded": len(rw_recs),
        "reward_mismatches": len(mismatches),
        "late_events_counted": int(sum(m(reward_metrics, "rtrl_reward_late_events_total", type=t)
                                       for t in ("edit.accepted", "edit.rejected", "edit.persistence",
                                                 "followup.dissatisfied", "completion.served"))),
        "worker_crashes": 0,
        "worker_restarts": 0,
        "worker_exit_codes": codes,
        "send_seconds": round(sent_s, 1),
        "total_seconds": round(time.monotonic() - t_start, 1),
    })
