"""The deployer's :class:`deployer.engine.EnginePort` for vLLM (or any server with vLLM's
runtime LoRA API): ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, ``/v1/models``
and a greedy check request on ``/v1/completions`` (deployer/engine.py).

Redis keys (``p`` = key prefix)::

    {p}engine:model:{version}   the engine model name the gateway serves the version as
    {p}engine:state:{version}   JSON EngineState: ready | failed, with the reason
"""

from __future__ import annotations

import http.client
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from ingest.contracts.keys import engine_model_key, engine_state_key

from deployer.engine import (
    FAILED,
    READY,
    EngineCheckError,
    EngineState,
    check_request,
    engine_model_name,
    find_adapter,
    is_base,
    read_check,
    served_problem,
)

log = logging.getLogger(__name__)


class Downloads(Protocol):
    def download(self, version: str, dst_dir: str | Path) -> Path: ...


class EngineUnavailableError(ConnectionError):
    """The engine could not be reached (transient: the tick retries)."""


class VllmEngine:
    def __init__(self, base_url: str, redis_client: Any, key_prefix: str, registry: Downloads,
                 registered_model: str, base_model: str, adapter_dir: Path,
                 engine_adapter_dir: Path | None = None, api_key: str | None = None,
                 tolerance: float = 0.05, timeout_s: float = 60.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in {"http", "https"} or not parts.hostname:
            raise ValueError(f"engine base_url {base_url!r} must be http(s)://host[:port]")
        self.base_url = base_url
        self._parts = parts
        self._redis, self._prefix, self._registry = redis_client, key_prefix, registry
        self._registered, self.base_model = registered_model, base_model
        self._dir, self._engine_dir = adapter_dir, engine_adapter_dir or adapter_dir
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.tolerance, self.timeout_s = tolerance, timeout_s

    # ----------------------------------------------------------------- HTTP
    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        cls = http.client.HTTPSConnection if self._parts.scheme == "https" else http.client.HTTPConnection
        conn = cls(self._parts.hostname or "", self._parts.port, timeout=self.timeout_s)
        try:
            payload = json.dumps(body).encode() if body is not None else None
            conn.request(method, self._parts.path.rstrip("/") + path, body=payload, headers=self._headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise EngineUnavailableError(f"engine {self.base_url} unreachable: {exc}") from None
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw[:300].decode("utf-8", "replace")

    def models(self) -> set[str]:
        status, data = self._call("GET", "/v1/models")
        if status != 200 or not isinstance(data, dict):
            raise EngineUnavailableError(f"engine /v1/models answered {status}")
        return {str(m.get("id")) for m in data.get("data", []) if isinstance(m, dict)}

    # ----------------------------------------------------------------- state in Redis
    def state(self, version: str) -> EngineState | None:
        return EngineState.from_text(self._redis.get(engine_state_key(self._prefix, version)))

    def states(self) -> dict[str, EngineState]:
        out = {}
        for key in self._redis.scan_iter(match=engine_state_key(self._prefix, "*"), count=100):
            version = (key.decode() if isinstance(key, bytes) else str(key)).rsplit(":", 1)[-1]
            st = self.state(version)
            if st is not None:
                out[version] = st
        return out

    def _record(self, version: str, st: EngineState) -> EngineState:
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(engine_state_key(self._prefix, version), st.to_text())
        if st.state == READY:
            pipe.set(engine_model_key(self._prefix, version), st.model)
        else:
            pipe.delete(engine_model_key(self._prefix, version))
        pipe.execute()
        log.info("engine: version %s %s %s", version, st.state, st.reason)
        return st

    # ----------------------------------------------------------------- the port
    def ensure_loaded(self, version: str) -> EngineState:
        known = self.state(version)
        if known is not None and known.state == FAILED:
            return known
        if known is not None and known.state == READY and known.model in self.models():
            return known
        root = self._registry.download(version, self._dir / f"v{version}")
        try:
            model = self._load(version, root)
            self._check(model, root)
        except EngineCheckError as exc:
            if not is_base(root):
                self._unload_adapter(engine_model_name(self._registered, version))
            return self._record(version, EngineState(FAILED, str(exc)[:500]))
        return self._record(version, EngineState(READY, model=model))

    def _load(self, version: str, root: Path) -> str:
        if is_base(root):
            return self.base_model
        adapter = find_adapter(root)
        if adapter is None:
            raise EngineCheckError("the version holds no LoRA adapter (adapter/adapter_config.json)")
        name = engine_model_name(self._registered, version)
        path = self._engine_dir / adapter.relative_to(self._dir)
        status, data = self._call("POST", "/v1/load_lora_adapter",
                                  {"lora_name": name, "lora_path": str(path), "load_inplace": True})
        if status != 200:
            raise EngineCheckError(f"the engine refused the adapter ({status}): {_message(data)}")
        return name

    def _check(self, model: str, root: Path) -> None:
        """A warm-up request that also checks the engine's greedy answer to the fixed prompt."""
        check = read_check(root)
        status, data = self._call("POST", "/v1/completions", check_request(model, check))
        if status != 200:
            raise EngineCheckError(f"the warm-up request failed ({status}): {_message(data)}")
        problem = served_problem(check, data, self.tolerance)
        if problem is not None:
            raise EngineCheckError(problem)

    def unload(self, version: str) -> None:
        known = self.state(version)
        self._redis.delete(engine_model_key(self._prefix, version), engine_state_key(self._prefix, version))
        if known is not None and known.model and known.model != self.base_model:
            self._unload_adapter(known.model)
        shutil.rmtree(self._dir / f"v{version}", ignore_errors=True)
        log.info("engine: version %s unloaded", version)

    def _unload_adapter(self, name: str) -> None:
        status, data = self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        if status != 200:  # e.g. not loaded (any more): nothing to do
            log.info("engine: unloading %s answered %s: %s", name, status, _message(data))

    def describe(self) -> dict[str, Any]:
        try:
            models: list[str] | str = sorted(self.models())
        except EngineUnavailableError as exc:
            models = f"unreachable: {exc}"
        return {"base_url": self.base_url, "engine_models": models,
                "versions": {v: {"state": s.state, "model": s.model, "reason": s.reason}
                             for v, s in sorted(self.states().items())}}


def _message(data: Any) -> str:
    if isinstance(data, dict):
        err = data.get("error", data.get("message", data))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:300]
    return str(data)[:300]
