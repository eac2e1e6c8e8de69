"""``rtrl reconcile`` reads past any bytes on any of its four topics (a real broker, the
real command): no traceback, its documented exit code, unreadable records reported as such."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.runtime.kafka_io import ensure_topics, make_producer
from services.settings.model import Settings
from tests.service_env import service_env

pytestmark = pytest.mark.integration

HOSTILE: list[bytes | None] = [
    b"[" * 100_000 + b"]" * 100_000,                 # nesting deeper than any parser's stack
    b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b"\xff\xfe\x00garbage",                           # not UTF-8
    None,                                             # a tombstone
    b'{"request_id": ' + b"9" * 5_000 + b"}",         # a huge integer
    b"[1, 2]", b'"just a string"', b"null", b"NaN",
    b'{"source": {"topic": "x", "partition": [1], "offset": {"o": 1}}, "reason": "' + b"r" * 5_000 + b'"}',
    b'{"source": "not an object"}',
    b'{"event_id": ' + b"[" * 5_000 + b"]" * 5_000 + b"}",
    b'{"type": "completion.served", "ts": "0001-01-01T00:00:00+14:00"}',
]


def test_reconcile_survives_any_bytes_on_every_topic(settings: Settings, tmp_path: Path) -> None:
    t = settings.topics
    ensure_topics(settings)
    prod = make_producer(settings.kafka, max_request_size=4 * 1024 * 1024)
    for topic in (t.raw, t.events, t.dlq, t.rewards):
        for i, value in enumerate(HOSTILE):
            prod.send(topic, value=value, key=f"k{i}".encode() if i % 2 else None)
    prod.flush()
    prod.close()
    env = service_env(settings, tmp_path / "no-stack")
    out = subprocess.run([sys.executable, "-m", "services.cli", "reconcile", "--ignore-offsets", "--json"],
                         env=env, capture_output=True, text=True, timeout=180, check=False)
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.returncode in (0, 1), (out.returncode, out.stderr[-2000:])
    rep = json.loads(out.stdout)
    n = len(HOSTILE)
    assert rep["raw_records"] == n
    assert rep["forwarded_events"] == n and rep["forwarded_unparseable"] == n
    assert rep["dlq_records"] == n and rep["dlq_unreadable"] == n
    assert rep["rewards_unreadable"] == sum(1 for i in range(n) if i % 2 == 0)  # no key, no request_id
    assert rep["reward_records"] + rep["rewards_unreadable"] == n
    # nothing ingest did is on these topics: every raw record is unaccounted for, so exit 1
    assert out.returncode == 1 and len(rep["raw_lost"]) == n
