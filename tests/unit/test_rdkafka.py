"""The librdkafka transport's own logic (services/runtime/rdkafka.py), on a fake of
confluent-kafka's consumer: error translation, settings mapping, delivery reports, and the
pause/resume that keeps an idle member from fetching in a loop."""

from __future__ import annotations

from typing import Any

import confluent_kafka as ck
import pytest
from kafka.errors import KafkaTimeoutError, MessageSizeTooLargeError, ProducerFencedError
from kafka.structs import TopicPartition

from services.runtime import rdkafka
from services.runtime.exactly_once import RETRIABLE
from services.runtime.kafka_io import ConnectionWatch
from services.runtime.rdkafka import RdConsumer, RdKafkaError, base_config, translate
from services.runtime.transactions import Sent
from services.settings.model import KafkaSettings

pytestmark = pytest.mark.unit


def _exc(code: int) -> ck.KafkaException:
    return ck.KafkaException(ck.KafkaError(code))


def test_errors_become_the_kafka_python_errors_the_loop_handles() -> None:
    assert isinstance(translate(_exc(ck.KafkaError._FENCED)), ProducerFencedError)
    assert isinstance(translate(_exc(ck.KafkaError.INVALID_PRODUCER_EPOCH)), ProducerFencedError)
    assert isinstance(translate(_exc(ck.KafkaError.MSG_SIZE_TOO_LARGE)), MessageSizeTooLargeError)
    assert isinstance(translate(_exc(ck.KafkaError._TIMED_OUT)), KafkaTimeoutError)
    assert isinstance(translate(_exc(ck.KafkaError._UNKNOWN_PARTITION)), ValueError)
    other = translate(_exc(ck.KafkaError._TRANSPORT))
    assert isinstance(other, RdKafkaError) and isinstance(other, RETRIABLE)
    assert "_TRANSPORT" in str(other)
    assert not isinstance(translate(_exc(ck.KafkaError._FENCED)), RdKafkaError)


def test_connection_settings_map_to_librdkafka_names() -> None:
    plain = base_config(KafkaSettings(bootstrap_servers=" a:9092, b:9093 ", client_id="x",
                                      request_timeout_ms=7000))
    assert plain == {"bootstrap.servers": "a:9092,b:9093", "security.protocol": "plaintext",
                     "client.id": "x", "socket.timeout.ms": 7000}
    secure = base_config(KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
                                       sasl_username="u", sasl_password="p", ssl_cafile="/ca.pem",
                                       ssl_certfile="/c.pem", ssl_keyfile="/k.pem"))
    assert secure["security.protocol"] == "sasl_ssl"
    sasl = (secure["sasl.mechanism"], secure["sasl.username"], secure["sasl.password"])
    assert sasl == ("SCRAM-SHA-512", "u", "p")
    assert (secure["ssl.ca.location"], secure["ssl.certificate.location"], secure["ssl.key.location"]) == \
        ("/ca.pem", "/c.pem", "/k.pem")


class _Msg:
    def __init__(self, partition: int, offset: int, err: ck.KafkaError | None = None) -> None:
        self._p, self._o, self._err = partition, offset, err

    def topic(self) -> str:
        return "t"

    def partition(self) -> int:
        return self._p

    def offset(self) -> int:
        return self._o

    def timestamp(self) -> tuple[int, int]:
        return (1, 1000 + self._o)

    def key(self) -> bytes:
        return b"k"

    def value(self) -> bytes:
        return f"v{self._o}".encode()

    def headers(self) -> list[tuple[str, bytes]] | None:
        return [("h", b"1")]

    def error(self) -> ck.KafkaError | None:
        return self._err


def _eof(partition: int, end: int) -> _Msg:
    """librdkafka's end-of-partition event: its offset is where the partition ends."""
    return _Msg(partition, end, ck.KafkaError(ck.KafkaError._PARTITION_EOF))


def test_a_partition_with_records_to_read_is_never_paused(fake: _FakeConsumer) -> None:
    c = RdConsumer(KafkaSettings(), "g", client=fake)
    fake.queue = [_eof(0, 5)]
    c.poll()
    c.poll()
    assert fake.paused == {0}  # partition 1 never reached its end (e.g. its fetch is starting)
    fake.high[0] = 6
    fake.queue = [_Msg(0, 5)]
    c.poll()
    c.poll()
    assert fake.paused == set()  # partition 0 got a record: no longer at its end


