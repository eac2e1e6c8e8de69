"""``rtrl demo --engine vllm`` as a user runs it: the demo builds a tiny Llama, serves it with
vLLM's CPU build behind the gateway's OpenAI API, its users speak chat, and its increments
are LoRA adapters the deployer loads into the engine before their canaries.

The bounded run (CI, about 10-16 minutes on 2 cores: a 10-minute loop after the setup)
injects a corrupted adapter, which the engine must refuse before it serves anyone, and waits
for one increment to go through the engine's canary. The soak (``scripts/test -m soak``) runs
the loop until it has promoted an increment by itself and rolled back the reward-hacked
candidate, as docs/demo.md records.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from services.demo.chat_model import CACHE_DONE
from services.stack.embedded import EmbeddedStack
from services.stack.supervisor import stop_recorded
from tests.e2e.demo_helpers import NO_HOLDOUT_MEASURE, demo_env, leftovers, run_demo, story

ENGINE_REFUSED = "engine: the engine refused the adapter"


def summary_of(reports: Path, out: str) -> dict[str, Any]:
    files = list(reports.glob("*/summary.json"))
    assert len(files) == 1, out[-4000:]
    summary: dict[str, Any] = json.loads(files[0].read_text())
    return summary


def increments(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The trainer's increments the deployer decided (not the injected candidate)."""
    return [d for d in summary["decisions"] if d["candidate"] != summary["bad_version"]
            and d["decided_by"] == "controller"]


def lora_versions(data: Path) -> dict[str, str]:
    """Version -> its policy kind tag, from the demo's registry."""
    from mlflow import MlflowClient

    stack = EmbeddedStack(data_dir=data / "stack")
    stack.load()
    client = MlflowClient(tracking_uri=stack.mlflow_uri)
    return {v.version: v.tags.get("rtrl.policy.kind", "")
            for v in client.search_model_versions("name='rtrl-policy'")}


def run(tmp_path: Path, args: list[str], demo: dict[str, str],
        timeout_s: float) -> tuple[Path, dict[str, Any], str]:
    data, reports = tmp_path / "demo", tmp_path / "reports"
    try:
        cache = tmp_path / "model-cache"  # a fresh user's first run: the model is built, then cached
        proc, out = run_demo(["--engine", "vllm", *args], data, reports,
                             demo_env({"RTRL_DEMO__MODEL_CACHE_DIR": str(cache), **demo}), timeout_s)
        assert proc.returncode == 0, out[-4000:]
        assert not leftovers(data), "a process (the engine included) outlived the demo"
        summary = summary_of(reports, out)
        kinds = lora_versions(data)
    finally:
        EmbeddedStack(data_dir=data / "stack").down()
        stop_recorded(data / "pids.json")
    assert "vLLM serves the base model" in out, out[-4000:]
    assert len(list(cache.glob(f"*/{CACHE_DONE}"))) == 1, "the built model was not cached"
    assert set(kinds.values()) == {"hf-lora"}, f"every version is a LoRA adapter: {kinds}"
    return data, summary, out


@pytest.mark.timeout(1800)
def test_the_vllm_demo_loads_increments_into_the_engine_through_the_canary(tmp_path: Path) -> None:
    # the loop's own minutes: on a busy CI machine the model build and the engine's start took
    # 9 of a 16-minute whole-run budget, and the increment (length guard included) the rest
    minutes = os.environ.get("RTRL_E2E_VLLM_MINUTES", "10")
    args = ["--loop-minutes", minutes, "--increments", "1", "--bad-candidate", "corrupted"]
    # any decision will do (an inconclusive abort too): the canary gets 120 s, not the demo's
    # 600, and a canary no worse than the champion may promote (the demo waits for a better one)
    demo = {"RTRL_DEMO__TRAINER_CADENCE_S": "45", "RTRL_DEMO__CANARY_MAX_S": "120",
            "RTRL_DEMO__REQUIRE_IMPROVEMENT": "false",
            "RTRL_DEMO__PROGRESS_EVERY_S": "10", **NO_HOLDOUT_MEASURE}
    data, summary, out = run(tmp_path, args, demo, timeout_s=1740)
    bad = summary["bad_version"]
    [refused] = [d for d in summary["decisions"] if d["candidate"] == bad]
    assert refused["outcome"] == "rolled_back" and refused["reason"].startswith(ENGINE_REFUSED), refused
    assert bad not in summary["cohorts"], "the corrupted adapter served someone"
    decided = increments(summary)
    assert decided, \
        f"no increment went through the engine's canary: {summary['decisions']}\n{story(data)}\n{out[-1500:]}"
    first = decided[0]
    assert not first["reason"].startswith("engine:"), f"the engine could not serve the increment: {first}"
    assert summary["cohorts"].get(first["candidate"], {}).get("n", 0) > 0, "the increment served nobody"


@pytest.mark.soak
@pytest.mark.timeout(3000)
def test_the_vllm_demo_promotes_an_increment_and_rolls_back_the_reward_hack(tmp_path: Path) -> None:
    minutes = os.environ.get("RTRL_E2E_VLLM_MINUTES", "40")
    data, summary, out = run(tmp_path, ["--minutes", minutes, "--until-promoted", "--increments", "1"],
                          {"RTRL_DEMO__PROGRESS_EVERY_S": "10"}, timeout_s=2900)
    bad = summary["bad_version"]
    assert any(d["candidate"] == bad and d["outcome"] == "rolled_back" and d["decided_by"] == "controller"
               for d in summary["decisions"]), summary["decisions"]
    promoted = [d for d in increments(summary) if d["outcome"] == "promoted"]
    assert promoted, \
        f"no increment promoted by the controller: {summary['decisions']}\n{story(data)}\n{out[-1500:]}"


@pytest.mark.soak
@pytest.mark.timeout(1800)
def test_the_vllm_agent_demo_rolls_back_the_malformed_tool_and_the_stalling_candidates(
        tmp_path: Path) -> None:
    """``rtrl demo --agent --engine vllm``: agent sessions over chat on the real engine. Both
    bad LoRA candidates are rolled back by the controller's judge, an increment is promoted by
    it, and their sessions are in the report beside the champion's."""
    minutes = os.environ.get("RTRL_E2E_VLLM_MINUTES", "20")
    args = ["--agent", "--minutes", minutes, "--until-promoted", "--increments", "1"]
    data, summary, out = run(tmp_path, args, {"RTRL_DEMO__PROGRESS_EVERY_S": "10"}, timeout_s=1700)
    assert summary["kinds"].get(summary["bad_versions"][0]) == "malformed-tool", summary["kinds"]
    assert summary["kinds"].get(summary["bad_versions"][1]) == "stalling", summary["kinds"]
    for bad in summary["bad_versions"]:
        [d] = [d for d in summary["decisions"] if d["candidate"] == bad]
        assert d["outcome"] == "rolled_back" and d["decided_by"] == "controller", d
        assert d["reason"].startswith("judge: canary worse"), d["reason"]
    by_version = {(row["version"], row["arm"]) for row in summary["sessions"]["by_version_arm"]}
    assert {(summary["bad_versions"][0], "canary"), ("1", "stable")} <= by_version, by_version
    promoted = [d["candidate"] for d in summary["decisions"] if d["candidate"] not in summary["bad_versions"]
                and d["decided_by"] == "controller" and d["outcome"] == "promoted"]
    assert promoted, \
        f"no increment promoted by the controller: {summary['decisions']}\n{story(data)}\n{out[-1500:]}"
    assert (promoted[0], "canary") in by_version, by_version
