"""``rtrl bench gateway --compare``: the rtrl gateway beside LiteLLM's proxy, in one run, in
front of the same engine.

Three stacks, each server in its own process: the engine called directly with the body the
gateway sends it (``direct``); the rtrl gateway as ``rtrl serve gateway`` runs it (its worker
processes, ``--workers``, default one per core; its OpenAI API, an API key, routing from Redis,
a signed exposure per request spooled and shipped to a private broker); LiteLLM's proxy as a
plain pass-through (bench/litellm_proxy.py: one ``model_list`` entry, a master key, no
database, no callbacks) with as many uvicorn workers (``--num_workers``). Both proxies get the
same client body (OpenAI chat, ``max_tokens``, a seed, a user).
The engine is the stand-in of ``--fake-engine`` (bench/fake_engine.py): ``--fake-token-ms`` per
token (default 1) for the one-client rows and the step-up, ``--concurrent-token-ms`` (default
20, as the documented ``--concurrency 64`` runs) for the rows of more clients, each on its own
engine and proxies started for them; or the one at ``--engine-url`` for every row.

Per row (1 and 64 concurrent clients, by ``--clients``; whole answers, then streamed):
* one client: requests rotate over the three paths on persistent connections, as
  ``--mode vllm`` does, so all three see the same background load;
* N clients: N keep-alive connections released together, the three paths in turn, after a
  warm-up round on each;
* *added* p50/p99: the stack's nearest-rank percentile minus the engine's, for the same
  request shape in the same row; a failed request is counted, not timed;
* *CPU per request*: user + system time of the proxy's process tree (/proc) over the row,
  divided by the requests sent to it (bench.gateway_engine.CpuMeter).

Then the highest request rate each proxy holds with added p99 < 50 ms and no failed request:
an **open-loop** step-up of the offered rate on whole answers over 64 connections, ``--step-s``
seconds per step (bench/open_loop.py). ``--step-s 0`` skips it.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gateway_common import bench_settings
from bench.gateway_engine import (
    KEY,
    CpuMeter,
    Poster,
    Route,
    alternate,
    bodies,
    concurrent,
    engine_settings,
    pct,
    run_engine,
)
from bench.litellm_proxy import (
    LITELLM_VERSION,
    LitellmMissingError,
    LitellmProxy,
    litellm_command,
    litellm_venv,
)
from bench.open_loop import PATH, rate_ladder, step_up
from bench.processes import Apart, ServedGateway
from services.stack.embedded import EmbeddedStack
from services.wiring.gateway_workers import worker_count

STACKS = ("rtrl", "litellm")
LIMIT_MS = 50.0
"""The added p99 a held rate stays under."""
LADDER = (10.0, 1.5, 2000.0)
"""The offered rates of the step-up: from 10 requests per second, x1.5 a step, up to 2,000."""
LADDER_CONNECTIONS = 64


def parse_clients(text: str) -> list[int]:
    """``--clients``: comma-separated client counts, e.g. ``1,64``."""
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or min(counts) < 1:
        raise ValueError("--clients needs one or more counts >= 1")
    return counts


def litellm_problem(explicit: str | None) -> str | None:
    """Why the comparison cannot run LiteLLM, or None when it can (checked before any stack starts)."""
    try:
        litellm_command(litellm_venv(explicit))
    except LitellmMissingError as exc:
        return f"rtrl bench gateway --compare: {exc}"
    return None


def added(direct_ms: list[float], stack_ms: list[float]) -> dict[str, float]:
    """The latency a stack adds: its nearest-rank p50 and p99 minus the engine's."""
    return {"added_p50_ms": pct(stack_ms, 50) - pct(direct_ms, 50),
            "added_p99_ms": pct(stack_ms, 99) - pct(direct_ms, 99)}


