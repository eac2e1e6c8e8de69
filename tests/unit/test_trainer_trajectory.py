"""An agent session's trajectory through the objective, computed by hand (docs/trainer.md,
"Agent sessions"): each served turn is one sample whose prompt is everything the model read
(the user's text, earlier turns, tool results, a summary in place of the turns it replaced) and
whose completion is only what the model produced in that turn; the loss and its gradient reach
the completion tokens and nothing else, and the session credit is each turn's reward."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import torch

from ingest.events import SessionEnd, SessionTurn, ToolCall
from ingest.reward.session_credit import TurnFacts, credit
from ingest.reward.sessions import assemble
from ingest.reward.spec import SessionSpec
from trainer.objective import ObjectiveConfig, grpo_loss, session_advantages
from trainer.policy import completion_logprobs, pad_batch

USER, TOOL, SUMMARY = [10, 11, 12], [40, 41], [50]
"""Token ids the model did not produce: the user's request, a tool result, a summary marker."""
TURNS = [[20, 21, 22], [30, 31], [60, 61, 62, 63]]
"""What the model produced: turn 0 calls a tool, turn 1 calls it again, turn 2 is a
self-summary of turns 0-1 followed by the final answer."""


def trajectory() -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) per turn, as the gateway logs them."""
    t0 = (USER, TURNS[0])
    t1 = (USER + TURNS[0] + TOOL, TURNS[1])
    t2 = (USER + SUMMARY + TOOL, TURNS[2])  # turns 0-1 replaced by the summary in the context
    return [t0, t1, t2]


def test_each_turn_is_credited_and_trained_on_its_own_tokens_only() -> None:
    spec = SessionSpec()
    t = datetime(2026, 11, 22, tzinfo=UTC)
    evs: list = [SessionTurn(event_id=f"t{i}", request_id=f"r{i}", ts=t, session_id="s", turn=i)
                 for i in range(3)]
    evs.append(ToolCall(event_id="c1", request_id="r1", ts=t, session_id="s", turn=1, call_id="c1",
                        tool="run", arguments_valid=False, invalid_reason="not_json", outcome="blocked"))
    evs.append(SessionEnd(event_id="e", request_id="r2", ts=t, session_id="s", turn=2, outcome="completed"))
    rows = trajectory()
    facts = {f"r{i}": TurnFacts(len(p), len(c)) for i, (p, c) in enumerate(rows)}
    credits = [c.reward for c in credit(assemble("s", evs, t), facts, spec)]
    tokens = sum(len(p) + len(c) for p, c in rows)  # 3+3 + 8+2 + 6+4 = 26
    ret = 1.0 - 0.02 * 3 - 0.002 * tokens / 1000
    assert credits == pytest.approx([ret, ret - 0.25, ret])

    # the session's turns are grouped by session (trainer.objective.session_advantages); alone
    # in its group, each credit minus the session's value (the mean of its turns), so the turn
    # with the broken call is pushed down and the others up
    adv = session_advantages(credits, ["s"] * 3, group_size=8)
    assert adv == pytest.approx([0.25 / 3, -0.5 / 3, 0.25 / 3])
    # beside a one-turn session credited `ret - 1`, each turn of this one rises by half the
    # difference of the two sessions' values (ret - 0.25/3 and ret - 1), the other falls by it
    half = (1.0 - 0.25 / 3) / 2
    beside = session_advantages([*credits, ret - 1.0], ["s"] * 3 + ["other"], group_size=8)
    assert beside == pytest.approx([a + half for a in adv] + [-half])

    prompts, completions = [p for p, _ in rows], [c for _, c in rows]
    ids, _, positions, targets, tmask = pad_batch(prompts, completions)
    logits = torch.zeros(ids.shape[0], ids.shape[1], 70, requires_grad=True)  # uniform policy
    logp = completion_logprobs(logits, positions, targets, tmask)
    assert tmask.sum(1).tolist() == [3, 2, 4]  # exactly the tokens the model produced
    # on-policy, at the parent: ratio 1, weight 1, no KL: loss = -sum_i A_i * T_i / B
    loss, stats = grpo_loss(logp, logp.detach(), logp.detach(), tmask, torch.tensor(adv),
                            ObjectiveConfig())
    expect = -sum(a * len(c) for a, c in zip(adv, completions, strict=True)) / 3
    assert float(loss.detach()) == pytest.approx(expect) and stats["tokens"] == 9
    loss.backward()
    assert logits.grad is not None
    for i, (p, c) in enumerate(rows):
        grad_rows = logits.grad[i].abs().sum(-1)
        trained = {len(p) - 1 + j for j in range(len(c))}  # the positions predicting its completion
        for pos in range(ids.shape[1]):
            assert (grad_rows[pos] > 0) == (pos in trained), (i, pos)
        # the gradient of each produced token's log-probability is -A_i / B
        for j, tok in enumerate(c):
            g = logits.grad[i, len(p) - 1 + j, tok]
            assert float(g) == pytest.approx(-adv[i] / 3 * (1 - 1 / 70), rel=1e-5)