class _FakeConsumer:
    """What RdConsumer calls of confluent-kafka's Consumer, over two partitions of topic t."""

    def __init__(self) -> None:
        self.assigned = {0, 1}
        self.high = {0: 5, 1: 7}
        self.queue: list[_Msg] = []
        self.paused: set[int] = set()
        self.consumes: list[float] = []
        self.watermark_reads = 0
        self.callbacks: dict[str, Any] = {}

    def subscribe(self, topics: list[str], **callbacks: Any) -> None:
        self.callbacks = callbacks

    def consume(self, n: int, timeout: float) -> list[_Msg]:
        self.consumes.append(timeout)
        out = [m for m in self.queue if m.partition() not in self.paused][:n]
        self.queue = [m for m in self.queue if m not in out]
        return out

    def assignment(self) -> list[ck.TopicPartition]:
        return [ck.TopicPartition("t", p) for p in sorted(self.assigned)]

    def pause(self, parts: list[ck.TopicPartition]) -> None:
        self.paused |= {p.partition for p in parts}

    def resume(self, parts: list[ck.TopicPartition]) -> None:
        self.paused -= {p.partition for p in parts}

    def get_watermark_offsets(self, tp: ck.TopicPartition, timeout: float, cached: bool) -> tuple[int, int]:
        assert not cached
        self.watermark_reads += 1
        return (0, self.high[tp.partition])


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> _FakeConsumer:
    monkeypatch.setattr(rdkafka, "PAUSE_AFTER_S", 0.0)
    return _FakeConsumer()


def test_records_come_back_by_partition_with_kafka_python_field_names(fake: _FakeConsumer) -> None:
    c = RdConsumer(KafkaSettings(), "g", client=fake)
    fake.queue = [_Msg(0, 3), _Msg(1, 9), _Msg(0, 4), _Msg(0, 5, ck.KafkaError(ck.KafkaError._PARTITION_EOF))]
    got = c.poll(max_records=10)
    assert sorted(got) == [TopicPartition("t", 0), TopicPartition("t", 1)]
    first = got[TopicPartition("t", 0)][0]
    f = first
    fields = (f.topic, f.partition, f.offset, f.timestamp, f.key, f.value, f.headers)
    assert fields == ("t", 0, 3, 1003, b"k", b"v3", [("h", b"1")])
    assert [r.offset for r in got[TopicPartition("t", 0)]] == [3, 4]  # end of partition is no record


def test_a_record_error_is_raised_as_a_retriable_error(fake: _FakeConsumer) -> None:
    c = RdConsumer(KafkaSettings(), "g", client=fake)
    fake.queue = [_Msg(0, 3, ck.KafkaError(ck.KafkaError._TRANSPORT))]
    with pytest.raises(RdKafkaError):
        c.poll()


def test_a_quiet_member_pauses_and_resumes_only_partitions_that_moved(fake: _FakeConsumer) -> None:
    c = RdConsumer(KafkaSettings(), "g", client=fake)
    assert c.poll() == {} and not fake.paused  # the first empty poll starts the quiet clock
    assert c.poll() == {} and not fake.paused  # quiet, but not read to the end: keeps fetching
    fake.queue = [_eof(0, 5), _eof(1, 7)]
    assert c.poll() == {}
    assert fake.paused == {0, 1}  # read to the end and quiet: nothing is fetched any more
    reads = fake.watermark_reads
    polls = len(fake.consumes)
    assert c.poll() == {} and fake.paused == {0, 1}  # watermarks unchanged: stays paused
    assert fake.watermark_reads == reads + 2
    # still polled, without waiting: the group sees a live member
    assert len(fake.consumes) == polls + 1 and fake.consumes[-1] == 0
    fake.high[1] = 9  # partition 1 got records
    fake.queue = [_Msg(1, 7), _Msg(1, 8)]
    got = c.poll()
    assert [r.offset for r in got[TopicPartition("t", 1)]] == [7, 8]
    assert fake.paused == {0}  # only the partition that moved was resumed


