"""The exactly-once loop across a broker restart in the middle of a transaction.

A real broker (the embedded one) is stopped and started again after a transaction's outputs
were acknowledged and before its offsets and commit were sent. The embedded broker comes
back without the transaction's partitions but accepts its offsets and commit: a loop that
trusted that commit moved its input on while the outputs stayed invisible (lost). The loop
must abort such a transaction and replay the batch instead.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from kafka.errors import KafkaError
from kafka.structs import TopicPartition

from services.runtime.exactly_once import Batch, ExactlyOnceLoop, Output
from services.runtime.health import Health
from services.runtime.kafka_io import ConnectionWatch, ensure_topics, make_consumer, make_producer, read_topic
from services.runtime.process import Stopper
from services.settings.model import KafkaSettings, Settings, TopicSettings
from services.stack.embedded import EmbeddedStack, free_port

pytestmark = pytest.mark.integration

RECORDS = 40
BATCH = 5


class Copy:
    """Each input record becomes one output record carrying its source offset."""

    def __init__(self, out_topic: str) -> None:
        self.out = out_topic

    def transform(self, polled: Mapping[TopicPartition, Sequence[Any]],
                  assigned: Sequence[TopicPartition]) -> Batch[None]:
        outs = [Output(self.out, value=r.value, headers=(("src", str(r.offset).encode()),))
                for recs in polled.values() for r in recs]
        return Batch(outs, None)

    def committed(self, batch: Batch[None], delivered: Sequence[Any]) -> None:
        pass

    def recover(self, partitions: Sequence[TopicPartition]) -> None:
        pass


def _restart_in(point: str, tmp_path: Path) -> tuple[list[bytes], int | None]:
    st = EmbeddedStack(data_dir=tmp_path, kafka_port=free_port(), redis_port=free_port(),
                       reuse_redis_url=None, with_mlflow=False)
    st.up(timeout_s=60)
    try:
        s = Settings(kafka=KafkaSettings(bootstrap_servers=st.kafka_bootstrap),
                     topics=TopicSettings(raw="eo.in", events="eo.out", rewards="eo.rw", dlq="eo.dlq",
                                          partitions=1))
        ensure_topics(s, ["eo.in", "eo.out"])
        prod = make_producer(s.kafka)
        for i in range(RECORDS):
            prod.send("eo.in", value=f"r{i}".encode())
        prod.flush()
        prod.close()

        def open_producer() -> Any:
            p = make_producer(s.kafka, transactional_id=f"eo-{uuid.uuid4().hex[:8]}")
            p.init_transactions()
            assert ConnectionWatch(p).watching, "the installed kafka-python no longer exposes its connections"
            return p

        consumer = make_consumer(s.kafka, "eo-group", max_poll_records=BATCH)
        loop: ExactlyOnceLoop[None] = ExactlyOnceLoop(
            "eo-test", consumer, open_producer, Copy("eo.out"), Health(),
            poll_timeout_ms=200, max_records=BATCH, fault=None)
        restarted = threading.Event()

        def fault(at: str) -> None:
            if at == point and not restarted.is_set():
                restarted.set()
                assert loop.producer is not None
                loop.producer.flush(timeout=10)  # the outputs are acknowledged before the restart
                assert st.stop_service("kafka")
                st.start_service("kafka", timeout_s=60)

        loop.fault = fault
        loop.start(["eo.in"])
        stopper = Stopper()
        runner = threading.Thread(target=loop.run, args=(stopper,), daemon=True)
        runner.start()
        tp = TopicPartition("eo.in", 0)
        check = make_consumer(s.kafka, "eo-group")  # reads the group's committed offset, never joins it
        committed = None
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and runner.is_alive():
                time.sleep(0.5)
                try:
                    committed = check.committed(tp)
                except KafkaError:  # the broker is restarting
                    committed = None
                if restarted.is_set() and committed == RECORDS:
                    break
        finally:
            stopper.stop()
            runner.join(timeout=30)
            loop.close()
            check.close()
        assert restarted.is_set(), "the fault never ran"
        return [r.value for r in read_topic(s.kafka, "eo.out", idle_timeout_s=3)], committed
    finally:
        st.down()


@pytest.mark.parametrize("point", ["mid_txn", "before_commit", "after_commit"])
def test_a_broker_restart_inside_a_transaction_loses_and_duplicates_nothing(
        point: str, tmp_path: Path) -> None:
    values, committed = _restart_in(point, tmp_path)
    expected = [f"r{i}".encode() for i in range(RECORDS)]
    missing = sorted(set(expected) - set(values), key=lambda v: int(v[1:]))
    dup = sorted({v for v in values if values.count(v) > 1})
    assert committed == RECORDS, f"committed offset {committed}"
    assert not missing, f"{len(missing)} inputs have no visible output: {missing}"
    assert not dup, f"duplicated outputs: {dup}"
    assert len(values) == RECORDS
