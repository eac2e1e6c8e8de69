"""Broker and Redis outages under traffic, against the shipped alert rules unchanged.

Every service runs as its own process (``rtrl serve ingest|reward|trainer|deployer|gateway``)
on a broker and Redis of this test's own; clients send completions through the gateway at a
steady rate. Debian's ``prometheus`` scrapes every process with the target labels
prometheus-operator sets (``job``, ``namespace``, ``service``, ``pod``, ``container``,
``endpoint`` and the ServiceMonitor's targetLabels) and evaluates the rule files of
``helm/rtrl/files/alerts/`` as the chart ships them: no duration or threshold is rewritten.
For each outage in turn:

- before it, no alert is pending or firing at any look, every 5 s over a window;
- the dependency is stopped cleanly for the outage's length: the gateway's ``/readyz``
  answers 200 and the clients' requests are answered throughout, and the critical
  ``RtrlDependencyOutage`` for that dependency fires within 5 minutes of the stop;
- after the restart every critical alert clears within ``CLEAR_LIMIT_S`` and (full size)
  every alert, pending ones included, within ``ALL_CLEAR_LIMIT_S``;
- once the clients stop, every answered request is rewarded exactly once, the gateway counted
  no exposure dropped or invalid, and ``rtrl reconcile --strict --json`` finds nothing lost or
  duplicated.

Sizes (tests/reliability/scale.py): ``soak`` scrapes and evaluates every 30 s (the chart's
``serviceMonitor.interval``, the operator's default evaluation interval) and stops the broker
for 12 minutes, then Redis for 5; ``ci`` scrapes every 10 s and stops the broker only until
the 3-minute ``for:`` has fired, and waits for the critical alerts to clear, not for the
warnings' 5-minute rate windows.
"""

from __future__ import annotations

import http.client
import itertools
import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from services.runtime.kafka_io import ensure_topics
from services.settings.model import Settings
from services.sim.transport import GatewayClient
from services.stack.embedded import EmbeddedStack, free_port
from services.stack.supervisor import ProcSpec, Supervisor, serve_argv
from tests import live_alerts as live
from tests.gateway_proc import served_events
from tests.reliability import scale
from tests.reliability.workload import RTRL, RewardCounter

pytestmark = pytest.mark.timeout(3600 if scale.current().name == "soak" else 1200)

SERVICES = ("ingest", "reward", "trainer", "deployer", "gateway")
ALERT = "RtrlDependencyOutage"
FIRE_LIMIT_S = 300.0
"""The critical alert fires within 5 minutes of the stop (``for: 3m`` after rate[2m] > 0)."""
CLEAR_LIMIT_S = 240.0
"""Critical alerts clear within this of the restart: rate[2m] forgets the last retry, plus a
scrape and an evaluation of 30 s each."""
ALL_CLEAR_LIMIT_S = 480.0
"""Every alert clears within this of the restart (RtrlDependencyUnavailable's rate[5m])."""
SAMPLE_S = 5.0
RATE_PER_S = 4.0
TIME_SCALE = "0.005"
"""Served requests get no client events here, so each closes at its due time: (3600 + 30) s
scaled to about 18 s."""


class Clients(threading.Thread):
    """Completions at a steady rate through the gateway, and a ``/readyz`` look every second."""

    def __init__(self, port: int, prefix: str, api_key: str) -> None:
        super().__init__(name=f"clients-{prefix}", daemon=True)
        self.port, self.prefix = port, prefix
        self.client = GatewayClient(f"http://127.0.0.1:{port}", timeout_s=15, api_key=api_key)
        self.answers: list[tuple[float, int, str]] = []
        """(monotonic time, HTTP status (0: no answer), request id) per request."""
        self.probes: list[tuple[float, bool]] = []
        """(monotonic time, /readyz answered 200) per look."""
        self._halt = threading.Event()

    def run(self) -> None:
        n, next_probe, due = 0, 0.0, time.monotonic()
        while not self._halt.is_set():
            if time.monotonic() >= next_probe:
                self.probes.append((time.monotonic(), live.ready(self.port)))
                next_probe = time.monotonic() + 1.0
            rid = f"{self.prefix}-{n}"
            body = {"user_key": f"u{n % 40}", "session_id": f"s{n % 15}", "prompt_tokens": [5, 6, 7, 8],
                    "max_tokens": 4, "request_id": rid}
            n += 1
            try:
                status = self.client.complete(body)[0]
            except (OSError, http.client.HTTPException):
                status = 0
            self.answers.append((time.monotonic(), status, rid))
            due += 1.0 / RATE_PER_S
            self._halt.wait(max(0.0, due - time.monotonic()))

    def stop(self) -> None:
        self._halt.set()
        self.join(30)

    def answered(self) -> set[str]:
        return {rid for _, status, rid in self.answers if status == 200}

    def during(self, t0: float, t1: float) -> dict[str, Any]:
        """What the clients saw between ``t0`` and ``t1``."""
        got = [(t, status) for t, status, _ in self.answers if t0 <= t <= t1]
        ok = [t0] + [t for t, status in got if status == 200] + [t1]
        looks = [fine for t, fine in self.probes if t0 <= t <= t1]
        return {"requests_answered": sum(status == 200 for _, status in got),
                "requests_failed": sum(status != 200 for _, status in got),
                "longest_gap_between_answers_s": round(max(b - a for a, b in itertools.pairwise(ok)), 1),
                "readyz_looks": len(looks), "readyz_not_200": looks.count(False)}