def test_a_seek_resumes_the_partition_and_revocation_forgets_it(fake: _FakeConsumer) -> None:
    seeks: list[ck.TopicPartition] = []
    fake.seek = seeks.append  # type: ignore[attr-defined]
    c = RdConsumer(KafkaSettings(), "g", client=fake)
    c.poll()
    fake.queue = [_eof(0, 5), _eof(1, 7)]
    c.poll()
    assert fake.paused == {0, 1}
    c.seek(TopicPartition("t", 0), 3)
    assert fake.paused == {1} and (seeks[0].partition, seeks[0].offset) == (0, 3)
    revoked: list[Any] = []

    class Listener:
        def on_partitions_revoked(self, parts: list[TopicPartition]) -> None:
            revoked.extend(parts)

        def on_partitions_assigned(self, parts: list[TopicPartition]) -> None:
            raise RuntimeError("recover failed")

    c.subscribe(["t"], Listener())
    fake.callbacks["on_revoke"](fake, [ck.TopicPartition("t", 1)])
    assert revoked == [TopicPartition("t", 1)]
    fake.paused.clear()
    fake.assigned = {0}
    fake.callbacks["on_assign"](fake, [ck.TopicPartition("t", 0)])  # the error waits for the poll
    with pytest.raises(RuntimeError, match="recover failed"):
        c.poll()


def test_a_record_written_just_before_the_pause_resumes_the_partition(fake: _FakeConsumer) -> None:
    c = RdConsumer(KafkaSettings(), "g", client=fake)
    fake.queue = [_eof(0, 5), _eof(1, 7)]
    c.poll()
    fake.high[0] = 6  # written after the end-of-partition event, before the pause
    fake.queue = [_Msg(0, 5)]
    fake.paused = {0, 1}  # as if the pause had purged what was fetched
    c._paused = {TopicPartition("t", 0): 5, TopicPartition("t", 1): 7}
    got = c.poll()
    assert [r.offset for r in got[TopicPartition("t", 0)]] == [5]  # its mark was the end, not the watermark
    assert fake.paused == {1}


def test_a_rebalance_resumes_what_the_member_had_paused(fake: _FakeConsumer) -> None:
    c = RdConsumer(KafkaSettings(), "g", client=fake)
    c.subscribe(["t"])
    fake.queue = [_eof(0, 5), _eof(1, 7)]
    c.poll()
    c.poll()
    assert fake.paused == {0, 1}
    fake.callbacks["on_revoke"](fake, [ck.TopicPartition("t", 0), ck.TopicPartition("t", 1)])
    fake.callbacks["on_assign"](fake, [ck.TopicPartition("t", 0), ck.TopicPartition("t", 1)])
    assert fake.paused == set()  # librdkafka would have kept the pause across the rebalance
    fake.queue = [_Msg(1, 7)]
    assert [r.offset for r in c.poll()[TopicPartition("t", 1)]] == [7]


def test_a_fatal_consumer_error_stops_the_process_and_a_committed_error_is_no_empty_offset(
        fake: _FakeConsumer) -> None:
    c = RdConsumer(KafkaSettings(), "g", client=fake)
    fatal = ck.KafkaError(ck.KafkaError.FENCED_INSTANCE_ID, "fenced", fatal=True)
    fake.queue = [_Msg(0, 1, fatal)]
    with pytest.raises(rdkafka.FatalConsumerError, match="for good"):
        c.poll()
    class Failed:  # a partition of committed()'s answer that carries an error
        offset = ck.OFFSET_INVALID
        error = ck.KafkaError(ck.KafkaError.TOPIC_AUTHORIZATION_FAILED)

    fake.committed = lambda parts, timeout: [Failed()]  # type: ignore[attr-defined]
    with pytest.raises(RdKafkaError):
        c.committed(TopicPartition("t", 0))


def test_a_delivery_report_completes_the_send() -> None:
    ok, failed = Sent(), Sent()
    assert not ok.is_done
    with pytest.raises(KafkaTimeoutError):
        ok.get()
    ok.report(None, _Msg(2, 41))
    assert ok.is_done and not ok.failed() and (ok.get().partition, ok.get().offset) == (2, 41)
    failed.report(ck.KafkaError(ck.KafkaError.MSG_SIZE_TOO_LARGE), None)
    assert failed.failed() and isinstance(failed.exception, MessageSizeTooLargeError)


def test_a_lost_connection_interrupts_the_transaction_watch() -> None:
    class Producer:
        disconnects = 0

    p = Producer()
    watch = ConnectionWatch(p)  # type: ignore[arg-type]
    assert watch.watching and not watch.interrupted()
    p.disconnects = 1
    assert watch.interrupted()
