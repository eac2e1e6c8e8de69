from __future__ import annotations

import functools
import math
import multiprocessing
import os
import time
from typing import Any

import pytest

from bench.gateway import measure, percentile, summarise


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([5.0], 99) == 5.0


def test_measure_alternates_and_pairs_overhead() -> None:
    order: list[str] = []

    def direct(i: int) -> None:
        order.append("d")

    def gateway(i: int) -> float:
        order.append("g")
        return 0.0

    res = measure(4, 2, direct, gateway)
    assert order == ["d", "g", "g", "d"] * 3
    assert [len(v) for v in res.values()] == [4, 4, 4]
    assert all(o == pytest.approx(g) for o, g in zip(res["overhead"], res["gateway"], strict=True))


def test_summarise_differences() -> None:
    res = {"direct": [1.0] * 99 + [3.0], "gateway": [1.5] * 99 + [4.0], "overhead": [0.5] * 100}
    s = summarise("x", res)
    assert s["added_p50_ms"] == pytest.approx(0.5) and s["added_p99_ms"] == pytest.approx(0.5)
    assert s["overhead_p99_ms"] == pytest.approx(0.5) and s["ratio_p99"] == pytest.approx(1.5)


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
def test_the_fake_engine_speaks_what_the_gateway_reads(kind: str, stream: bool) -> None:
    """The relay benchmark's stand-in engine answers in vLLM's shape: the gateway's own engine
    backend gets the ids, text and logprobs it would get from vLLM."""
    from bench.fake_engine import PROMPT_IDS, FakeEngine
    from services.gateway.engine_backend import EngineBackend, EngineClient
    from services.gateway.generation import GenRequest

    fake = FakeEngine(token_ms=0.0).start()
    try:
        backend = EngineBackend(EngineClient(fake.base_url), "base")
        req = (GenRequest("chat", 5, 1.0, messages=({"role": "user", "content": "hi"},), seed=2)
               if kind == "chat" else GenRequest("completion", 5, 1.0, prompt="hi", seed=2))
        for _ in range(3):
            pieces = list(backend.stream(req, stream=stream))
        # each request runs once, on one kept-alive connection
        assert (fake.posts, fake.connections) == (3, 1)
        tokens = [t for p in pieces for t in p.tokens]
        assert tokens == [5, 6, 7, 8, 9]
        assert [lp for p in pieces for lp in p.logprobs] == [-0.5] * 5
        assert "".join(p.text for p in pieces) == " w5 w6 w7 w8 w9"
        assert any(p.prompt_tokens == PROMPT_IDS for p in pieces)
        assert pieces[-1].finish_reason == "length"
        backend.client.close()
    finally:
        fake.stop()


def _boom(why: str) -> Any:
    raise ValueError(why)


class _Parent:
    """A server that starts a process of its own, as the gateway starts its exposure writer."""

    def __init__(self) -> None:
        self.child = multiprocessing.get_context("spawn").Process(target=_idle)
        self.child.start()
        self.url = f"pid:{self.child.pid}"

    def stop(self) -> None:
        self.child.terminate()
        self.child.join(5)


def _idle() -> None:
    time.sleep(60)


@pytest.mark.parametrize("stream", [False, True])
def test_the_baseline_relay_passes_the_engines_bytes_unchanged_from_its_own_process(stream: bool) -> None:
    """The bench's baseline: a stand-in engine and a do-nothing relay, each in its own process;
    the relayed answer is the engine's, byte for byte, on one keep-alive connection."""
    import json
    import re

    from bench.gateway_engine import Poster
    from bench.processes import Apart, fake_engine, tcp_relay

    engine = Apart(fake_engine, 0.0).start()
    relay = Apart(tcp_relay, engine.url).start()
    try:
        body = json.dumps({"model": "base", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 3, "seed": 4, "stream": stream}).encode()
        path = "/v1/chat/completions"
        direct, relayed = Poster(engine.url, path), Poster(relay.url, path)
        for _ in range(3):
            answers = [p.post(body) for p in (direct, relayed)]
            same = [re.sub(rb'"created": \d+', b"", a) for a in answers]  # the clock's second may turn
            assert same[0] == same[1] and b"token_ids" in answers[1]
        direct.close()
        relayed.close()
    finally:
        relay.stop()
        engine.stop()