class Outages:
    """The live services, their Prometheus and the stack whose parts go down."""

    def __init__(self, stack: EmbeddedStack, settings: Settings, env: dict[str, str], prom: live.Prom,
                 sup: Supervisor, tmp: Path) -> None:
        self.stack, self.settings, self.env, self.prom = stack, settings, env, prom
        self.sup, self.tmp = sup, tmp
        self.port = int(env["RTRL_GATEWAY__PORT"])
        self.rewards = RewardCounter(settings)
        self.answered: set[str] = set()

    def active(self, severity: str | None = None) -> list[tuple[str, str, str]]:
        """(alert, state, dependency or component) of each alert pending or firing now; every
        service must still run."""
        gone = self.sup.exited()
        logs = "\n".join(f"--- {n}\n{self.sup.log_tail(n, 30)}" for n in gone)
        assert not gone, f"services exited: {gone}\n{logs}"
        return [(a["labels"]["alertname"], a["state"],
                 a["labels"].get("dependency") or a["labels"].get("app_kubernetes_io_component", ""))
                for a in self.prom.alerts() if severity in (None, a["labels"].get("severity"))]

    def quiet(self, window_s: float) -> int:
        """No alert pending or firing at any look over ``window_s``; returns the looks."""
        looks, end = 0, time.monotonic() + window_s
        while time.monotonic() < end:
            active = self.active()
            looks += 1
            assert not active, (f"alerts active in normal operation (look {looks}): {active}; "
                                f"last scrapes: {json.dumps(self.prom.targets(), indent=1)}")
            time.sleep(SAMPLE_S)
        return looks

    def down(self, dep: str, down_s: float | None) -> tuple[float | None, list[str]]:
        """``dep`` stopped for ``down_s`` (None: until the alert fires): (seconds to the alert,
        every alert seen active meanwhile)."""
        t_stop, fired, seen = time.monotonic(), None, set[str]()
        assert self.stack.stop_service(dep), f"{dep} was not running"
        while True:
            elapsed = time.monotonic() - t_stop
            for name, state, what in self.active():
                seen.add(f"{name}{{{what}}}")
                if fired is None and (name, state, what) == (ALERT, "firing", dep):
                    fired = elapsed
            if (fired is not None and down_s is None) or (down_s is not None and elapsed >= down_s):
                return fired, sorted(seen)
            if fired is None and elapsed > FIRE_LIMIT_S:
                return None, sorted(seen)
            time.sleep(SAMPLE_S)

    def until_clear(self, t_back: float, limit_s: float, severity: str | None) -> float | None:
        while time.monotonic() - t_back < limit_s:
            if not self.active(severity):
                return round(time.monotonic() - t_back, 1)
            time.sleep(SAMPLE_S)
        return None

    def outage(self, dep: str, down_s: float | None, sc: scale.Scale) -> dict[str, Any]:
        clients = Clients(self.port, dep, "sim-api-key")
        clients.start()
        try:
            live.wait(lambda: len(clients.answered()) >= 20, 120, "the clients are not answered", self.sup)
            looks = self.quiet(sc.alert_quiet_s)
            t_stop = time.monotonic()
            fired, seen = self.down(dep, down_s)
            self.stack.start_service(dep, timeout_s=120)
            t_back = time.monotonic()
            cleared = self.until_clear(t_back, CLEAR_LIMIT_S, "critical")
            cleared_all = {"all_cleared_after_restart_s": self.until_clear(t_back, ALL_CLEAR_LIMIT_S, None)
                           } if sc.alert_all_clear else {}
        finally:
            clients.stop()
        self.answered |= clients.answered()
        return {"dependency": dep, "quiet_looks_before": looks, "outage_s": round(t_back - t_stop, 1),
                "alert_fired_after_s": None if fired is None else round(fired, 1),
                "critical_cleared_after_restart_s": cleared, **cleared_all,
                "alerts_seen": seen, **clients.during(t_stop, t_back)}

    def reconcile(self) -> dict[str, Any]:
        """Every answered request rewarded once, and ``rtrl reconcile --strict``'s verdict."""
        t0 = time.monotonic()
        while not self.answered <= set(self.rewards.counts) and time.monotonic() - t0 < 300:
            self.rewards.poll(500)
        settle = time.monotonic() + 5
        while time.monotonic() < settle:
            self.rewards.poll(200)
        served = {e.request_id for e in served_events(self.settings, len(self.answered))}
        cli = subprocess.run([RTRL, "reconcile", "--strict", "--json"], env=self.env, cwd=self.tmp,
                             capture_output=True, text=True, timeout=300)
        doc = json.loads(cli.stdout) if cli.stdout.strip().startswith("{") else {}
        twice = sorted(rid for rid, n in self.rewards.counts.items() if n > 1)
        dropped = self.prom.value('sum(rtrl_gateway_exposures_total{result=~"dropped|invalid"})')
        return {"served": len(served), "answered": len(self.answered),
                "answered_not_served": len(self.answered - served),
                "rewarded": len(set(self.rewards.counts) & served), "rewarded_twice": len(twice),
                "exposures_dropped_or_invalid": dropped, "rewards_drained_s": round(time.monotonic() - t0, 1),
                "reconcile_exit": cli.returncode, "reconcile_ok": doc.get("ok"),
                "reconcile_all_reflected": doc.get("all_reflected"),
                "reconcile_reward_records": doc.get("reward_records"),
                "reconcile_output": "" if cli.returncode == 0 else (cli.stdout + cli.stderr)[-2000:]}


