"""LiteLLM's proxy as a plain pass-through, the third stack of ``rtrl bench gateway --compare``.

LiteLLM lives in its own virtualenv (``scripts/litellm-env`` makes ``.venv-litellm``; it pins
its own openai, pydantic and fastapi), so the bench runs its ``litellm`` command as a child
process, as teams run it, and talks to it over HTTP only.

The configuration (:func:`config_yaml`) is the least a team would write to put LiteLLM in
front of one OpenAI-compatible engine: one ``model_list`` entry ``openai/<engine model>`` with
``api_base`` at the engine, a master key (LiteLLM refuses to start without one), no database,
no callbacks, no cache, no router settings. It runs with its defaults otherwise (one uvicorn
worker, uvloop), with its access log off (``LITELLM_LOG=ERROR``) and its model cost map read
from the package instead of fetched from the internet (``LITELLM_LOCAL_MODEL_COST_MAP``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Self

from bench.processes import tree_cpu_s
from services.stack.embedded import free_port

LITELLM_VERSION = "1.110.2"
"""What ``scripts/litellm-env`` installs."""
REPO = Path(__file__).resolve().parents[1]
MASTER_KEY = "sk-rtrl-bench-" + "0123456789abcdef" * 2
"""The proxy's master key: its clients' bearer token (a benchmark's, never a secret)."""


class LitellmMissingError(RuntimeError):
    pass


def litellm_venv(explicit: str | None = None) -> Path:
    """The virtualenv to run LiteLLM from: ``explicit``, else ``$LITELLM_VENV``, else the
    repository's ``.venv-litellm``."""
    return Path(explicit or os.environ.get("LITELLM_VENV") or REPO / ".venv-litellm")


def litellm_command(venv: Path) -> Path:
    """The venv's ``litellm`` command; :class:`LitellmMissingError` saying how to make it."""
    command = venv / "bin" / "litellm"
    if not command.is_file():
        raise LitellmMissingError(f"no LiteLLM proxy at {command}: run scripts/litellm-env (it installs "
                             f"litellm[proxy]=={LITELLM_VERSION} into .venv-litellm), or point "
                             "--litellm-venv or LITELLM_VENV at a virtualenv that has it")
    return command


def config_yaml(public_model: str, engine_model: str, engine_url: str, master_key: str = MASTER_KEY) -> str:
    """LiteLLM's config.yaml: ``public_model`` served by the engine at ``engine_url``. JSON is
    YAML, so the values are quoted as JSON strings."""
    q = json.dumps
    return "\n".join([
        "model_list:",
        f"  - model_name: {q(public_model)}",
        "    litellm_params:",
        f"      model: {q('openai/' + engine_model)}",
        f"      api_base: {q(engine_url.rstrip('/') + '/v1')}",
        f"      api_key: {q('none')}",
        "general_settings:",
        f"  master_key: {q(master_key)}",
        "litellm_settings:",
        "  drop_params: true",
        "",
    ])


def proxy_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(base if base is not None else os.environ)
    env.update({"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"})
    env.pop("PYTHONPATH", None)  # LiteLLM's venv, not rtrl's
    return env


class LitellmProxy:
    """``litellm --config`` on a free loopback port, in its own session (so :meth:`stop` ends
    its whole process tree and nothing else)."""

    def __init__(self, venv: Path, workdir: Path, public_model: str, engine_model: str,
                 engine_url: str, workers: int = 1) -> None:
        self.command = litellm_command(venv)
        self.workdir = workdir
        self.config = config_yaml(public_model, engine_model, engine_url)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {MASTER_KEY}"}
        self.workers = workers
        self.startup_s = float("nan")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 180.0) -> Self:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "config.yaml").write_text(self.config)
        log = (self.workdir / "litellm.log").open("wb")
        t0 = time.monotonic()
        self._proc = subprocess.Popen(
            [str(self.command), "--config", "config.yaml", "--host", "127.0.0.1", "--port", str(self.port),
             "--num_workers", str(self.workers)],
            cwd=self.workdir, env=proxy_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        while not self._alive():
            if self._proc.poll() is not None or time.monotonic() - t0 > timeout_s:
                self.stop()
                raise RuntimeError(f"LiteLLM's proxy did not start (exit {self._proc.returncode}); the end "
                                   f"of its log:\n{self.log_tail()}")
            time.sleep(0.2)
        self.startup_s = time.monotonic() - t0
        return self

    def _alive(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health/liveliness", timeout=2) as resp:  # noqa: S310
                return bool(resp.status == 200)
        except OSError:
            return False

    def log_tail(self, chars: int = 3000) -> str:
        path = self.workdir / "litellm.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def cpu_s(self) -> float:
        """CPU seconds the proxy's process tree has used so far."""
        return tree_cpu_s(self._proc.pid) if self._proc is not None else float("nan")

    def stop(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(5)
