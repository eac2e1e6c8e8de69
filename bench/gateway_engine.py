"""``rtrl bench gateway --mode vllm``: latency the gateway adds in front of a real vLLM engine.

The engine (vLLM's CPU build on the tiny model of services/stack/tiny_llm.py, started here;
or ``--engine-url``) is called directly with the body the gateway would send it, and through
the gateway as ``rtrl serve gateway`` runs it (its workers, ``--workers``; the OpenAI API, API
key, routing, served events spooled and shipped to a private broker), streamed or not.

* one client: requests alternate direct/gateway (order flipped every pair) on persistent
  connections, so both paths see the same engine state; p50/p99 of each and the difference;
* ``--concurrency N``: N clients on their own keep-alive connections, released together,
  first all on the engine, then all on the gateway; p50/p99 of each, the added p99, the
  longest wait for a first answer and the failed requests.

A second figure, ``--mode vllm-canary``: the time from a LoRA candidate registered in MLflow
to its first canary request served by the engine, through the real deployer.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from bench.gateway_common import bench_settings, percentile, start_gateway, stop_gateway
from bench.processes import Apart, ServedGateway, fake_engine, tcp_relay
from deployer.adapters.redis_state import Wakeup, wake_deployer
from deployer.ledger import TAG_GATE
from services.gateway.engine_backend import engine_body
from services.gateway.generation import GenRequest
from services.runtime.redis_io import make_redis
from services.settings.deployer import DeployerSettings
from services.settings.engine import EngineSettings
from services.settings.model import Settings
from services.stack.embedded import EmbeddedStack
from services.stack.engine import LocalVllm
from services.stack.tiny_llm import build_lora_adapter, build_tiny_llm, write_engine_check
from services.wiring.deployer import build_controller, build_ports, serve_loop
from services.wiring.gateway_workers import SHIPPER_NAME
from trainer.lora_policy import check_prompt_ids

MESSAGES = ({"role": "user", "content": "Please fix the loop."},)
KEY = "bench-key"


class Poster:
    """One persistent connection; ``post`` returns after the whole answer (a stream included)."""

    def __init__(self, url: str, path: str, headers: dict[str, str] | None = None) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=120)
        self.path = path
        self.headers = {"Content-Type": "application/json", **(headers or {})}

    def post(self, body: bytes) -> bytes:
        self.conn.request("POST", self.path, body=body, headers=self.headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{self.path} answered {resp.status}: {data[:200]!r}")
        if b"data: " in data[:6] and not data.rstrip().endswith(b"data: [DONE]"):  # a cut stream
            raise RuntimeError(f"{self.path}: a stream ended without [DONE]: {data[-200:]!r}")
        return data

    def close(self) -> None:
        self.conn.close()


def bodies(engine_model: str, public_model: str, n: int, max_tokens: int, stream: bool) -> tuple[
        list[bytes], list[bytes]]:
    """(direct engine bodies, gateway bodies): the same request, seeds 0..n-1."""
    direct, gateway = [], []
    for i in range(n):
        req = GenRequest("chat", max_tokens, 1.0, messages=MESSAGES, seed=i)
        direct.append(json.dumps(engine_body(req, engine_model, stream)).encode())
        gateway.append(json.dumps({"model": public_model, "messages": list(MESSAGES), "seed": i,
                                   "max_tokens": max_tokens, "user": f"user-{i % 500}",
                                   "stream": stream}).encode())
    return direct, gateway


def alternate(n: int, warmup: int, paths: dict[str, Callable[[int], object]],
              measuring: Callable[[], object] = lambda: None) -> dict[str, list[float]]:
    """Request i on every path in turn, the order rotated every round, so every path sees the
    same background load; the first ``warmup`` rounds are not kept (``measuring`` is called
    when the kept ones begin)."""
    out: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for i in range(warmup + n):
        if i == warmup:
            measuring()
        shift = i % len(names)
        for which in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            paths[which](i)
            if i >= warmup:
                out[which].append((time.perf_counter() - t0) * 1000)
    return out


def concurrent(url: str, path: str, payloads: list[bytes], clients: int,
               headers: dict[str, str] | None = None) -> dict[str, list[float]]:
    """``clients`` threads released together send ``payloads`` round-robin."""
    out: dict[str, list[float]] = {"round_trip": [], "first": [], "errors": []}
    start = threading.Barrier(clients)
    lock = threading.Lock()

    def run(k: int) -> None:
        poster = Poster(url, path, headers)
        start.wait()
        t_start = time.perf_counter()
        for i in range(k, len(payloads), clients):
            t0 = time.perf_counter()
            try:
                poster.post(payloads[i])
            except Exception:
                with lock:
                    out["errors"].append((time.perf_counter() - t0) * 1000)
                poster.close()
                poster = Poster(url, path, headers)
                continue
            with lock:
                out["round_trip"].append((time.perf_counter() - t0) * 1000)
                if i == k:
                    out["first"].append((time.perf_counter() - t_start) * 1000)
        poster.close()

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def engine_settings(base: Settings, url: str, model: str, workers: int = 0) -> Settings:
    gw = base.gateway.model_copy(update={"api_keys": {"bench": SecretStr(KEY)}, "allow_anonymous": False,
                                         "workers": workers})
    return base.model_copy(update={"engine": EngineSettings(kind="vllm", base_url=url, base_model=model),
                                   "gateway": gw})


def run_engine(root: Path, engine_url: str | None, engine_model: str,
               fake_token_ms: float | None = None) -> tuple[LocalVllm | Apart | None, str, str]:
    """The engine to measure: the one at ``engine_url``, a stand-in that costs no CPU
    (``fake_token_ms`` per token, in its own process), or a local vLLM on the tiny model."""
    if engine_url:
        return None, engine_url, engine_model
    if fake_token_ms is not None:
        fake = Apart(fake_engine, fake_token_ms).start()
        return fake, fake.url, "base"
    model_dir = build_tiny_llm(root / "tiny")
    engine = LocalVllm(model_dir, "tiny-base", root / "vllm.log").start()
    print(f"vLLM ready in {engine.wait_ready():.0f}s", flush=True)
    return engine, engine.base_url, "tiny-base"


def bench_vllm(stack: EmbeddedStack, root: Path, n: int, warmup: int, max_tokens: int,
               concurrency: int | None, stream: bool, engine_url: str | None = None,
               engine_model: str = "base", fake_token_ms: float | None = None,
               workers: int = 0) -> dict[str, float]:
    """The engine directly, through the baseline relay and through the gateway as ``rtrl serve
    gateway`` runs it (each server in its own process, bench/processes.py)."""
    engine, url, model = run_engine(root, engine_url, engine_model, fake_token_ms)
    servers: list[Apart] = []
    try:
        settings = engine_settings(bench_settings(stack, root, f"v{int(time.time())}"), url, model, workers)
        servers.append(gateway := Apart(ServedGateway, settings).start())
        servers.append(relay := Apart(tcp_relay, url).start())
        cpu = CpuMeter({"gateway": lambda: gateway.cpu_s(skip=SHIPPER_NAME), "gateway_all": gateway.cpu_s,
                        "relay": relay.cpu_s})
        auth = {"Authorization": f"Bearer {KEY}"}
        direct_b, gateway_b = bodies(model, settings.mlflow.registered_model, n + warmup, max_tokens, stream)
        paths = {"direct": (url, direct_b, None), "relay": (relay.url, direct_b, None),
                 "gateway": (gateway.url, gateway_b, auth)}
        if concurrency:
            return measure_concurrent(paths, warmup, concurrency, cpu)
        posters = {name: Poster(u, "/v1/chat/completions", h) for name, (u, _b, h) in paths.items()}

        def send(name: str) -> Callable[[int], object]:
            return lambda i: posters[name].post(paths[name][1][i])

        res = alternate(n, warmup, {name: send(name) for name in paths}, cpu.start)
        used = cpu.per_request_ms({name: len(times) for name, times in res.items()})
        for poster in posters.values():
            poster.close()
    finally:
        for server in reversed(servers):
            server.stop()
        if engine is not None:
            engine.stop()
    return {**summary(res["direct"], res["gateway"], res["relay"]), **used}


class CpuMeter:
    """CPU a server process spent per request it served, between :meth:`start` and
    :meth:`per_request_ms`: the service time that queueing multiplies under concurrency."""

    def __init__(self, meters: dict[str, Callable[[], float]]) -> None:
        self.meters = meters
        self.before: dict[str, float] = {}

    def start(self) -> None:
        self.before = {name: read() for name, read in self.meters.items()}

    def per_request_ms(self, served: dict[str, int]) -> dict[str, float]:
        """``<meter>_cpu_ms`` per request served on the path of the meter's name (up to ``_``)."""
        return {f"{name}_cpu_ms": cpu_ms_per_request(self.before[name], read(),
                                                     served.get(name.split("_")[0], 0))
                for name, read in self.meters.items()}


