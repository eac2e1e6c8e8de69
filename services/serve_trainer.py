"""``rtrl serve trainer``: RL increments on a schedule.

APScheduler 3 runs one interval job (``trainer.interval_s``, 5 h by default) from a
persistent SQLAlchemy job store in ``trainer.data_dir/jobs.sqlite``: a restarted trainer keeps
its schedule, a run missed while it was down runs once on start-up (coalesced, within
``misfire_grace_s``), and ``max_instances=1`` plus the increment lock mean never two
increments at once. ``/metrics``, ``/healthz`` and ``/readyz`` are served on ``http``.

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
from datetime import UTC, datetime

from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger

from services.runtime import metrics
from services.runtime.flags import deprecated_alias
from services.runtime.health import Health, HttpEndpoints
from services.runtime.process import Stopper, setup_logging
from services.runtime.settings import Settings, get_settings
from services.trainer_job import BusyError, describe, run_once, shutdown_ray

log = logging.getLogger("rtrl.trainer")
JOB_ID = "rtrl-increment"

_state: dict[str, object] = {}
_running = threading.Event()


def scheduled_increment() -> None:
    """The job the scheduler runs (module-level so the persistent job store can name it)."""
    settings = _state.get("settings")
    if not isinstance(settings, Settings):
        log.error("trainer settings not initialised; skipping this run")
        return
    stopper = _state.get("stopper")
    if isinstance(stopper, Stopper) and stopper.stopping:
        return
    _running.set()
    try:
        outcome = run_once(settings)
        log.info("increment: %s", describe(outcome))
    except BusyError as exc:
        log.warning("%s; this run is skipped", exc)
    except Exception:
        log.exception("increment failed; its window stays pending and the next run retries it")
    finally:
        _running.clear()


def make_scheduler(settings: Settings) -> BackgroundScheduler:
    t = settings.trainer
    t.data_dir.mkdir(parents=True, exist_ok=True)
    scheduler = BackgroundScheduler(
        jobstores={"default": SQLAlchemyJobStore(url=f"sqlite:///{(t.data_dir / 'jobs.sqlite').resolve()}")},
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
    # Ray's driver installs abseil's C++ failure-signal handler for SIGTERM at the OS level:
    # it replaces ours and arms a 3 s abort timer, so a graceful stop died of SIGABRT when the
    # signal came after an increment had started Ray. This process owns SIGTERM.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    metrics.BUILD_INFO.info({"service": "trainer"})
    metrics.TRAIN_CADENCE.set(settings.trainer.interval_s)

    stopper = Stopper().install()
    _state.update(settings=settings, stopper=stopper)
    scheduler = make_scheduler(settings)
    health = Health(liveness_timeout_s=60)
    health.add_check("scheduler", lambda: bool(scheduler.running))
    port = args.port if args.port is not None else settings.http.port
    http = HttpEndpoints(health, settings.http.host, port, metrics.registry_for("trainer")).start()
    scheduler.start()
    schedule(scheduler, settings)
    job = scheduler.get_job(JOB_ID)
    log.info("trainer scheduled every %.0fs; next increment at %s (metrics on port %d)",
             settings.trainer.interval_s, job.next_run_time if job else None, http.port)
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
