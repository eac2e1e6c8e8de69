"""The statistics and plumbing of ``rtrl bench gateway --compare`` (bench/gateway_compare.py,
bench/open_loop.py, bench/litellm_proxy.py), without LiteLLM: the figures against plain
references and hand-computed cases, the open-loop step against the stand-in engine, and the
clear error when LiteLLM's virtualenv is missing."""

from __future__ import annotations

import math
import random
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from bench import gateway
from bench.fake_engine import FakeEngine
from bench.gateway_compare import (
    added,
    broke,
    engine_groups,
    kept,
    litellm_problem,
    parse_clients,
    ratio,
    ratios,
    row,
)
from bench.gateway_engine import bodies
from bench.litellm_proxy import MASTER_KEY, LitellmMissingError, config_yaml, litellm_command, litellm_venv
from bench.open_loop import MIN_REQUESTS, Pool, added_p99, due_times, held_rate, rate_ladder, step_up


def reference_percentile(values: list[float], q: float) -> float:
    """numpy's inverted-CDF percentile: the smallest value with at least q% at or below it."""
    return float(np.percentile(np.asarray(values), q, method="inverted_cdf"))


@pytest.mark.parametrize("seed", range(20))
def test_added_latency_is_the_difference_of_percentiles(seed: int) -> None:
    rng = random.Random(seed)
    direct = [rng.lognormvariate(3, 0.5) for _ in range(rng.randint(1, 400))]
    stack = [rng.lognormvariate(3.1, 0.7) for _ in range(rng.randint(1, 400))]
    got = added(direct, stack)
    for q in (50, 99):
        want = reference_percentile(stack, q) - reference_percentile(direct, q)
        assert got[f"added_p{q}_ms"] == pytest.approx(want, abs=1e-12)
    assert added_p99(stack, direct) == pytest.approx(got["added_p99_ms"], abs=1e-12)


def test_added_latency_by_hand() -> None:
    direct = [10.0] * 99 + [20.0]  # p50 10, p99 10 (the 99th of 100)
    stack = [12.0] * 98 + [40.0, 90.0]  # p50 12, p99 40
    assert added(direct, stack) == {"added_p50_ms": 2.0, "added_p99_ms": 30.0}
    assert math.isnan(added([], stack)["added_p99_ms"]) and math.isnan(added_p99(stack, []))


def steps(*rows: tuple[float, float, int]) -> list[dict[str, float]]:
    return [{"rate": r, "added_p99_ms": a, "errors": float(e)} for r, a, e in rows]


@pytest.mark.parametrize(("rows", "want"), [
    (steps((10, 1, 0), (20, 5, 0), (40, 49.9, 0)), 40.0),  # every step held
    (steps((10, 1, 0), (20, 50, 0), (40, 1, 0)), 10.0),  # 50 is not under 50; a later pass does not count
    (steps((10, 60, 0), (20, 1, 0)), 0.0),  # the lowest step fails
    (steps((10, 1, 0), (20, 1, 1)), 10.0),  # one failed request breaks a step
    (steps((10, 1, 0), (20, math.nan, 0)), 10.0),  # nothing answered: not held
    ([], 0.0),
])
def test_held_rate(rows: list[dict[str, float]], want: float) -> None:
    assert held_rate(rows, 50.0) == want


def test_rate_ladder_and_schedule() -> None:
    assert rate_ladder(10, 1.5, 2000) == [10, 15, 22, 34, 51, 76, 114, 171, 256, 384, 577, 865, 1297, 1946]
    assert rate_ladder(10, 2, 80) == [10, 20, 40, 80]
    with pytest.raises(ValueError):
        rate_ladder(10, 1.0, 100)
    assert due_times(4, 1.0) == [0.0, 0.25, 0.5, 0.75]
    assert len(due_times(34, 3.0)) == 102


def test_ratio_is_only_for_positive_figures() -> None:
    assert ratio(1.0, 4.0) == 0.25
    for ours, theirs in ((1.0, 0.0), (1.0, -2.0), (-1.0, 2.0), (math.nan, 1.0), (1.0, math.inf)):
        assert math.isnan(ratio(ours, theirs))


def test_kept_drops_the_failed_requests() -> None:
    assert kept([1.0, 2.0, 3.0, 4.0], {1, 3}) == [1.0, 3.0]


@pytest.mark.parametrize(("clients", "real", "want"), [
    ([1, 64], False, [(1.0, [1]), (20.0, [64])]),
    ([64, 1], False, [(1.0, [1]), (20.0, [64])]),
    ([1], False, [(1.0, [1])]),
    ([64, 8], False, [(20.0, [64, 8])]),
    ([1, 64], True, [(None, [1, 64])]),
])
def test_engine_groups(clients: list[int], real: bool, want: list[tuple[float | None, list[int]]]) -> None:
    assert engine_groups(clients, 1.0, 20.0, real) == want
    if not real:
        assert engine_groups(clients, 5.0, 5.0, False) == [(5.0, sorted(clients, key=lambda c: c != 1))]