def cpu_ms_per_request(before_s: float, after_s: float, requests: int) -> float:
    return (after_s - before_s) * 1000.0 / requests if requests else float("nan")


Route = tuple[str, list[bytes], dict[str, str] | None]
"""A path to the engine: its URL, the bodies it is sent, its headers."""


def measure_concurrent(paths: dict[str, Route], warmup: int, clients: int,
                       cpu: CpuMeter | None = None) -> dict[str, float]:
    """``clients`` at once on each path in turn (a warm-up round on each first)."""
    for url, payloads, headers in paths.values():
        concurrent(url, "/v1/chat/completions", payloads[:warmup], clients, headers)
    cpu = cpu or CpuMeter({})
    cpu.start()
    res = {name: concurrent(url, "/v1/chat/completions", payloads[warmup:], clients, headers)
           for name, (url, payloads, headers) in paths.items()}
    out = summary(res["direct"]["round_trip"], res["gateway"]["round_trip"], res["relay"]["round_trip"])
    out.update(cpu.per_request_ms({name: len(r["round_trip"]) + len(r["errors"]) for name, r in res.items()}))
    out.update(direct_first_max_ms=max(res["direct"]["first"] or [float("nan")]),
               gateway_first_max_ms=max(res["gateway"]["first"] or [float("nan")]),
               errors=float(sum(len(r["errors"]) for r in res.values())))
    return out


