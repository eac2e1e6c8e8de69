"""Scoring at the sampling temperature: the pure maths against a plain softmax, the temperature
carried from the served event to the reward record, and the mismatch gate at temperature 0.7."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from ingest.events import CompletionServed, ModelRef, RewardRecord, parse_event
from ingest.reward.join import apply, close
from ingest.reward.spec import load_spec
from trainer.gate import GateConfig, HeldoutScore, evaluate
from trainer.mismatch import measure_parent
from trainer.policy import TinyConfig, TinyTransformer, completion_logprobs
from trainer.temperature import scoring_temperature, temperature_column, tempered_log_softmax
from trainer.tokens import BOS

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def reference(logits: np.ndarray, temperature: float) -> np.ndarray:
    """log softmax(logits / T) over the last axis, in float64, written out."""
    z = logits.astype(np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


# ------------------------------------------------------------------ the maths


def test_hand_case() -> None:
    # logits [0, ln 2] at T = 0.5 are [0, ln 4]: probabilities 1/5 and 4/5
    got = tempered_log_softmax(torch.tensor([[0.0, math.log(2.0)]]), torch.tensor([0.5]))
    assert got[0].tolist() == pytest.approx([math.log(0.2), math.log(0.8)], abs=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_matches_a_plain_softmax_per_row(seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 3.0, size=(3, 5, 17)).astype(np.float32)
    temps = [0.7, 1.0, 1.3]
    got = tempered_log_softmax(torch.from_numpy(logits), torch.tensor(temps)).numpy()
    for row, t in enumerate(temps):
        np.testing.assert_allclose(got[row], reference(logits[row], t), atol=1e-5)
    np.testing.assert_allclose(tempered_log_softmax(torch.from_numpy(logits)).numpy(),
                               reference(logits, 1.0), atol=1e-5)


def test_completion_logprobs_read_the_tempered_distribution() -> None:
    rng = np.random.default_rng(7)
    logits = rng.normal(0.0, 3.0, size=(2, 4, 11)).astype(np.float32)
    positions = torch.tensor([[1, 2, 3], [0, 1, 2]])
    targets = torch.tensor([[4, 9, 0], [2, 2, 10]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    got = completion_logprobs(torch.from_numpy(logits), positions, targets, mask, [0.7, 0.7])
    want = [[reference(logits[b, int(positions[b, j])], 0.7)[int(targets[b, j])] * float(mask[b, j])
             for j in range(3)] for b in range(2)]
    np.testing.assert_allclose(got.numpy(), np.array(want), atol=1e-5)


def test_a_greedy_request_is_scored_at_one_as_vllm_logs_it() -> None:
    assert [scoring_temperature(t) for t in (0.0, 1e-6, 1e-5, 0.7, 1.0)] == [1.0, 1.0, 1e-5, 0.7, 1.0]
    assert temperature_column(None) is None and temperature_column([1.0, 0.0]) is None
    column = temperature_column([0.7, 0.0])
    assert column is not None and column.tolist() == pytest.approx([0.7, 1.0])


# ------------------------------------------------------------------ the contract


def served(**kw: object) -> CompletionServed:
    return CompletionServed(
        event_id="e1", request_id="r1", ts=T0, session_id="s1", user_key="u1",
        model=ModelRef(name="m", version="1"), arm="stable", prompt_tokens=[BOS],
        completion_tokens=[3], logprobs=[-0.5], latency_ms=10.0, **kw,  # type: ignore[arg-type]
    )


def test_the_temperature_is_additive_and_travels_to_the_reward_record() -> None:
    old = json.loads(served().model_dump_json(exclude={"temperature"}))
    assert parse_event(json.dumps(old)).temperature == 1.0  # type: ignore[union-attr]
    assert parse_event(json.dumps({**old, "temperature": 0.7})).temperature == 0.7  # type: ignore[union-attr]
    for bad in (-0.1, "0.7", 1000.0):
        with pytest.raises(ValidationError, match="temperature"):
            parse_event(json.dumps({**old, "temperature": bad}))
    spec = load_spec()
    record = close(apply(None, served(temperature=0.7), 0.0, spec), spec, 1e7).record
    assert record is not None and record.temperature == 0.7


# ------------------------------------------------------------------ the gate at 0.7


def sharp_policy() -> TinyTransformer:
    """A small policy with peaked next-token distributions, as a trained model has: there the
    temperature moves the log-probabilities well beyond the gate's bound."""
    torch.manual_seed(0)
    policy = TinyTransformer(TinyConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64))
    with torch.no_grad():
        policy.head.weight.mul_(8.0)
    return policy


def served_at(policy: TinyTransformer, temperature: float, said: float) -> list[RewardRecord]:
    """Records of completions the policy sampled at ``temperature``, whose events say ``said``."""
    out = []
    for i in range(8):
        tokens, logprobs = policy.sample([BOS, 3 + i], 6, temperature=temperature, seed=i)
        out.append(RewardRecord(
            request_id=f"r{i}", served_event_id=f"e{i}", session_id="s", user_key=f"u{i}", served_ts=T0,
            closed_ts=T0, model=ModelRef(name="m", version="1"), arm="stable", prompt_tokens=[BOS, 3 + i],
            completion_tokens=tokens, behavior_logprobs=logprobs, temperature=said, latency_ms=1.0,
            reward=0.0, components={}, reward_spec_version="v"))
    return out


def gate_on(records: list[RewardRecord], policy: TinyTransformer) -> tuple[bool, list[str], float]:
    found = measure_parent(policy, records, "1", truncate=2.0)
    gate = evaluate([HeldoutScore(1.0, [-1.0], [-1.0], [-1.0])] * 30, [0.1], GateConfig(min_kl=0.0), found)
    return gate.passed, gate.reasons, found.mean_abs


def test_the_mismatch_gate_passes_at_0_7_when_both_sides_score_at_0_7() -> None:
    policy = sharp_policy()
    passed, reasons, mean = gate_on(served_at(policy, 0.7, said=0.7), policy)
    assert passed and reasons == [] and mean < 1e-5


def test_the_mismatch_gate_fails_at_0_7_when_the_trainer_scores_at_1() -> None:
    policy = sharp_policy()  # the event does not say 0.7 (e.g. a serving layer that omits it)
    passed, reasons, mean = gate_on(served_at(policy, 0.7, said=1.0), policy)
    assert not passed and mean > GateConfig().max_mismatch
    assert any("train-inference mismatch" in r and "temperature" in r for r in reasons)
