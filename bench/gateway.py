"""``rtrl bench gateway``: latency the gateway adds over calling the model directly.

In one run, on loopback, with a private broker and Redis (EmbeddedStack on free ports) and
a sqlite MLflow registry in a temporary folder:

* **policy mode** — the default policy (registered in MLflow, loaded by the gateway as in
  production) sampled in-process (``direct``) vs ``POST /v1/completions`` through the
  gateway (``gateway``: HTTP, validation, routing from Redis, a canary arm at 50% so both
  arms serve, signed exposure logging to the broker);
* **upstream mode** — a fake OpenAI-compatible server called directly (same body the
  gateway would send) vs through the gateway in upstream mode.

Requests alternate direct/gateway (order flipped every pair) so both paths see the same
background load. The load generator uses one persistent ``http.client`` connection.
Reported: p50/p99 of each path, the difference (the target: at most 2 ms added at p99),
and the paired per-request overhead ``round trip - generation time reported by the
gateway``, which does not depend on how long generation took.

With ``--concurrency N`` the gateway path alone is loaded by N clients at once, each on
its own persistent connection, all starting together: reported are the round trip, the
added latency (round trip - generation time the gateway reported: HTTP, queueing for a
thread and the GIL, validation, routing), the longest wait of any request (its connection
set-up included) and the requests that failed or got no answer.

``--compare`` puts the gateway beside LiteLLM's proxy in front of the same engine
(bench/gateway_compare.py).
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.fake_upstream import FakeCompletionsServer
from bench.gateway_common import bench_settings, percentile, start_gateway, stop_gateway
from bench.gateway_compare import litellm_problem, main_compare, parse_clients
from bench.gateway_engine import main_engine
from ingest.contracts.keys import routing_keys
from ingest.contracts.prometheus import GATEWAY_EXPOSURES
from services.runtime.process import setup_logging
from services.runtime.redis_io import make_redis
from services.settings.model import Settings
from services.settings.services import UpstreamSettings
from services.stack.embedded import EmbeddedStack, free_port

TARGET_ADDED_P99_MS = 2.0


class Client:
    """One persistent HTTP/1.1 connection, as a real client library keeps."""

    def __init__(self, port: int, path: str) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.path = path
        self.headers = {"Content-Type": "application/json"}

    def post(self, body: bytes) -> dict[str, Any]:
        self.conn.request("POST", self.path, body=body, headers=self.headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{self.path} answered {resp.status}: {data[:200]!r}")
        out: dict[str, Any] = json.loads(data)
        return out


def measure(
    n: int, warmup: int, direct: Callable[[int], None], via_gateway: Callable[[int], float]
) -> dict[str, list[float]]:
    """Alternate the two paths; returns ms lists for direct, gateway and paired overhead."""
    out: dict[str, list[float]] = {"direct": [], "gateway": [], "overhead": []}
    for i in range(warmup + n):
        order = ("d", "g") if i % 2 == 0 else ("g", "d")
        for which in order:
            t0 = time.perf_counter()
            if which == "d":
                direct(i)
                ms = (time.perf_counter() - t0) * 1000
                if i >= warmup:
                    out["direct"].append(ms)
            else:
                gen_ms = via_gateway(i)
                ms = (time.perf_counter() - t0) * 1000
                if i >= warmup:
                    out["gateway"].append(ms)
                    out["overhead"].append(ms - gen_ms)
    return out


def load(port: int, bodies: list[bytes], clients: int) -> dict[str, list[float]]:
    """``clients`` threads, each with its own keep-alive connection, released together, send
    ``bodies`` round-robin; returns ms lists ``round_trip``, ``added`` and ``first`` (each
    client's wait for its first answer, connection set-up included) and ``errors`` (one
    entry per failed request: refused, reset, unanswered within the client's 30 s)."""
    out: dict[str, list[float]] = {"round_trip": [], "added": [], "first": [], "errors": []}
    start = threading.Barrier(clients)
    kinds: collections.Counter[str] = collections.Counter()

    def run(k: int) -> None:
        client = Client(port, "/v1/completions")
        start.wait()
        t_start = time.perf_counter()
        for i in range(k, len(bodies), clients):
            t0 = time.perf_counter()
            try:
                gen_ms = float(client.post(bodies[i])["latency_ms"])
            except Exception as exc:  # counted; the next request opens a new connection
                out["errors"].append((time.perf_counter() - t0) * 1000)
                kinds[type(exc).__name__] += 1
                client.conn.close()
                continue
            ms = (time.perf_counter() - t0) * 1000
            out["round_trip"].append(ms)
            out["added"].append(ms - gen_ms)
            if i == k:
                out["first"].append((time.perf_counter() - t_start) * 1000)
        client.conn.close()

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if kinds:
        print(f"failed requests by error: {dict(kinds)}", file=sys.stderr)
    return out


def summarise_load(res: dict[str, list[float]], seconds: float) -> dict[str, float]:
    rt, added = res["round_trip"] or [math.nan], res["added"] or [math.nan]
    return {
        "round_trip_p50_ms": percentile(rt, 50), "round_trip_p99_ms": percentile(rt, 99),
        "added_p50_ms": percentile(added, 50), "added_p99_ms": percentile(added, 99),
        "max_wait_ms": max(rt + res["errors"] + res["first"]),
        "max_first_answer_ms": max(res["first"] or [math.nan]),
        "answered": float(len(res["round_trip"])), "errors": float(len(res["errors"])),
        "throughput_per_s": len(res["round_trip"]) / seconds,
    }


def summarise(mode: str, res: dict[str, list[float]]) -> dict[str, float]:
    d50, d99 = percentile(res["direct"], 50), percentile(res["direct"], 99)
    g50, g99 = percentile(res["gateway"], 50), percentile(res["gateway"], 99)
    return {
        "direct_p50_ms": d50, "direct_p99_ms": d99, "gateway_p50_ms": g50, "gateway_p99_ms": g99,
        "added_p50_ms": g50 - d50, "added_p99_ms": g99 - d99,
        "overhead_p50_ms": percentile(res["overhead"], 50),
        "overhead_p99_ms": percentile(res["overhead"], 99),
        "ratio_p99": g99 / d99, "direct_mean_ms": statistics.fmean(res["direct"]),
    }


def _set_routing(settings: Settings, **values: str) -> None:
    keys = routing_keys(settings.redis.key_prefix)
    make_redis(settings.redis).mset({keys[k]: v for k, v in values.items()})


def concurrent(port: int, bodies: list[bytes], clients: int, warmup: int,
               via_gateway: Callable[[int], float]) -> dict[str, float]:
    """Warm up on one connection, then :func:`load` with the measured bodies."""
    for i in range(warmup):
        via_gateway(i)
    t0 = time.perf_counter()
    res = load(port, bodies[warmup:], clients)
    return summarise_load(res, time.perf_counter() - t0)


def bench_policy(stack: EmbeddedStack, root: Path, n: int, warmup: int, max_tokens: int,
                 concurrency: int | None = None) -> dict[str, float]:
    import torch

    from deployer.adapters.mlflow_registry import MlflowRegistry
    from trainer.policy import TinyTransformer, load_policy

    settings = bench_settings(stack, root, f"p{uuid.uuid4().hex[:6]}")
    reg = MlflowRegistry(settings.mlflow.tracking_uri, settings.mlflow.registered_model)
    torch.manual_seed(0)
    v1 = reg.register(None, TinyTransformer().save(root / "v1"))
    v2 = reg.register(None, TinyTransformer().save(root / "v2"))
    reg.set_alias("champion", v1)
    _set_routing(settings, stable_version=v1, canary_version=v2, canary_weight="0.5", salt="bench")
    _gateway, server, parts = start_gateway(settings)
    direct_policy = load_policy(reg.download(v1, root / "direct"))
    torch.set_num_threads(settings.gateway.torch_threads)
    prompt = [0, 5, 9, 13, 17, 21, 25, 29]
    client = Client(server.port, "/v1/completions")
    bodies = [json.dumps({"user_key": f"user-{i % 500}", "session_id": "bench", "prompt_tokens": prompt,
                          "max_tokens": max_tokens}).encode() for i in range(n + warmup)]

    def direct(i: int) -> None:
        direct_policy.sample(prompt, max_tokens, 1.0)

    def via_gateway(i: int) -> float:
        return float(client.post(bodies[i])["latency_ms"])

    try:
        if concurrency:
            return concurrent(server.port, bodies, concurrency, warmup, via_gateway)
        res = measure(n, warmup, direct, via_gateway)
    finally:
        client.conn.close()
        stop_gateway(server, parts)
    return summarise("policy", res)


def bench_upstream(stack: EmbeddedStack, root: Path, n: int, warmup: int, max_tokens: int,
                   concurrency: int | None = None) -> dict[str, float]:
    fake = FakeCompletionsServer().start()
    settings = bench_settings(
        stack, root, f"u{uuid.uuid4().hex[:6]}",
        stable_upstream=UpstreamSettings(base_url=fake.url, model="team-model"),
    )
    _gateway, server, parts = start_gateway(settings)
    prompt = [0, 5, 9, 13, 17, 21, 25, 29]
    upstream = Client(int(fake.url.rsplit(":", 1)[1]), "/v1/completions")
    upstream_body = json.dumps({
        "model": "team-model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0,
        "logprobs": 1, "return_tokens_as_token_ids": True,
    }).encode()
    client = Client(server.port, "/v1/completions")
    bodies = [json.dumps({"user_key": f"user-{i % 500}", "session_id": "bench", "prompt_tokens": prompt,
                          "max_tokens": max_tokens}).encode() for i in range(n + warmup)]

    def direct(i: int) -> None:
        upstream.post(upstream_body)

    def via_gateway(i: int) -> float:
        return float(client.post(bodies[i])["latency_ms"])

    try:
        if concurrency:
            return concurrent(server.port, bodies, concurrency, warmup, via_gateway)
        res = measure(n, warmup, direct, via_gateway)
    finally:
        client.conn.close()
        upstream.conn.close()
        stop_gateway(server, parts)
        fake.stop()
    return summarise("upstream", res)


def report(args: argparse.Namespace, results: dict[str, dict[str, float]], load_before: float) -> bool:
    """Print the alternating (direct vs gateway) figures; True when the p99 target is met."""
    print(f"\nrtrl bench gateway: {args.requests} requests per path (+{args.warmup} warm-up), "
          f"max_tokens {args.max_tokens}, loopback, one persistent connection; "
          f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'mode':9s} {'direct p50':>10s} {'p99':>7s} {'gateway p50':>12s} {'p99':>7s} "
          f"{'added p50':>10s} {'p99':>7s} {'p99 ratio':>9s} {'overhead p50':>13s} {'p99':>6s}")
    ok = True
    for mode, r in results.items():
        print(f"{mode:9s} {r['direct_p50_ms']:10.2f} {r['direct_p99_ms']:7.2f} {r['gateway_p50_ms']:12.2f} "
              f"{r['gateway_p99_ms']:7.2f} {r['added_p50_ms']:+10.2f} {r['added_p99_ms']:+7.2f} "
              f"{r['ratio_p99']:9.3f} {r['overhead_p50_ms']:13.2f} {r['overhead_p99_ms']:6.2f}")
        ok = ok and r["added_p99_ms"] <= TARGET_ADDED_P99_MS
    print("(ms; added = gateway - direct percentile; overhead = per-request round trip minus the "
          "generation time the gateway measured)")
    return ok