def ratio(ours: float, theirs: float) -> float:
    """``ours / theirs``; NaN when either is not a positive number (an added latency at or
    below zero has no meaningful ratio)."""
    if not (ours > 0 and theirs > 0) or math.isinf(ours) or math.isinf(theirs):
        return math.nan
    return ours / theirs


def kept(times: list[float], failed: set[int]) -> list[float]:
    """The round trips of the requests that were answered (``failed``: indices of the rest)."""
    return [t for k, t in enumerate(times) if k not in failed]


class Sender:
    """One persistent connection per path for the one-client rows; a request that fails is
    noted by its index among the measured ones and the connection opened anew."""

    def __init__(self, routes: dict[str, Route], warmup: int) -> None:
        self.routes = routes
        self.warmup = warmup
        self.posters = {name: Poster(url, PATH, headers) for name, (url, _b, headers) in routes.items()}
        self.failed: dict[str, set[int]] = {name: set() for name in routes}

    def path(self, name: str) -> Callable[[int], object]:
        def send(i: int) -> None:
            try:
                self.posters[name].post(self.routes[name][1][i])
            except Exception:
                if i >= self.warmup:
                    self.failed[name].add(i - self.warmup)
                self.posters[name].close()
                url, _b, headers = self.routes[name]
                self.posters[name] = Poster(url, PATH, headers)
        return send

    def close(self) -> None:
        for poster in self.posters.values():
            poster.close()


Timed = dict[str, tuple[list[float], int]]
"""Per path: round trips of the answered requests (ms) and the number that failed."""


def one_client(routes: dict[str, Route], n: int, warmup: int, cpu: CpuMeter) -> Timed:
    sender = Sender(routes, warmup)
    try:
        res = alternate(n, warmup, {name: sender.path(name) for name in routes}, cpu.start)
    finally:
        sender.close()
    return {name: (kept(res[name], sender.failed[name]), len(sender.failed[name])) for name in routes}


def many_clients(routes: dict[str, Route], warmup: int, clients: int, cpu: CpuMeter) -> Timed:
    for url, payloads, headers in routes.values():
        concurrent(url, PATH, payloads[:warmup], clients, headers)
    cpu.start()
    out: Timed = {}
    for name, (url, payloads, headers) in routes.items():
        res = concurrent(url, PATH, payloads[warmup:], clients, headers)
        out[name] = (res["round_trip"], len(res["errors"]))
    return out


def row(timed: Timed, cpu_ms: dict[str, float]) -> dict[str, Any]:
    """A table row: the engine's percentiles and, per stack, what it added and cost."""
    direct = timed["direct"][0]
    out: dict[str, Any] = {"direct_p50_ms": pct(direct, 50), "direct_p99_ms": pct(direct, 99),
                           "direct_errors": timed["direct"][1]}
    for name in STACKS:
        times, errors = timed[name]
        out[name] = {"p50_ms": pct(times, 50), "p99_ms": pct(times, 99), **added(direct, times),
                     "cpu_ms": cpu_ms.get(f"{name}_cpu_ms", math.nan), "answered": len(times),
                     "errors": errors}
    return out


def measure_row(routes: dict[str, Route], clients: int, n: int, warmup: int, cpu: CpuMeter) -> dict[str, Any]:
    timed = one_client(routes, n, warmup, cpu) if clients == 1 else many_clients(routes, warmup, clients, cpu)
    return row(timed, cpu.per_request_ms({name: len(t) + e for name, (t, e) in timed.items()}))


def engine_groups(clients: list[int], token_ms: float, concurrent_token_ms: float,
                  real: bool) -> list[tuple[float | None, list[int]]]:
    """Which rows run on which engine: ``(fake engine's ms per token, client counts)``; None
    for the real engine at ``--engine-url``, which serves every row. The one-client rows (and
    the step-up, on the first group) get ``token_ms``, the others ``concurrent_token_ms``."""
    one, many = [c for c in clients if c == 1], [c for c in clients if c > 1]
    groups: list[tuple[float | None, list[int]]] = []
    if real:
        groups.append((None, one + many))
    elif not many or (one and token_ms == concurrent_token_ms):
        groups.append((token_ms, one + many))
    else:
        groups += [(token_ms, one)] if one else []
        groups.append((concurrent_token_ms, many))
    return groups


