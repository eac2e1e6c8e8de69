"""``rtrl serve trainer``: RL increments on an adaptive cadence (trainer/cadence.py).

APScheduler 3 runs one interval job (``trainer.interval_s``, 5 h by default) from a
persistent SQLAlchemy job store in ``trainer.data_dir/jobs.sqlite``: a restarted trainer keeps
its schedule, and a run missed while it was down fires once on start-up (coalesced, within
``misfire_grace_s``). The interval job does not train by itself: it marks an increment *due*
(the file ``trainer.data_dir/increment_due``, so a restart keeps it) and a check job, every
``trainer.check_every_s``, decides: start when due or when ``trainer.trigger``'s records have
arrived, never while a canary is in flight. An increment started early by records pushes the
next interval run to a full interval later. Each decision to wait is logged when it changes,
exported (``rtrl_trainer_waiting{waiting_for}``, ``rtrl_trainer_pending_records``/``_ess``) and
written to Redis for ``rtrl status``. One check at a time and the increment lock mean never
two increments at once. ``/metrics``, ``/healthz`` and ``/readyz`` are served on ``http``.

SIGTERM: no new increment starts; a running one gets ``stop_grace_s`` to finish. If it has
not finished by then the process exits anyway (0) — its window stays pending and the next
run resumes it from the last Ray Train checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from apscheduler.jobstores.memory import MemoryJobStore
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger

from deployer.registry import candidate_in_flight
from ingest.contracts import prometheus as metrics
from ingest.contracts.registry import CHAMPION
from services.runtime.flags import deprecated_alias
from services.runtime.health import Health, HttpEndpoints
from services.runtime.kafka_io import ensure_topics, make_consumer
from services.runtime.mlflow_http import retry_later
from services.runtime.process import Stopper, setup_logging
from services.runtime.redis_io import make_redis
from services.settings.model import Settings, get_settings
from services.wiring.trainer import BusyError, describe, registry_from, run_once, shutdown_ray
from trainer.adapters.kafka_rewards import KafkaRewardLog
from trainer.adapters.redis_cadence import write_cadence
from trainer.cadence import Decision, Readiness, RecordTally, Trigger, decide
from trainer.increment import served_as_champion

if TYPE_CHECKING:
    import redis

    from deployer.adapters.mlflow_registry import MlflowRegistry

log = logging.getLogger("rtrl.trainer")
JOB_ID = "rtrl-increment"
CHECK_JOB_ID = "rtrl-cadence-check"
WAITING_FOR = ("canary", "records")

_state: dict[str, object] = {}
_running = threading.Event()
_checking = threading.Lock()


def scheduled_increment() -> None:
    """The interval job (module-level so the persistent job store can name it): the interval
    has passed, so an increment is due; the check decides when it can start."""
    settings = _state.get("settings")
    if not isinstance(settings, Settings):
        log.error("trainer settings not initialised; skipping this run")
        return
    due_file(settings).touch()
    check()


def due_file(settings: Settings) -> Path:
    settings.trainer.data_dir.mkdir(parents=True, exist_ok=True)
    return settings.trainer.data_dir / "increment_due"


class Watch:
    """What the check looks at between increments: the records after the cut (read once
    each, through a consumer kept open), the canary in flight and the due marker."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        t = settings.trainer
        self.trigger = Trigger(t.trigger.min_records, t.trigger.min_ess)
        self.tally = RecordTally(settings.topics.rewards)
        self._rewards: KafkaRewardLog | None = None
        self._registry: MlflowRegistry | None = None
        self._redis: redis.Redis | None = None
        self.rest_until = 0.0
        """Until when the records trigger rests (monotonic clock)."""
        self.last_key: tuple[bool, str, str | None] | None = None

    def observe(self) -> Readiness:
        s = self.settings
        if self._rewards is None:
            ensure_topics(s, [s.topics.rewards])  # a fresh install: no reward yet is 0 records
            consumer = make_consumer(s.kafka, s.trainer.consumer_group, isolation_level="read_committed",
                                     max_poll_records=2000)
            self._rewards = KafkaRewardLog(consumer, s.topics.rewards)
        if self._registry is None:
            self._registry = registry_from(s)
        registry = self._registry
        canary = candidate_in_flight(registry)
        self.tally.update(self._rewards)
        keep = (served_as_champion(registry, registry.alias_version(CHAMPION) or "")
                if s.trainer.train_on == "champions" else (lambda _v: True))
        records, ess = self.tally.figures(keep)
        return Readiness(due_file(s).exists(), records, ess, canary, time.monotonic() < self.rest_until)

    def redis(self) -> redis.Redis:
        """One client for the status writes, kept between checks."""
        if self._redis is None:
            self._redis = make_redis(self.settings.redis)
        return self._redis

    def close(self) -> None:
        if self._rewards is not None:
            self._rewards.close()
            self._rewards = None
        if self._redis is not None:
            self._redis.close()
            self._redis = None