def test_parse_clients() -> None:
    assert parse_clients("1,64") == [1, 64]
    with pytest.raises(ValueError):
        parse_clients("0")


def test_a_row_and_the_ratios() -> None:
    timed = {"direct": ([10.0] * 100, 0), "rtrl": ([11.0] * 100, 0), "litellm": ([14.0] * 99, 1)}
    r = row(timed, {"rtrl_cpu_ms": 2.0, "litellm_cpu_ms": 8.0})
    assert r["rtrl"]["added_p99_ms"] == 1.0 and r["litellm"]["added_p99_ms"] == 4.0
    assert r["litellm"]["errors"] == 1 and r["litellm"]["answered"] == 99
    one = row(timed, {"rtrl_cpu_ms": 3.0, "litellm_cpu_ms": 3.0})
    got = ratios({"1 whole": one, "64 whole": r, "64 streamed": r})
    assert got == {"cpu_per_request_whole": 0.25, "added_p99_64_clients_whole": 0.25,
                   "cpu_per_request_streamed": 0.25, "added_p99_64_clients_streamed": 0.25}


def test_litellm_config_is_a_plain_pass_through() -> None:
    cfg = yaml.safe_load(config_yaml("bench-policy", "tiny: base", "http://127.0.0.1:8000/"))
    assert cfg == {
        "model_list": [{"model_name": "bench-policy",
                        "litellm_params": {"model": "openai/tiny: base", "api_base": "http://127.0.0.1:8000/v1",
                                           "api_key": "none"}}],
        "general_settings": {"master_key": MASTER_KEY},
        "litellm_settings": {"drop_params": True},
    }


def test_a_missing_litellm_says_to_run_the_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_VENV", str(tmp_path / "env"))
    assert litellm_venv() == tmp_path / "env" and litellm_venv("/x") == Path("/x")
    with pytest.raises(LitellmMissingError, match="run scripts/litellm-env"):
        litellm_command(litellm_venv())
    assert "scripts/litellm-env" in (litellm_problem(None) or "")
    (tmp_path / "env" / "bin").mkdir(parents=True)
    (tmp_path / "env" / "bin" / "litellm").write_text("")
    assert litellm_problem(None) is None


def test_compare_without_litellm_stops_before_starting_anything(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert gateway.main(["--compare", "--litellm-venv", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "scripts/litellm-env" in err and "starting a private broker" not in err


def test_an_open_loop_step_against_the_stand_in_engine() -> None:
    fake = FakeEngine(token_ms=0.0).start()
    try:
        direct_b, _ = bodies("base", "m", 10, 2, False)
        pool = Pool((fake.base_url, direct_b, None), 4)
        res = pool.step(rate=400.0, seconds=0.1)  # a step lasts at least MIN_REQUESTS requests
        pool.close()
        assert len(res["latency"]) == MIN_REQUESTS and not res["errors"]
        assert fake.connections == 4  # opened before the step and kept open through it
        climb = step_up((fake.base_url, direct_b, None), {"same": (fake.base_url, direct_b, None)},
                        [500.0, 1000.0], 0.1, 2, limit_ms=-1e9, warmup_rate=1000.0)
        assert climb["same"]["held_per_s"] == 0.0 and len(climb["same"]["steps"]) == 1  # stops climbing
    finally:
        fake.stop()


def test_a_connection_the_server_closed_while_idle_is_opened_anew() -> None:
    """A server's idle timeout (uvicorn's is 5 s) closes pooled connections between a step's
    requests; the pool reconnects as client pools do instead of counting a failed request."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        pool = Pool((url, [b"{}"], None), 1)
        pool.posters[0].conn.connect()
        accepted, _ = server.accept()
        first = pool.posters[0]
        assert pool._usable(0) is first  # open and idle: reused
        accepted.close()  # the server's idle timeout
        time.sleep(0.05)
        assert pool._usable(0) is not first and first.conn.sock is None
        pool.close()


def test_the_step_that_broke_the_climb_is_named() -> None:
    assert broke(steps((10, 1, 0), (15, 51.25, 0))) == " (at 15: added p99 +51.2 ms, 0 errors)"
    assert broke(steps((10, 1, 0), (15, 1, 3))) == " (at 15: added p99 +1.0 ms, 3 errors)"
    assert broke(steps((10, 1, 0))) == "" and broke([]) == ""  # the top of the ladder was held
