"""The highest request rate a stack holds: an open-loop step-up of the offered rate.

Each step offers ``rate`` requests per second for ``seconds`` (or for :data:`MIN_REQUESTS`
requests, whichever is longer): request k is due at ``k / rate`` whatever happened to the ones
before it (open loop: a slow server does not slow the offered load down, as it would with a
fixed number of clients waiting for their answers). A pool of keep-alive connections, opened
before the step starts, sends them; each request's latency runs from the moment it was due,
so time spent waiting for a free connection counts, as a user's would. Every path gets a
warm-up step first (not kept); then at every rate the engine is stepped alone, and each
stack's *added p99* at that rate is its p99 minus the engine's. A stack holds a rate when its
added p99 stays under the limit with no failed request; the rate it holds is the last step of
the unbroken run from the bottom (:func:`held_rate`). The pure parts (the ladder, the
schedule, the verdict) are tested in tests/unit/test_bench_compare.py.
"""

from __future__ import annotations

import collections
import math
import queue
import select
import threading
import time
from typing import Any

from bench.gateway_common import percentile
from bench.gateway_engine import Poster, Route

PATH = "/v1/chat/completions"
MIN_REQUESTS = 100
"""A step lasts long enough for this many requests, so its p99 is not just its slowest one."""
WARMUP_RATE = 50.0
"""Each path gets :data:`MIN_REQUESTS` requests at this rate before the first step, not kept."""


def rate_ladder(start: float, factor: float, top: float) -> list[float]:
    """Offered rates ``start, start*factor, ...`` up to ``top`` (included when it falls on the
    ladder), each rounded to a whole request per second."""
    if start <= 0 or factor <= 1:
        raise ValueError("the ladder needs start > 0 and factor > 1")
    out: list[float] = []
    rate = start
    while rate <= top * (1 + 1e-9):
        out.append(float(round(rate)))
        rate *= factor
    return out


def due_times(rate: float, seconds: float) -> list[float]:
    """When each request of a step is due, in seconds from its start: ``k / rate``."""
    return [k / rate for k in range(math.floor(rate * seconds + 1e-9))]


def added_p99(stack_ms: list[float], direct_ms: list[float]) -> float:
    """Nearest-rank p99 of the stack minus that of the engine alone (NaN when either is empty)."""
    if not stack_ms or not direct_ms:
        return math.nan
    return percentile(stack_ms, 99) - percentile(direct_ms, 99)


def held(added_p99_ms: float, errors: int, limit_ms: float) -> bool:
    """A step is held when every request was answered and its added p99 is under the limit."""
    return errors == 0 and added_p99_ms < limit_ms


def held_rate(steps: list[dict[str, Any]], limit_ms: float) -> float:
    """The highest offered rate of the unbroken run of held steps from the lowest rate; 0 when
    the lowest is not held. ``steps``: ``{"rate", "added_p99_ms", "errors"}`` in rising rate."""
    best = 0.0
    for step in steps:
        if not held_step(step, limit_ms):
            break
        best = step["rate"]
    return best


