"""``rtrl serve gateway`` as a process: configured from RTRL_* env, serves on its port,
and on SIGTERM finishes, flushes the served events and exits 0."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deployer.adapters.mlflow_registry import MlflowRegistry
from ingest.events import CompletionServed, parse_event
from services.runtime.kafka_io import ensure_topics, make_consumer
from services.settings.model import Settings
from services.stack.embedded import free_port
from trainer.policy import TinyConfig, TinyTransformer


def test_serve_gateway_process_serves_and_stops_cleanly(settings: Settings, tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    reg = MlflowRegistry(uri, "proc-policy")
    small = TinyConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=64)
    reg.set_alias("champion", reg.register(None, TinyTransformer(small).save(tmp_path / "p")))
    ensure_topics(settings, [settings.topics.raw])
    port = free_port()
    env = {
        **os.environ,
        "RTRL_STACK__DATA_DIR": str(tmp_path / "nostack"),  # never read a developer's stack.env
        "RTRL_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "RTRL_REDIS__URL": settings.redis.url.get_secret_value(),
        "RTRL_REDIS__KEY_PREFIX": settings.redis.key_prefix,
        "RTRL_TOPICS__RAW": settings.topics.raw,
        "RTRL_MLFLOW__TRACKING_URI": uri,
        "RTRL_MLFLOW__REGISTERED_MODEL": "proc-policy",
        "RTRL_GATEWAY__PORT": str(port),
        "RTRL_GATEWAY__SECRET": "proc-secret",
        "RTRL_GATEWAY__API_KEYS": json.dumps({"team": "proc-api-key"}),
    }
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "gateway"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/readyz")
                ready = conn.getresponse()
                ready.read()
                if ready.status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "gateway process never became ready"
            time.sleep(0.3)
        body = json.dumps({"user_key": "p1", "session_id": "s", "prompt_tokens": [0, 3],
                           "request_id": "proc-1"}).encode()
        conn.request("POST", "/v1/completions", body=body)  # no API key
        resp = conn.getresponse()
        assert resp.status == 401 and "API key" in json.loads(resp.read())["error"]["message"]
        conn.request("POST", "/v1/completions", body=body, headers={"Authorization": "Bearer proc-api-key"})
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["model"]["name"] == "proc-policy"
        conn.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    consumer = make_consumer(settings.kafka, None, [settings.topics.raw])
    found = []
    deadline = time.monotonic() + 15
    while not found and time.monotonic() < deadline:
        for batch in consumer.poll(timeout_ms=200).values():
            found.extend(batch)
    consumer.close()
    assert [r.key for r in found] == [b"proc-1"]
    event = parse_event(found[0].value)
    assert isinstance(event, CompletionServed) and event.user_key == "p1"


@pytest.mark.parametrize("argv", [["--help"]])
def test_serve_gateway_help(argv: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "services.cli", "serve", "gateway", *argv],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--port" in out.stdout


def test_serve_gateway_refuses_to_start_without_api_keys(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    env.update({"RTRL_STACK__DATA_DIR": str(tmp_path), "RTRL_GATEWAY__SECRET": "s"})
    out = subprocess.run([sys.executable, "-m", "services.cli", "serve", "gateway", "--port", "0"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "RTRL_GATEWAY__API_KEYS" in out.stderr + out.stdout


def test_serve_gateway_refuses_a_spool_directory_others_may_write(tmp_path: Path) -> None:
    shared = tmp_path / "spool"
    shared.mkdir()
    shared.chmod(0o777)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    env.update({"RTRL_STACK__DATA_DIR": str(tmp_path), "RTRL_GATEWAY__SECRET": "s",
                "RTRL_GATEWAY__ALLOW_ANONYMOUS": "true", "RTRL_GATEWAY__SPOOL_DIR": str(shared)})
    out = subprocess.run([sys.executable, "-m", "services.cli", "serve", "gateway", "--port", "0"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"spool directory {shared} must belong to this user with mode 0700" in out.stderr + out.stdout