def check() -> None:
    """Decide, say, and start the increment if the rule says so. One check at a time."""
    settings, watch, stopper = _state.get("settings"), _state.get("watch"), _state.get("stopper")
    if not isinstance(settings, Settings) or not isinstance(watch, Watch):
        return
    if (isinstance(stopper, Stopper) and stopper.stopping) or not _checking.acquire(blocking=False):
        return
    try:
        try:
            readiness = watch.observe()
        except Exception as exc:  # the same rule as a deployer tick (services/serve_deployer.run_tick)
            retry_later("trainer", "cadence check", exc, log)
            watch.close()
            return
        decision = decide(readiness, watch.trigger)
        publish(settings, watch, readiness, decision)
        if decision.start and not start_increment(settings, decision) and decision.trigger == "records":
            watch.rest_until = time.monotonic() + settings.trainer.trigger.retry_s
    finally:
        _checking.release()


def publish(settings: Settings, watch: Watch, r: Readiness, d: Decision) -> None:
    """The decision in the metrics, the log (when it changes) and Redis (for ``rtrl status``)."""
    metrics.TRAIN_PENDING_RECORDS.set(r.records)
    metrics.TRAIN_PENDING_ESS.set(r.ess)
    for what in WAITING_FOR:
        metrics.TRAIN_WAITING.labels(what).set(1 if d.waiting_for == what else 0)
    key = (d.start, d.waiting_for, r.canary)
    if d.start or key != watch.last_key:  # a wait is logged when what it waits for changes
        log.info("cadence: %s: %s", "start" if d.start else "wait", d.reason)
    watch.last_key = key
    body = {"start": d.start, "trigger": d.trigger, "waiting_for": d.waiting_for, "reason": d.reason,
            "due": r.due, "records": r.records, "ess": round(r.ess, 1), "canary": r.canary,
            "min_records": watch.trigger.min_records, "min_ess": watch.trigger.min_ess, "at": time.time()}
    try:
        ttl = max(60, int(10 * settings.trainer.check_every_s))  # gone soon after the trainer
        write_cadence(watch.redis(), settings.redis.key_prefix, body, ttl)
    except Exception as exc:  # status for operators only: the cadence does not depend on it
        log.debug("could not write the cadence status to Redis: %s", exc)


def start_increment(settings: Settings, decision: Decision) -> bool:
    """Run one increment now; whether it registered a candidate. The due marker is cleared as
    it starts (a failed increment's window stays pending and is retried at the next due time
    or trigger)."""
    due_file(settings).unlink(missing_ok=True)
    metrics.TRAIN_STARTS.labels(decision.trigger).inc()
    if decision.trigger == "records":
        push_interval(settings)
    _running.set()
    try:
        outcome = run_once(settings)
        log.info("increment: %s", describe(outcome))
        return outcome.status == "success"
    except BusyError as exc:
        log.warning("%s; this run is skipped", exc)
    except Exception:
        log.exception("increment failed; its window stays pending and the next run retries it")
    finally:
        _running.clear()
    return False


def push_interval(settings: Settings) -> None:
    """An increment started early: the next interval run is a full interval from now."""
    scheduler = _state.get("scheduler")
    if isinstance(scheduler, BackgroundScheduler) and scheduler.get_job(JOB_ID) is not None:
        scheduler.modify_job(JOB_ID, next_run_time=_now() + timedelta(seconds=settings.trainer.interval_s))


def make_scheduler(settings: Settings) -> BackgroundScheduler:
    t = settings.trainer
    t.data_dir.mkdir(parents=True, exist_ok=True)
    scheduler = BackgroundScheduler(
        jobstores={"default": SQLAlchemyJobStore(url=f"sqlite:///{(t.data_dir / 'jobs.sqlite').resolve()}"),
                   "memory": MemoryJobStore()},
        job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": t.misfire_grace_s},
        timezone="UTC",
    )
    return scheduler


def schedule(scheduler: BackgroundScheduler, settings: Settings) -> None:
    """Add (or update) the interval job; keeps the stored next run time when the interval is
    unchanged, so a restart does not push the next increment back."""
    t = settings.trainer
    trigger = IntervalTrigger(seconds=t.interval_s, timezone="UTC")
    existing = scheduler.get_job(JOB_ID)
    if existing is not None and isinstance(existing.trigger, IntervalTrigger) \
            and existing.trigger.interval.total_seconds() == t.interval_s:
        log.info("keeping the stored schedule: next increment at %s", existing.next_run_time)
    else:
        scheduler.add_job(scheduled_increment, trigger, id=JOB_ID, name="RL increment",
                          replace_existing=True)
    if t.run_on_start:
        scheduler.modify_job(JOB_ID, next_run_time=_now())
    # the check: not persisted (it has no state of its own); a second instance may start
    # while the first runs an increment and returns at once, so the scheduler never warns
    scheduler.add_job(check, IntervalTrigger(seconds=t.check_every_s, timezone="UTC"), id=CHECK_JOB_ID,
                      name="cadence check", jobstore="memory", replace_existing=True, max_instances=2,
                      next_run_time=_now())