class Stacks:
    """The engine and both proxies in front of it, each in its own process; ``stop`` ends them."""

    def __init__(self, args: Any, stack: EmbeddedStack, root: Path, token_ms: float | None) -> None:
        self.args, self.stack, self.root, self.token_ms = args, stack, root, token_ms
        self.servers: list[Apart | LitellmProxy] = []
        self.engine: Any = None

    def start(self) -> Stacks:
        a = self.args
        self.engine, self.url, self.model = run_engine(self.root, a.engine_url, a.engine_model, self.token_ms)
        settings = engine_settings(bench_settings(self.stack, self.root, f"x{time.time_ns()}"), self.url,
                                   self.model, a.workers)
        self.public = settings.mlflow.registered_model
        self.workers = worker_count(settings)
        t0 = time.monotonic()
        self.servers.append(gateway := Apart(ServedGateway, settings).start())
        self.startup_s = {"rtrl": time.monotonic() - t0}
        proxy = LitellmProxy(litellm_venv(self.args.litellm_venv), self.root / f"litellm-{len(self.servers)}",
                             self.public, self.model, self.url, self.workers)
        self.servers.append(proxy.start())
        self.startup_s["litellm"] = proxy.startup_s
        self.config = proxy.config
        self.cpu = CpuMeter({"rtrl": gateway.cpu_s, "litellm": proxy.cpu_s})
        self.hosts = {"rtrl": (gateway.url, {"Authorization": f"Bearer {KEY}"}),
                      "litellm": (proxy.url, proxy.headers)}
        return self

    def routes(self, stream: bool) -> dict[str, Route]:
        """Per path its URL, bodies (the engine's as the gateway sends them; one client body for
        both proxies) and headers."""
        a = self.args
        direct_b, client_b = bodies(self.model, self.public, a.requests + a.warmup, a.max_tokens, stream)
        return {"direct": (self.url, direct_b, None),
                **{name: (url, client_b, headers) for name, (url, headers) in self.hosts.items()}}

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()
        if self.engine is not None:
            self.engine.stop()


def run_compare(args: Any, stack: EmbeddedStack, root: Path) -> dict[str, Any]:
    """Every row and the step-up, each group of rows on its own engine and proxies."""
    out: dict[str, Any] = {"rows": {}, "rate": {}, "groups": []}
    groups = engine_groups(args.clients, args.fake_token_ms, args.concurrent_token_ms, bool(args.engine_url))
    for g, (token_ms, clients) in enumerate(groups):
        stacks = Stacks(args, stack, root, token_ms)
        try:
            stacks.start()
            for stream in (False, True):
                routes = stacks.routes(stream)
                for c in clients:
                    key = f"{c} {'streamed' if stream else 'whole'}"
                    out["rows"][key] = measure_row(routes, c, args.requests, args.warmup, stacks.cpu)
            if g == 0 and args.step_s > 0:
                whole = stacks.routes(False)
                out["rate"] = step_up(whole["direct"], {name: whole[name] for name in STACKS},
                                      rate_ladder(*LADDER), args.step_s, LADDER_CONNECTIONS, LIMIT_MS)
        finally:
            stacks.stop()
        out["groups"].append({"token_ms": token_ms, "clients": clients, "startup_s": stacks.startup_s,
                              "workers": stacks.workers,
                              "litellm_config": stacks.config})
    return out


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """rtrl / LiteLLM, at the largest client count: CPU per request and added p99, per answer kind."""
    top = max(int(key.split()[0]) for key in rows)
    out: dict[str, float] = {}
    for key, r in rows.items():
        clients, kind = key.split()
        if int(clients) == top:
            ours, theirs = r["rtrl"], r["litellm"]
            out[f"cpu_per_request_{kind}"] = ratio(ours["cpu_ms"], theirs["cpu_ms"])
            out[f"added_p99_{top}_clients_{kind}"] = ratio(ours["added_p99_ms"], theirs["added_p99_ms"])
    return out