def pct(values: list[float], q: float) -> float:
    return percentile(values, q) if values else float("nan")


def summary(direct: list[float], gateway: list[float], relay: list[float] | None = None) -> dict[str, float]:
    d50, d99, g50, g99 = (pct(direct, 50), pct(direct, 99), pct(gateway, 50),
                          pct(gateway, 99))
    out = {"direct_p50_ms": d50, "direct_p99_ms": d99, "gateway_p50_ms": g50, "gateway_p99_ms": g99,
           "added_p50_ms": g50 - d50, "added_p99_ms": g99 - d99, "ratio_p99": g99 / d99,
           "requests": float(len(gateway))}
    if relay:
        r50, r99 = pct(relay, 50), pct(relay, 99)
        out.update(relay_p50_ms=r50, relay_p99_ms=r99, relay_added_p50_ms=r50 - d50,
                   relay_added_p99_ms=r99 - d99)
    return out


def report(results: dict[str, dict[str, Any]], header: str) -> None:
    print(f"\n{header}")
    print(f"{'mode':22s} {'direct p50':>10s} {'p99':>8s} {'relay p50':>10s} {'p99':>8s} {'gateway p50':>12s} "
          f"{'p99':>8s} {'added p50':>10s} {'p99':>8s} {'relay added p99':>16s} {'first answer max':>17s} "
          f"{'errors':>6s}")
    nan = float("nan")
    for mode, r in results.items():
        cols = [r.get(k, nan) for k in ("direct_p50_ms", "direct_p99_ms", "relay_p50_ms", "relay_p99_ms",
                                         "gateway_p50_ms", "gateway_p99_ms")]
        print(f"{mode:22s} {cols[0]:10.1f} {cols[1]:8.1f} {cols[2]:10.1f} {cols[3]:8.1f} {cols[4]:12.1f} "
              f"{cols[5]:8.1f} {r['added_p50_ms']:+10.2f} {r['added_p99_ms']:+8.2f} "
              f"{r.get('relay_added_p99_ms', nan):+16.2f} {r.get('gateway_first_max_ms', nan):17.0f} "
              f"{r.get('errors', 0):6.0f}")
    print("(ms; direct = the engine called with the body the gateway sends; relay = the same body through a "
          "do-nothing TCP relay, the baseline; added = gateway - direct percentile; relay added = relay - "
          "direct; first answer max = the slowest client's first answer through the gateway; engine, relay "
          "and gateway each run in their own process)")
    for mode, r in results.items():
        if "gateway_all_cpu_ms" in r:
            print(cpu_line(mode, r["gateway_cpu_ms"], r["gateway_all_cpu_ms"], r.get("relay_cpu_ms", nan)))