def report_load(args: argparse.Namespace, results: dict[str, dict[str, float]], load_before: float) -> bool:
    """Print the concurrent-load figures; True when every request was answered."""
    print(f"\nrtrl bench gateway: {args.requests} requests from {args.concurrency} concurrent keep-alive "
          f"clients (+{args.warmup} warm-up), max_tokens {args.max_tokens}, loopback; "
          f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'mode':9s} {'round trip p50':>14s} {'p99':>8s} {'added p50':>10s} {'p99':>8s} "
          f"{'max wait':>9s} {'first answer':>12s} {'req/s':>7s} {'answered':>8s} {'errors':>6s}")
    ok = True
    for mode, r in results.items():
        print(f"{mode:9s} {r['round_trip_p50_ms']:14.2f} {r['round_trip_p99_ms']:8.2f} "
              f"{r['added_p50_ms']:10.2f} {r['added_p99_ms']:8.2f} {r['max_wait_ms']:9.0f} "
              f"{r['max_first_answer_ms']:12.0f} {r['throughput_per_s']:7.0f} {r['answered']:8.0f} "
              f"{r['errors']:6.0f}")
        ok = ok and r["errors"] == 0
    print("(ms; added = round trip minus the generation time the gateway measured; max wait = the "
          "longest request, connection set-up included; first answer = the slowest client's first)")
    return ok


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rtrl bench gateway", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="measured requests per path and mode")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--mode", choices=["policy", "upstream", "both", "vllm", "vllm-canary"],
                        default="both",
                        help="vllm: the OpenAI API in front of a real vLLM engine (bench/gateway_engine.py); "
                             "vllm-canary: seconds from a LoRA candidate registered to its first canary "
                             "request")
    parser.add_argument("--stream", action="store_true", help="vllm: streamed requests (server-sent events)")
    parser.add_argument("--engine-url", help="vllm: an engine to use instead of starting one")
    parser.add_argument("--engine-model", default="base", help="vllm: the --engine-url's served model name")
    parser.add_argument("--fake-engine", action="store_true",
                        help="vllm: a stand-in engine that costs no CPU (bench/fake_engine.py), to measure "
                             "the gateway's own relay cost apart from an engine sharing its cores")
    parser.add_argument("--fake-token-ms", type=float, default=1.0,
                        help="--fake-engine: time per token (--compare: for one client and the step-up)")
    parser.add_argument("--tick-s", type=float, default=None,
                        help="vllm-canary: the deployer's tick (default: the deployer's default, 30 s)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="N concurrent keep-alive clients on the gateway path alone (no direct calls)")
    parser.add_argument("--compare", action="store_true",
                        help="the engine direct, the rtrl gateway and LiteLLM's proxy side by side "
                             "(bench/gateway_compare.py; needs scripts/litellm-env)")
    parser.add_argument("--litellm-venv", help="--compare: LiteLLM's virtualenv (default $LITELLM_VENV or "
                                               ".venv-litellm)")
    parser.add_argument("--clients", type=parse_clients, default=[1, 64],
                        help="--compare: concurrent client counts, comma-separated (default 1,64)")
    parser.add_argument("--concurrent-token-ms", type=float, default=20.0,
                        help="--compare: the fake engine's time per token for the rows of more than one "
                             "client (--fake-token-ms: for one client and the step-up)")
    parser.add_argument("--step-s", type=float, default=3.0,
                        help="--compare: seconds per offered rate in the step-up (0: no step-up)")
    parser.add_argument("--workers", type=int, default=0,
                        help="vllm, --compare: the gateway's worker processes (default 0: as rtrl serve "
                             "gateway picks, one per core)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args(argv)
    if args.compare and (problem := litellm_problem(args.litellm_venv)):
        print(problem, file=sys.stderr)
        return 2
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    setup_logging("WARNING", "bench")
    logging.getLogger("mlflow").setLevel(logging.ERROR)
    root = Path(tempfile.mkdtemp(prefix="rtrl-bench-gateway-"))
    stack = EmbeddedStack(data_dir=root / "stack", kafka_port=free_port(), redis_port=free_port(),
                          reuse_redis_url=None, with_mlflow=False)
    print(f"starting a private broker and Redis in {root} ...", file=sys.stderr, flush=True)
    stack.up(timeout_s=90)
    results: dict[str, dict[str, float]] = {}
    load_before = os.getloadavg()[0]
    run = (args.requests, args.warmup, args.max_tokens, args.concurrency)
    if args.compare:
        return main_compare(args, stack)
    if args.mode.startswith("vllm"):
        return main_engine(args, stack, run)
    try:
        if args.mode in {"policy", "both"}:
            results["policy"] = bench_policy(stack, root, *run)
        if args.mode in {"upstream", "both"}:
            results["upstream"] = bench_upstream(stack, root, *run)
    finally:
        stack.down()
    sent = GATEWAY_EXPOSURES.labels("sent")._value.get()
    dropped = GATEWAY_EXPOSURES.labels("dropped")._value.get()
    failed = GATEWAY_EXPOSURES.labels("failed")._value.get()
    if args.concurrency:
        ok = report_load(args, results, load_before)
    else:
        ok = report(args, results, load_before)
    print(f"exposures: {sent:.0f} sent, {dropped:.0f} dropped, {failed:.0f} failed")
    if not args.concurrency:
        print(f"target added p99 <= {TARGET_ADDED_P99_MS} ms: {'met' if ok else 'MISSED'}")
    if args.json:
        print(json.dumps({"results": results, "exposures": {"sent": sent, "dropped": dropped,
                                                            "failed": failed}}, indent=2))
    return 0 if ok else 1

