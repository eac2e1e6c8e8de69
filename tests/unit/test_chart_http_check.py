"""files/tests/http_check.py, the check the `helm test` pods run in the rtrl image: every
URL must answer 200, the gateway's /v1/ paths get a client key, and each failure is named."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.error import HTTPError, URLError
from urllib.request import Request

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "helm" / "rtrl" / "files" / "tests" / "http_check.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("http_check", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_script = _load()


class _Response:
    def __init__(self, status: int) -> None:
        self.status = status

    def __enter__(self) -> _Response:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class FakeOpener:
    """Answers each URL with a status (or raises an error), recording what was asked."""

    def __init__(self, answers: dict[str, int | Exception]) -> None:
        self.answers = answers
        self.requests: list[Request] = []

    def __call__(self, request: Request, timeout: float) -> Any:
        self.requests.append(request)
        answer = self.answers[request.full_url]
        if isinstance(answer, Exception):
            raise answer
        if answer >= 400:
            body = io.BytesIO(b'{"failing": ["broker"]}')
            raise HTTPError(request.full_url, answer, "error", {}, body)  # type: ignore[arg-type]
        return _Response(answer)


GW = "http://rel-rtrl-gateway:80"


def test_every_url_answering_200_passes_and_the_key_goes_only_to_v1_paths(capsys) -> None:
    opener = FakeOpener({f"{GW}/readyz": 200, f"{GW}/v1/models": 200})
    env = {"RTRL_GATEWAY__API_KEYS": '{"app": "k-1", "other": "k-2"}'}
    assert check_script.main([f"{GW}/readyz", f"{GW}/v1/models"], env, opener) == 0
    readyz, models = opener.requests
    assert readyz.get_header("Authorization") is None
    assert models.get_header("Authorization") == "Bearer k-1"
    assert capsys.readouterr().out.count("ok ") == 2


@pytest.mark.parametrize("answer", [503, 401, 204, URLError("connection refused"), TimeoutError("timed out")])
def test_any_other_answer_fails_naming_the_url(answer: int | Exception, capsys) -> None:
    opener = FakeOpener({f"{GW}/readyz": 200, "http://rel-rtrl-ingest:9100/readyz": answer})
    assert check_script.main([f"{GW}/readyz", "http://rel-rtrl-ingest:9100/readyz"], {}, opener) == 1
    err = capsys.readouterr().err
    assert "FAIL http://rel-rtrl-ingest:9100/readyz" in err and "gateway" not in err


def test_a_failing_readiness_check_is_named() -> None:
    opener = FakeOpener({"http://rel-rtrl-reward:9100/readyz": 503})
    problem = check_script.check("http://rel-rtrl-reward:9100/readyz", None, 5.0, opener)
    assert problem == 'http://rel-rtrl-reward:9100/readyz: HTTP 503 {"failing": ["broker"]}'


def test_without_urls_or_with_another_scheme_it_fails() -> None:
    assert check_script.main([], {}, FakeOpener({})) == 2
    assert check_script.main(["file:///etc/passwd"], {}, FakeOpener({})) == 1


@pytest.mark.parametrize(("keys", "token"), [('{"a": "x"}', "x"), ("{}", None), ("", None), ('["x"]', None)])
def test_the_bearer_is_the_first_key(keys: str, token: str | None) -> None:
    assert check_script.bearer(keys) == token


def test_it_runs_as_python_dash_c_with_the_standard_library_only(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-I", "-c", SCRIPT.read_text(), "file:///nowhere"],
                          capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path)
    assert proc.returncode == 1 and "not an http(s) URL" in proc.stderr