def cpu_line(mode: str, gateway_ms: float, all_ms: float, relay_ms: float) -> str:
    """The service times: what each request cost the gateway's workers, its shipper of served
    events and the relay."""
    nan = float("nan")
    per_core = 1000.0 / all_ms if all_ms > 0 else nan
    ratio = all_ms / relay_ms if relay_ms > 0 else nan
    return (f"{mode}: CPU per request: gateway {all_ms:.2f} ms ({gateway_ms:.2f} in its workers, "
            f"{all_ms - gateway_ms:.2f} in its shipper; the broker's not counted), relay "
            f"{relay_ms:.2f} ms ({ratio:.1f}x the relay); one core serves about {per_core:,.0f} "
            "requests/s through the gateway")


# ------------------------------------------------------------------ candidate -> first request
def register_version(reg: Any, root: Path, name: str, model_dir: Path, adapter: Path | None) -> str:
    """A version as the trainer registers it for the engine (deployer/engine.py's layout)."""

    d = root / name
    d.mkdir(parents=True)
    (d / "policy.json").write_text(json.dumps({"kind": "hf", **({} if adapter else {"engine": "base"})}))
    if adapter is not None:
        shutil.copytree(adapter, d / "adapter")
    write_engine_check(d, model_dir, adapter, check_prompt_ids(model_dir))
    return str(reg.register(None, d, tags={TAG_GATE: "pass"}))