def test_ctrl_c_leaves_the_stop_to_the_parent_and_a_relay_stops_with_connections_open(
        capfd: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C reaches every process of the group: a server's process goes on serving until the
    parent's stop (a stop cut short left a gateway's shipper running for ever), and the relay
    ends its open connections without a traceback."""
    import signal
    import socket

    from bench.processes import Apart, fake_engine, tcp_relay

    engine = Apart(fake_engine, 0.0).start()
    relay = Apart(tcp_relay, engine.url).start()
    try:
        host, port = relay.url.removeprefix("http://").split(":")
        held = socket.create_connection((host, int(port)))  # an open connection through the relay
        for proc in (engine._proc, relay._proc):
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.5)
        assert engine._proc.is_alive() and relay._proc.is_alive()
    finally:
        relay.stop()
        engine.stop()
    held.close()
    assert relay._proc.exitcode == 0 and engine._proc.exitcode == 0
    err = capfd.readouterr().err
    ours = [t for t in err.split("Traceback")[1:]  # a thread an earlier test left may log here too
            if any(w in t for w in ("bench/processes.py", "asyncio", "KeyboardInterrupt"))]
    assert not ours and "Event loop is closed" not in err, err


def test_a_server_in_its_own_process_may_start_processes_of_its_own() -> None:
    from bench.processes import Apart

    server = Apart(_Parent).start()
    assert server.url.startswith("pid:")
    server.stop()


def test_a_server_that_fails_to_start_in_its_process_says_why() -> None:
    from bench.processes import Apart

    with pytest.raises(RuntimeError, match="ValueError: no port for you"):
        Apart(_boom, "no port for you").start()


def _comm(pid: int | None) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _spin(seconds: float, name: str | None = None) -> None:
    if name is not None:
        from services.runtime.process import name_process

        name_process(name)
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    time.sleep(60)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_a_servers_cpu_counts_the_processes_it_started() -> None:
    """The bench's service time: a process's CPU includes its children's (the gateway's
    exposure writer), and a process that does not exist reads NaN."""
    from bench.processes import tree_cpu_s

    before = tree_cpu_s(os.getpid())
    child = multiprocessing.get_context("spawn").Process(target=_spin, args=(0.4,))
    child.start()
    try:
        deadline = time.monotonic() + 30
        while tree_cpu_s(child.pid or -1) < 0.4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree_cpu_s(child.pid or -1) >= 0.4
        assert tree_cpu_s(os.getpid()) - before >= 0.4  # the child's CPU is the parent's tree's
        assert tree_cpu_s(os.getpid(), children=False) < tree_cpu_s(os.getpid()) - 0.3
        # a child by its process name (the gateway's shipper) can be left out
        assert tree_cpu_s(os.getpid(), skip="rtrl-spin-test") >= tree_cpu_s(os.getpid()) - 0.1
        named = multiprocessing.get_context("spawn").Process(target=_spin, args=(0.6, "rtrl-spin-test"))
        named.start()
        try:
            while _comm(named.pid) != "rtrl-spin-test" and time.monotonic() < deadline:
                time.sleep(0.01)  # it has imported what it needs and named itself: now it spins
            me = os.getpid()
            all_before, skipped_before = tree_cpu_s(me), tree_cpu_s(me, skip="rtrl-spin-test")
            spun = tree_cpu_s(named.pid or -1)
            while tree_cpu_s(named.pid or -1) < spun + 0.4 and time.monotonic() < deadline:
                time.sleep(0.05)
            grew = tree_cpu_s(me) - all_before
            assert grew >= 0.4 and tree_cpu_s(me, skip="rtrl-spin-test") - skipped_before < grew - 0.3
        finally:
            named.terminate()
            named.join(5)
    finally:
        child.terminate()
        child.join(5)
    assert math.isnan(tree_cpu_s(2**22 + 12345))


def test_cpu_per_request_and_its_report() -> None:
    from bench.gateway_engine import CpuMeter, cpu_line, cpu_ms_per_request

    assert cpu_ms_per_request(1.0, 1.5, 250) == pytest.approx(2.0)
    assert math.isnan(cpu_ms_per_request(1.0, 1.5, 0))
    clock = {"gateway": 10.0, "gateway_all": 12.0, "relay": 3.0}
    meter = CpuMeter({name: functools.partial(clock.__getitem__, name) for name in clock})
    meter.start()
    clock.update(gateway=10.5, gateway_all=12.8, relay=3.2)
    used = meter.per_request_ms({"gateway": 1000, "relay": 2000, "direct": 1000})
    assert used == pytest.approx({"gateway_cpu_ms": 0.5, "gateway_all_cpu_ms": 0.8, "relay_cpu_ms": 0.1})
    line = cpu_line("whole", used["gateway_cpu_ms"], used["gateway_all_cpu_ms"], used["relay_cpu_ms"])
    assert "gateway 0.80 ms (0.50 in its workers, 0.30 in its shipper" in line
    assert "relay 0.10 ms (8.0x the relay)" in line and "1,250 requests/s" in line
    assert "nan" in cpu_line("whole", 0.5, 0.8, 0.0)