def broke(steps: list[dict[str, Any]]) -> str:
    """What the step after the last held one showed (the ladder ends with it), if any."""
    last = steps[-1] if steps else None
    if last is None or (last["errors"] == 0 and last["added_p99_ms"] < LIMIT_MS):
        return ""
    return f" (at {last['rate']:,.0f}: added p99 {last['added_p99_ms']:+.1f} ms, {last['errors']:.0f} errors)"


def print_report(args: Any, res: dict[str, Any], load_before: float) -> None:
    engine = args.engine_url or "fake engine (" + ", ".join(
        f"{g['token_ms']:g} ms/token for {'/'.join(map(str, g['clients']))} clients"
        for g in res["groups"]) + ")"
    print(f"\nrtrl bench gateway --compare: {engine}, max_tokens {args.max_tokens}, {args.requests} chat "
          f"requests per stack and row (+{args.warmup} warm-up); load average {load_before:.1f} -> "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    ready = res["groups"][0]["startup_s"]
    n = res["groups"][0]["workers"]
    print(f"ready in: rtrl gateway {ready['rtrl']:.1f} s ({n} workers, their spool's shipper), "
          f"LiteLLM {LITELLM_VERSION} proxy {ready['litellm']:.1f} s ({n} uvicorn workers, pass-through "
          "config)")
    head = " | ".join(f"{name + ' added p50':>18s} {'p99':>8s} {'CPU ms/req':>10s} {'errors':>6s}"
                      for name in STACKS)
    print(f"{'clients':>7s} {'answer':8s} {'engine p50':>10s} {'p99':>8s} | {head}")
    for key, r in res["rows"].items():
        clients, kind = key.split()
        cells = " | ".join(f"{r[n]['added_p50_ms']:+18.2f} {r[n]['added_p99_ms']:+8.2f} "
                           f"{r[n]['cpu_ms']:10.2f} {r[n]['errors']:6d}" for n in STACKS)
        print(f"{clients:>7s} {kind:8s} {r['direct_p50_ms']:10.2f} {r['direct_p99_ms']:8.2f} | {cells}")
    print("(ms; added = the stack's percentile minus the engine's, same requests, same row; CPU = user + "
          "system time of the proxy's process tree per request sent to it)")
    if res["rate"]:
        start, factor, _top = LADDER
        rate = res["rate"]
        held = ", ".join(f"{name} {rate[name]['held_per_s']:,.0f} req/s{broke(rate[name]['steps'])}"
                         for name in STACKS)
        print(f"highest rate held with added p99 < {LIMIT_MS:g} ms and no error (open loop, whole answers, "
              f"{LADDER_CONNECTIONS} connections, {args.step_s:g} s steps from {start:g} req/s "
              f"x{factor:g}): {held}")
    pairs = [f"{key.replace('_', ' ')} {value:.2f}" for key, value in res["ratios"].items()]
    print("rtrl / LiteLLM: " + ", ".join(pairs))


def main_compare(args: Any, stack: EmbeddedStack) -> int:
    """``--compare`` (bench/gateway_compare.py); ``stack`` is up and is stopped here."""
    load_before = os.getloadavg()[0]
    try:
        res = run_compare(args, stack, stack.data_dir.parent)
    finally:
        stack.down()
    res["ratios"] = ratios(res["rows"])
    print_report(args, res, load_before)
    if args.json:
        print(json.dumps(res, indent=2))
    errors = sum(r["direct_errors"] + sum(r[name]["errors"] for name in STACKS) for r in res["rows"].values())
    return 0 if errors == 0 else 1