class Pool:
    """``connections`` keep-alive connections to one route, opened anew before each step (a
    server closes idle ones while the other stacks are stepped), so a step measures requests,
    not connection set-up."""

    def __init__(self, route: Route, connections: int) -> None:
        self.url, self.payloads, self.headers = route
        self.posters = [Poster(self.url, PATH, self.headers) for _ in range(connections)]

    def _connect(self) -> Poster:
        poster = Poster(self.url, PATH, self.headers)
        poster.conn.connect()
        return poster

    def close(self) -> None:
        for poster in self.posters:
            poster.close()

    def _usable(self, slot: int) -> Poster:
        """The slot's connection, opened anew if the server has closed it while it was idle
        (its socket reads as ready: the end of the stream), as HTTP client pools check before
        reusing a connection; a server's idle timeout is not a failed request."""
        sock = self.posters[slot].conn.sock
        if sock is not None and select.select([sock], [], [], 0)[0]:
            self.posters[slot].close()
            self.posters[slot] = Poster(self.url, PATH, self.headers)
        return self.posters[slot]

    def step(self, rate: float, seconds: float) -> dict[str, Any]:
        """``rate`` requests per second for ``seconds`` (at least :data:`MIN_REQUESTS`): each
        answered request's latency from when it was due (ms), the failed ones, and how late
        the last request was handed to a connection (ms: the client keeping up)."""
        due = due_times(rate, max(seconds, MIN_REQUESTS / rate))
        for slot, poster in enumerate(self.posters):
            poster.close()
            self.posters[slot] = self._connect()
        time.sleep(0.1)  # the server has accepted them
        todo: queue.Queue[tuple[int, float] | None] = queue.Queue()
        out: dict[str, Any] = {"latency": [], "errors": []}
        kinds: collections.Counter[str] = collections.Counter()
        lock = threading.Lock()

        def work(slot: int) -> None:
            while (item := todo.get()) is not None:
                k, at = item
                try:
                    self._usable(slot).post(self.payloads[k % len(self.payloads)])
                    into = "latency"
                except Exception as exc:  # counted; the connection is opened anew
                    into = "errors"
                    with lock:
                        kinds[f"{type(exc).__name__}: {str(exc)[:120]}"] += 1
                    self.posters[slot].close()
                    self.posters[slot] = Poster(self.url, PATH, self.headers)
                with lock:
                    out[into].append((time.perf_counter() - at) * 1000)

        workers = [threading.Thread(target=work, args=(slot,), daemon=True)
                   for slot in range(len(self.posters))]
        for w in workers:
            w.start()
        t0 = time.perf_counter()
        for k, offset in enumerate(due):
            if (wait := t0 + offset - time.perf_counter()) > 0:
                time.sleep(wait)
            todo.put((k, t0 + offset))
        out["late_ms"] = (time.perf_counter() - t0 - due[-1]) * 1000
        out["error_kinds"] = kinds
        for _ in workers:
            todo.put(None)
        for w in workers:
            w.join(timeout=seconds + 120)
        return out


def step_up(direct: Route, stacks: dict[str, Route], rates: list[float], seconds: float, connections: int,
            limit_ms: float, warmup_rate: float = WARMUP_RATE) -> dict[str, dict[str, Any]]:
    """Every stack up the ladder until it first fails to hold a step (the engine alone is
    stepped at each rate while any stack is still climbing). Returns per stack its steps and
    ``held_per_s``."""
    pools = {name: Pool(route, connections) for name, route in {"direct": direct, **stacks}.items()}
    steps: dict[str, list[dict[str, Any]]] = {name: [] for name in stacks}
    try:
        for pool in pools.values():
            pool.step(warmup_rate, 0.0)  # not kept: first requests, lazy imports, thread start-up
        for rate in rates:
            climbing = [name for name in stacks if not steps[name] or held_step(steps[name][-1], limit_ms)]
            if not climbing:
                break
            base = pools["direct"].step(rate, seconds)
            for name in climbing:
                steps[name].append(summarise_step(rate, pools[name].step(rate, seconds), base))
    finally:
        for pool in pools.values():
            pool.close()
    return {name: {"held_per_s": held_rate(s, limit_ms), "steps": s} for name, s in steps.items()}


def held_step(step: dict[str, Any], limit_ms: float) -> bool:
    return held(step["added_p99_ms"], int(step["errors"]), limit_ms)


def summarise_step(rate: float, res: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    nan = math.nan
    return {"rate": rate, "added_p99_ms": added_p99(res["latency"], base["latency"]),
            "p99_ms": percentile(res["latency"], 99) if res["latency"] else nan,
            "direct_p99_ms": percentile(base["latency"], 99) if base["latency"] else nan,
            "requests": float(len(res["latency"]) + len(res["errors"])), "errors": float(len(res["errors"])),
            "direct_errors": float(len(base["errors"])), "late_ms": res["late_ms"],
            "error_kinds": dict(res["error_kinds"])}