def _start(sup: Supervisor, prom: live.Prom, ports: dict[str, int]) -> None:
    for name in SERVICES:
        sup.start(ProcSpec(name, serve_argv(name), {"RTRL_HTTP__PORT": str(ports[name])}))
    live.wait(lambda: live.ready(ports["gateway"]), 120, "the gateway never became ready", sup)
    live.wait(lambda: live.all_up(prom, len(SERVICES)), 180, "not every service is scraped", sup)
    up_at = time.time()  # a rule evaluated before every target answered may still show it pending
    live.wait(lambda: prom.evaluated_after(up_at), 120, "the alert rules are not evaluated", sup)


def _problems(phase: dict[str, Any], books: dict[str, Any]) -> list[str]:
    out = []
    if phase["alert_fired_after_s"] is None or phase["alert_fired_after_s"] > FIRE_LIMIT_S:
        out.append(f"{ALERT}{{{phase['dependency']}}} did not fire within {FIRE_LIMIT_S:.0f} s")
    if None in (phase["critical_cleared_after_restart_s"], phase.get("all_cleared_after_restart_s", 0)):
        out.append(f"alerts did not clear after {phase['dependency']} returned")
    if phase["dependency"] == "kafka" and (phase["readyz_not_200"] or phase["requests_failed"]
                                           or phase["longest_gap_between_answers_s"] > 10):
        out.append("the gateway did not stay ready and serving while the broker was down")
    if books["answered_not_served"] or books["exposures_dropped_or_invalid"] or books["rewarded_twice"]:
        out.append("exposures lost or rewarded twice")
    if books["rewarded"] != books["served"] or books["reconcile_exit"] != 0 or not books["reconcile_ok"]:
        out.append("rtrl reconcile --strict: not every served request rewarded exactly once")
    if books["reconcile_reward_records"] != books["served"] or not books["reconcile_all_reflected"]:
        out.append("rtrl reconcile --strict: reward records do not match the served requests")
    return out


def test_broker_and_redis_outages_page_clear_and_lose_no_exposure(
        isolated_stack: tuple[EmbeddedStack, Settings], mlflow_server: str, tmp_path: Path) -> None:
    binary = live.prometheus_binary()
    stack, settings = isolated_stack
    sc = scale.current()
    t_start = time.monotonic()
    ports = {name: free_port() for name in SERVICES}
    env = live.live_env(settings, mlflow_server, tmp_path, ports["gateway"],
                        RTRL_REWARD__TIME_SCALE=TIME_SCALE, RTRL_GATEWAY__SPOOL_DIR=str(tmp_path / "spool"))
    live.register_champion(env, tmp_path)
    ensure_topics(settings)
    prom = live.Prometheus(binary, tmp_path, free_port(), live.operator_targets(ports), live.shipped_rules(),
                           interval=f"{sc.alert_scrape_s:.0f}s")  # the rules as shipped: nothing rewritten
    sup = Supervisor(tmp_path / "logs", env)
    figures: dict[str, Any] = {}
    problems: list[str] = []
    run = None
    try:
        _start(sup, prom.api, ports)
        run = Outages(stack, settings, env, prom.api, sup, tmp_path)
        for dep, down_s in sc.alert_outages:
            phase = run.outage(dep, down_s, sc)
            books = run.reconcile()
            figures[dep] = {**phase, **books}
            problems += [f"{dep}: {p}" for p in _problems(phase, books)]
            if phase.get("all_cleared_after_restart_s", 0) is None:
                break  # the next outage would start from alerts still active
    finally:
        sup.stop_all(grace_s=10)
        prom.stop()
        if run is not None:
            run.rewards.close()
    figures["wall_s"] = round(time.monotonic() - t_start, 1)
    scale.record("outage_alerts", figures)
    logs = "\n".join(f"--- {n}\n{sup.log_tail(n, 15)}" for n in sup.procs)
    assert not problems, f"{problems}\n{json.dumps(figures, indent=1)}\n{logs}"