def bench_first_canary(stack: EmbeddedStack, root: Path, tick_s: float | None) -> dict[str, float]:
    """Seconds from a LoRA candidate registered (alias set) to its first request served by the
    engine through the gateway, with a real deployer in the service's loop (its default
    settings, the tick ``tick_s`` if given), woken as the trainer wakes it."""
    from deployer.adapters.mlflow_registry import MlflowRegistry

    engine, url, model = run_engine(root, None, "")
    assert isinstance(engine, LocalVllm)
    try:
        base = engine_settings(bench_settings(stack, root, f"c{int(time.time())}"), url, model)
        eng = base.engine.model_copy(update={"adapter_dir": root / "adapters"})
        deployer = DeployerSettings() if tick_s is None else DeployerSettings(
            tick_s=tick_s, lease_ttl_s=max(10.0, 3 * tick_s))
        settings = base.model_copy(update={"engine": eng, "deployer": deployer})
        reg = MlflowRegistry(settings.mlflow.tracking_uri, settings.mlflow.registered_model)
        model_dir = engine.model_dir
        reg.set_alias("champion", register_version(reg, root, "v1", model_dir, None))
        adapter = build_lora_adapter(model_dir, root / "lora", seed=1)
        controller = build_controller(settings, build_ports(settings), None)
        controller.step()  # the champion is loaded and checked before the gateway starts
        _gw, server, parts = start_gateway(settings)
        stop = threading.Event()
        r = make_redis(settings.redis)
        wakeup = Wakeup(r, settings.redis.key_prefix)
        loop = threading.Thread(target=serve_loop, args=(controller, wakeup, deployer.tick_s, stop.wait),
                                daemon=True)
        loop.start()
        stop.wait(1.0)  # the loop's first tick (nothing to do) is behind it

        t_reg = time.perf_counter()
        version = register_version(reg, root, "v2", model_dir, adapter)
        reg.set_alias("candidate", version)
        wake_deployer(r, settings.redis.key_prefix, f"candidate v{version} registered")
        t_alias = time.perf_counter()
        first = wait_canary(f"http://127.0.0.1:{server.port}", settings.mlflow.registered_model)
        stop.set()
        loop.join(timeout=deployer.tick_s + 10)
        stop_gateway(server, parts)
        r.close()
        return {"register_s": t_alias - t_reg, "to_first_canary_s": first - t_reg, "tick_s": deployer.tick_s,
                "first_step": deployer.steps[0]}
    finally:
        engine.stop()


def wait_canary(gateway_url: str, model: str, timeout_s: float = 300.0) -> float:
    """Send requests (many users) until one is served by the canary; when it was (perf_counter)."""
    poster = Poster(gateway_url, "/v1/chat/completions", {"Authorization": f"Bearer {KEY}"})
    deadline = time.perf_counter() + timeout_s
    i = 0
    try:
        while time.perf_counter() < deadline:
            i += 1
            body = {"model": model, "messages": list(MESSAGES), "max_tokens": 1, "user": f"u-{i % 997}"}
            out = json.loads(poster.post(json.dumps(body).encode()))
            if out["rtrl"]["arm"] == "canary":
                return time.perf_counter()
    finally:
        poster.close()
    raise RuntimeError(f"no canary request within {timeout_s:.0f}s")


def main_engine(args: Any, stack: EmbeddedStack, run: tuple[Any, ...]) -> int:
    """``--mode vllm`` and ``--mode vllm-canary`` (bench/gateway_engine.py)."""
    load_before = os.getloadavg()[0]
    try:
        if args.mode == "vllm-canary":
            res = bench_first_canary(stack, stack.data_dir.parent, args.tick_s)
            first = res["to_first_canary_s"]
            print(f"\nrtrl bench gateway --mode vllm-canary: LoRA candidate registered -> first canary "
                  f"request served by vLLM: {first:.1f} s (registering it took {res['register_s']:.1f} s; "
                  f"deployer tick {res['tick_s']:g} s, first step {res['first_step']:.0%}); target <= 30 s: "
                  f"{'met' if first <= 30 else 'MISSED'}")
            ok = res["to_first_canary_s"] <= 30
        else:
            n, warmup, max_tokens, concurrency = run
            fake = args.fake_token_ms if args.fake_engine else None
            res = bench_vllm(stack, stack.data_dir.parent, n, warmup, max_tokens, concurrency, args.stream,
                             args.engine_url, args.engine_model, fake, args.workers)
            what = f"{args.concurrency} concurrent clients" if args.concurrency else "one client, alternating"
            engine = f"fake engine ({args.fake_token_ms:g} ms/token)" if args.fake_engine else "vllm"
            report({f"{engine}{' stream' if args.stream else ''}": res},
                   f"rtrl bench gateway --mode vllm: {args.requests} chat requests per path "
                   f"(+{args.warmup} warm-up), max_tokens {args.max_tokens}, {what}; load average "
                   f"{load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
            ok = res.get("errors", 0) == 0
    finally:
        stack.down()
    if args.json:
        print(json.dumps(res, indent=2))
    return 0 if ok else 1