def _now() -> datetime:
    return datetime.now(UTC)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rtrl serve trainer", description=__doc__.split("\n")[0])
    ap.add_argument("--interval-s", type=float, help="seconds between increments (overrides settings)")
    deprecated_alias(ap, "--interval", "--interval-s")
    ap.add_argument("--run-on-start", action="store_true", help="start one increment right away")
    ap.add_argument("--port", type=int, help="port for /metrics /healthz /readyz")
    deprecated_alias(ap, "--metrics-port", "--port")
    args = ap.parse_args(argv)
    settings = get_settings()
    updates: dict[str, object] = {}
    if args.interval_s is not None:
        updates["interval_s"] = args.interval_s
    if args.run_on_start:
        updates["run_on_start"] = True
    if updates:
        settings = settings.model_copy(update={"trainer": settings.trainer.model_copy(update=updates)})
    setup_logging(settings.log_level, "trainer")
    # the executor logs every run of every job at INFO: a check every few seconds would flood
    # the log; the cadence logs its own decisions
    logging.getLogger("apscheduler.executors.default").setLevel(logging.WARNING)
    # Ray's driver installs abseil's C++ failure-signal handler for SIGTERM at the OS level:
    # it replaces ours and arms a 3 s abort timer, so a graceful stop died of SIGABRT when the
    # signal came after an increment had started Ray. This process owns SIGTERM.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    metrics.BUILD_INFO.info({"rtrl_service": "trainer"})
    metrics.TRAIN_CADENCE.set(settings.trainer.interval_s)

    stopper = Stopper().install()
    scheduler = make_scheduler(settings)
    watch = Watch(settings)
    _state.update(settings=settings, stopper=stopper, watch=watch, scheduler=scheduler)
    health = Health(liveness_timeout_s=60)
    health.add_check("scheduler", lambda: bool(scheduler.running))
    port = args.port if args.port is not None else settings.http.port
    http = HttpEndpoints(health, settings.http.host, port, metrics.registry_for("trainer")).start()
    scheduler.start()
    schedule(scheduler, settings)
    job = scheduler.get_job(JOB_ID)
    trig = settings.trainer.trigger
    log.info("trainer scheduled every %.0fs%s; next increment due at %s; checks every %.0fs "
             "(metrics on port %d)", settings.trainer.interval_s,
             f" or at {trig.min_records} records (effective sample size {trig.min_ess:g})"
             if trig.min_records else "", job.next_run_time if job else None,
             settings.trainer.check_every_s, http.port)
    while not stopper.wait(1.0):
        health.beat()
    log.info("stopping: no new increments")
    scheduler.pause()
    deadline = time.monotonic() + settings.trainer.stop_grace_s
    while _running.is_set() and time.monotonic() < deadline:
        time.sleep(0.5)
    abandoned = _running.is_set()
    scheduler.shutdown(wait=False)
    http.stop()
    if not abandoned and _checking.acquire(timeout=5):  # no check is reading meanwhile
        watch.close()
    if abandoned:
        log.warning("the running increment did not finish within %.0fs; its window stays pending "
                    "and the next run resumes it", settings.trainer.stop_grace_s)
        stopped = _terminate_local_ray()
        log.info("stopped %d local Ray processes; exiting", stopped)
        logging.shutdown()
        os._exit(0)  # the scheduler's worker thread would otherwise hold the interpreter open
    shutdown_ray()
    return 0


def _terminate_local_ray() -> int:
    """SIGTERM the processes of the local Ray node this process started (none when it joined
    a cluster); the raylet stops its workers. This process's own Ray driver is left alone:
    ray.shutdown() while the increment's thread still waits in ray.get tears the driver down
    under it, and Ray then ends the process with exit code 1 as soon as that thread touches
    an object reference. Returns how many processes were signalled."""
    if "ray" not in sys.modules:
        return 0
    from ray._private import worker as ray_worker  # only once an increment has imported Ray

    node = getattr(ray_worker, "_global_node", None)
    if node is None:
        return 0
    signalled = 0
    for infos in list(node.all_processes.values()):
        for info in infos:
            if info.process.poll() is None:
                info.process.terminate()
                signalled += 1
    return signalled
