"""Candidates on an inference engine: loaded and checked before any traffic, rolled back when
they cannot be served, unloaded when they stop serving (state machine + in-memory engine),
and the pure check of the engine's log-probabilities."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deployer.adapters.memory import FakeEngine, FakeWorld
from deployer.engine import (
    Check,
    EngineCheckError,
    EngineState,
    Greedy,
    check_problem,
    check_request,
    engine_model_name,
    engine_prompt_logprobs,
    find_adapter,
    greedy_problem,
    is_base,
    read_check,
    served_problem,
    write_check,
)
from deployer.ledger import TAG_OUTCOME, TAG_REASON
from deployer.status import CanaryPolicy, Command
from services.cli.operator import render_engine

pytestmark = pytest.mark.unit

POLICY = CanaryPolicy(steps=(0.1, 0.5), bake_s=60, max_duration_s=3600, max_errors=3)


def world(engine: FakeEngine, candidate: str = "2") -> FakeWorld:
    w = FakeWorld(policy=POLICY, engine=engine)
    w.register("1", alias="champion")
    w.register(candidate, alias="candidate")
    return w


def test_no_weight_before_the_candidate_is_loaded_and_checked() -> None:
    engine = FakeEngine()
    w = world(engine)
    w.tick()  # start: routing at weight 0, the load is requested in the same tick
    assert w.status.phase == "pending" and w.routing.weight == 0.0
    assert ("load", "2") in engine.calls and engine.recorded["2"].state == "ready"
    w.tick()  # the next tick sees it ready and takes the first step
    assert w.status.phase == "progressing" and w.routing.weight == 0.1


def test_a_candidate_that_cannot_load_is_rolled_back_with_the_reason_and_never_gets_traffic() -> None:
    engine = FakeEngine(bad={"2": "the engine refused the adapter (400): corrupt"})
    w = world(engine)
    weights = []
    for _ in range(4):
        w.tick()
        weights.append(w.routing.weight)
    assert w.status.phase == "rolled_back" and set(weights) == {0.0}
    assert "engine: the engine refused the adapter" in w.status.reason
    tags = w.registry.tags["2"]
    assert tags[TAG_OUTCOME] == "rolled_back" and "corrupt" in tags[TAG_REASON]
    (run,) = w.ledger.runs.values()
    assert run.closed and "corrupt" in json.dumps(run.summary)
    assert "2" not in engine.recorded  # the failed record is cleaned up once the canary closed
    assert w.registry.aliases.get("candidate") is None


def test_a_rolled_back_candidate_is_unloaded_and_the_champion_kept() -> None:
    engine = FakeEngine()
    w = world(engine)
    for d in (None, None, "rollback", None):
        w.tick(d)
    assert w.status.phase == "rolled_back"
    assert ("unload", "2") in engine.calls and set(engine.recorded) == {"1"}


def test_promotion_keeps_the_new_champion_loaded_and_unloads_the_old_one_later() -> None:
    engine = FakeEngine()
    w = world(engine)
    for d in (None, None, "continue", "continue", "promote"):
        w.tick(d)
    assert w.status.phase == "succeeded" and w.registry.aliases["champion"] == "2"
    assert "2" in engine.recorded  # not unloaded in the tick that promoted it
    w.tick()
    assert set(engine.recorded) == {"2"} and ("unload", "1") in engine.calls


def test_the_champion_is_reloaded_after_an_engine_restart() -> None:
    engine = FakeEngine()
    w = FakeWorld(policy=POLICY, engine=engine)
    w.register("1", alias="champion")
    w.tick()
    assert engine.recorded["1"].state == "ready"
    engine.restart()
    loads = engine.calls.count(("load", "1"))
    w.tick()
    assert engine.calls.count(("load", "1")) == loads + 1 and engine.loaded == {"m-v1"}


def test_a_manual_promote_loads_the_version_first_and_fails_the_tick_if_it_cannot() -> None:
    engine = FakeEngine(bad={"3": "no adapter"})
    w = FakeWorld(policy=POLICY, engine=engine)
    w.register("1", alias="champion")
    w.register("3")
    with pytest.raises(RuntimeError, match="cannot be served by the engine: no adapter"):
        w.tick(commands=(Command("c1", "promote", "ops", version="3"),))
    assert w.registry.aliases["champion"] == "1"  # nothing moved


def test_without_an_engine_nothing_is_loaded() -> None:
    w = FakeWorld(policy=POLICY)
    w.register("1", alias="champion")
    w.register("2", alias="candidate")
    w.tick()
    w.tick()
    assert w.routing.weight == 0.1


# ------------------------------------------------------------------ the pure check


def test_the_check_compares_every_token_within_the_tolerance() -> None:
    assert check_problem([None, -1.0, -2.0], [None, -1.01, -1.99], 0.05) is None
    problem = check_problem([None, -1.0, -2.0], [None, -1.0, -2.5], 0.05)
    assert problem is not None and "0.5000" in problem
    assert "no finite" in str(check_problem([None, -1.0], [None, None], 0.05))
    assert "no reference" in str(check_problem([None, None], [None, -1.0], 0.05))


def test_vllm_prompt_logprobs_are_read_for_the_prompt_tokens() -> None:
    answer = {"choices": [{"prompt_logprobs": [None, {"7": {"logprob": -1.5, "rank": 1}},
                                               {"9": {"logprob": -0.25}, "4": {"logprob": -0.1}}]}]}
    assert engine_prompt_logprobs([3, 7, 9], answer) == [None, -1.5, -0.25]
    for bad in ({}, {"choices": [{}]}, {"choices": [{"prompt_logprobs": [None]}]}):
        with pytest.raises(EngineCheckError):
            engine_prompt_logprobs([3, 7, 9], bad)


REF = Greedy([4, 5, 6], [-0.5, -1.0, -0.2], [0.8, 0.01, 2.0])


def test_the_greedy_check_compares_tokens_and_logprobs() -> None:
    assert greedy_problem(REF, [4, 5, 6], [-0.51, -0.99, -0.2], 0.05) is None
    worse = greedy_problem(REF, [4, 5, 6], [-0.5, -1.2, -0.2], 0.05)
    assert worse is not None and "0.2000" in worse and "greedy token 2" in worse
    other = greedy_problem(REF, [9, 5, 6], [-0.5, -1.0, -0.2], 0.05)
    assert other is not None and "token 1 is 9" in other, "a different first token is another model"
    # token 2 was a near tie (margin 0.01 <= tolerance): the answers may part there
    assert greedy_problem(REF, [4, 7, 1], [-0.5, -1.0, -3.0], 0.05) is None
    assert greedy_problem(REF, [4, 5, 8], [-0.5, -1.0, -0.2], 0.05) is not None, "token 3 was no tie"
    assert "no finite" in str(greedy_problem(REF, [4, 5, 6], [-0.5, None, -0.2], 0.05))
    assert "no finite" in str(greedy_problem(REF, [4, 5, 6], [-0.5, float("nan"), -0.2], 0.05))
    assert "2 of 3" in str(greedy_problem(REF, [4, 5], [-0.5, -1.0], 0.05))
    assert "no tokens" in str(greedy_problem(REF, [], [], 0.05))


def test_the_check_request_and_answer_follow_the_checks_kind() -> None:
    old = Check([1, 2, 3], [None, -1.0, -2.0], None)
    body = check_request("m", old)
    assert body["prompt_logprobs"] == 0 and body["max_tokens"] == 1
    answer = {"choices": [{"prompt_logprobs": [None, {"2": {"logprob": -1.0}}, {"3": {"logprob": -2.0}}]}]}
    assert served_problem(old, answer, 0.05) is None
    new = Check([1, 2, 3], [None, -1.0, -2.0], REF)
    body = check_request("m", new)
    assert "prompt_logprobs" not in body, "vLLM's CPU engine dies on LoRA prompt_logprobs in a batch"
    assert body["max_tokens"] == 3 and body["temperature"] == 0.0 and body["ignore_eos"] is True
    assert body["return_token_ids"] is True and body["logprobs"] == 0
    good = {"choices": [{"token_ids": [4, 5, 6], "logprobs": {"token_logprobs": [-0.5, -1.0, -0.2]}}]}
    assert served_problem(new, good, 0.05) is None
    for bad in ({}, {"choices": [{"token_ids": [4, 5, 6]}]},
                {"choices": [{"token_ids": [4, 5], "logprobs": {"token_logprobs": [-0.5]}}]},
                {"choices": [{"token_ids": ["x"], "logprobs": {"token_logprobs": [-0.5]}}]}):
        with pytest.raises(EngineCheckError):
            served_problem(new, bad, 0.05)


def test_artifact_layout_helpers(tmp_path: Path) -> None:
    (tmp_path / "adapter").mkdir()
    assert find_adapter(tmp_path) is None
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    assert find_adapter(tmp_path) == tmp_path / "adapter"
    assert not is_base(tmp_path)
    (tmp_path / "policy.json").write_text(json.dumps({"kind": "hf", "engine": "base"}))
    assert is_base(tmp_path)
    with pytest.raises(EngineCheckError, match=r"engine_check\.json"):
        read_check(tmp_path)
    (tmp_path / "engine_check.json").write_text(json.dumps({"prompt_token_ids": [1, 2],
                                                            "prompt_logprobs": [None, -0.5]}))
    assert read_check(tmp_path) == Check([1, 2], [None, -0.5], None)
    write_check(tmp_path, [1, 2], [None, -0.5], Greedy([4, 5], [-0.1, -0.2], [1.0, 0.5]))
    assert read_check(tmp_path) == Check([1, 2], [None, -0.5], Greedy([4, 5], [-0.1, -0.2], [1.0, 0.5]))
    for greedy in ({"token_ids": [], "logprobs": [], "margins": []},
                   {"token_ids": [4, 5], "logprobs": [-0.1], "margins": [1.0, 0.5]}, {"token_ids": [4]}, [4]):
        (tmp_path / "engine_check.json").write_text(json.dumps({"prompt_token_ids": [1, 2],
                                                                "prompt_logprobs": [None, -0.5],
                                                                "greedy": greedy}))
        with pytest.raises(EngineCheckError, match=r"greedy|unreadable"):
            read_check(tmp_path)
    (tmp_path / "engine_check.json").write_text("{not json")
    with pytest.raises(EngineCheckError, match="unreadable"):
        read_check(tmp_path)
    assert engine_model_name("rtrl-policy", "7") == "rtrl-policy-v7"


def test_engine_state_round_trips_and_tolerates_garbage() -> None:
    st = EngineState("failed", "bad adapter")
    assert EngineState.from_text(st.to_text()) == st
    assert EngineState.from_text(None) is None and EngineState.from_text("{") is None


def test_status_shows_what_each_arm_is_served_as() -> None:
    engine = FakeEngine(bad={"3": "mismatch"})
    engine.ensure_loaded("1")
    engine.ensure_loaded("3")
    text = render_engine(engine.describe(), {"stable_version": "1", "canary_version": "3"})
    assert "stable       v1 as m-v1  [ready]" in text
    assert "canary       v3 as not loaded  [failed]" in text and "v3: mismatch" in text
