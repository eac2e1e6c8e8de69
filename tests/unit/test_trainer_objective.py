"""The objective against plain loop-based references and hand-computed cases."""

from __future__ import annotations

import math
import random

import pytest
import torch

from trainer.objective import (
    ObjectiveConfig,
    assign_groups,
    effective_sample_size,
    group_advantages,
    grpo_loss,
    importance_weights,
    next_token_loss,
    reward_stats,
    session_advantages,
)

# ----------------------------------------------------------------- references (plain loops)


def ref_advantages(rewards: list[float], groups: list[int], normalize_std: bool) -> list[float]:
    out = []
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        mean = sum(members) / len(members)
        a = r - mean
        if normalize_std:
            std = math.sqrt(sum((m - mean) ** 2 for m in members) / len(members))
            a = a / (std + 1e-6)
        out.append(a)
    return out


def ref_loss(
    logp: list[list[float]], parent: list[list[float]], behavior: list[list[float]],
    lengths: list[int], adv: list[float], cfg: ObjectiveConfig,
) -> tuple[float, float, float]:
    """(loss, kl, clip_fraction) token by token."""
    total_pg = total_kl = 0.0
    clipped_tokens = tokens = 0
    for i, n in enumerate(lengths):
        for t in range(n):
            w = min(math.exp(parent[i][t] - behavior[i][t]), cfg.truncate_is)
            r = math.exp(logp[i][t] - parent[i][t])
            rc = min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
            unclipped, clipped = r * adv[i], rc * adv[i]
            total_pg += -w * min(unclipped, clipped)
            d = logp[i][t] - parent[i][t]
            total_kl += w * (math.exp(d) - 1 - d)
            clipped_tokens += int(clipped < unclipped)
            tokens += 1
    b = len(lengths)
    return total_pg / b + cfg.kl_coef * total_kl / b, total_kl / b, clipped_tokens / tokens


# ----------------------------------------------------------------- groups and advantages


def test_assign_groups_hand_cases() -> None:
    # prompt "a" repeats 5 times: one group of 3, then a trailing group of 2
    assert assign_groups(["a"] * 5, 3) == [0, 0, 0, 1, 1]
    # a single leftover joins the prompt's last group
    assert assign_groups(["a"] * 4, 3) == [0, 0, 0, 0]
    # unique prompts are pooled in window order; a single final leftover joins the previous
    assert assign_groups(["p", "q", "r", "s", "t"], 2) == [0, 0, 1, 1, 1]
    # mixed: same-prompt groups first, then the pool
    assert assign_groups(["x", "a", "y", "a", "z"], 2) == [1, 0, 1, 0, 1]
    assert assign_groups([], 4) == []
    assert assign_groups(["a", "a", "b"], 4) == [0, 0, 0]  # a lone pooled record joins a group
    assert assign_groups(["a"], 4) == [0]
    with pytest.raises(ValueError):
        assign_groups(["a"], 1)


def test_every_group_has_at_least_two_members_when_possible() -> None:
    rng = random.Random(0)
    for _ in range(50):
        keys = [rng.randrange(8) for _ in range(rng.randrange(2, 40))]
        groups = assign_groups(keys, rng.randrange(2, 9))
        sizes = {g: groups.count(g) for g in set(groups)}
        assert min(sizes.values()) >= 2
        for g in set(groups):  # a same-prompt group never mixes prompts unless pooled
            members = {keys[i] for i in range(len(keys)) if groups[i] == g}
            assert len(members) >= 1


def test_group_advantages_hand_case() -> None:
    # group 0: rewards 1, 3 (mean 2); group 1: 0, 0, 6 (mean 2)
    adv = group_advantages([1.0, 3.0, 0.0, 0.0, 6.0], [0, 0, 1, 1, 1])
    assert adv == pytest.approx([-1.0, 1.0, -2.0, -2.0, 4.0])
    # std of group 0 is 1 -> unchanged; group 1 std = sqrt(8)
    adv_n = group_advantages([1.0, 3.0, 0.0, 0.0, 6.0], [0, 0, 1, 1, 1], normalize_std=True)
    assert adv_n[:2] == pytest.approx([-1.0, 1.0], abs=1e-5)
    assert adv_n[4] == pytest.approx(4 / math.sqrt(8), abs=1e-5)
    assert group_advantages([5.0], [0]) == [0.0]


@pytest.mark.parametrize("normalize_std", [False, True])
def test_group_advantages_match_reference(normalize_std: bool) -> None:
    rng = random.Random(1)
    rewards = [rng.uniform(-1, 1) for _ in range(30)]
    groups = assign_groups([rng.randrange(5) for _ in range(30)], 4)
    assert group_advantages(rewards, groups, normalize_std) == pytest.approx(
        ref_advantages(rewards, groups, normalize_std), abs=1e-9
    )


def ref_session_advantages(rewards: list[float], sessions: list[str], size: int) -> list[float]:
    """Sessions by first appearance, cut into runs of ``size`` (a lone last one joins the run
    before it); each session's value the mean of its turns; a turn's reward minus the mean value."""
    order: list[str] = []
    for s in sessions:
        if s not in order:
            order.append(s)
    runs = [order[i:i + size] for i in range(0, len(order), size)]
    if len(runs) > 1 and len(runs[-1]) == 1:
        last = runs.pop()
        runs[-1] += last
    value = {s: sum(r for r, k in zip(rewards, sessions, strict=True) if k == s) / sessions.count(s)
             for s in order}
    base = {s: sum(value[x] for x in run) / len(run) for run in runs for s in run}
    return [r - base[s] for r, s in zip(rewards, sessions, strict=True)]


def test_session_advantages_hand_case() -> None:
    # session a: 3 turns of return 2, the middle one penalised 1 (value 5/3); session b: one
    # turn of -1; one group: baseline (5/3 - 1) / 2 = 1/3, each session once, not per turn.
    adv = session_advantages([2.0, 1.0, 2.0, -1.0], ["a", "a", "a", "b"], 8)
    assert adv == pytest.approx([5 / 3, 2 / 3, 5 / 3, -4 / 3])
    # turns of one session alone keep only their own deviation from the session's value
    assert session_advantages([2.0, 1.0, 2.0], ["a"] * 3, 8) == pytest.approx([1 / 3, -2 / 3, 1 / 3])


def test_session_advantages_group_sessions_not_turns() -> None:
    """Window order holds a session's turns together: grouped per turn, the outcome would
    cancel; grouped per session, a completed session's turns gain and an abandoned one's lose."""
    rewards = [1.5] * 6 + [-0.6] * 2
    sessions = ["won"] * 6 + ["lost"] * 2
    per_turn = group_advantages(rewards, assign_groups([(i,) for i in range(8)], 2))
    assert per_turn == pytest.approx([0.0] * 8)
    per_session = session_advantages(rewards, sessions, 2)
    assert per_session == pytest.approx([1.05] * 6 + [-1.05] * 2)


def test_session_advantages_match_reference() -> None:
    rng = random.Random(7)
    for _ in range(20):
        n = rng.randrange(1, 60)
        sessions = [f"s{rng.randrange(12)}" for _ in range(n)]
        rewards = [rng.uniform(-2, 2) for _ in range(n)]
        size = rng.randrange(2, 6)
        assert session_advantages(rewards, sessions, size) == pytest.approx(
            ref_session_advantages(rewards, sessions, size), abs=1e-9)
    normed = session_advantages([1.0, 3.0, 3.0], ["a", "b", "b"], 4, normalize_std=True)
    assert normed == pytest.approx([-1.0, 1.0, 1.0], abs=1e-5)  # values 1, 3: std 1
    with pytest.raises(ValueError):
        session_advantages([1.0], ["a", "b"], 4)
    with pytest.raises(ValueError):
        session_advantages([1.0], ["a"], 1)


# ----------------------------------------------------------------- the loss


def test_loss_hand_case_on_policy() -> None:
    # on-policy (pi = pi_0 = mu): w = 1, r = 1, loss = -sum_t A / B ; kl = 0
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    loss, stats = grpo_loss(logp, logp.detach(), logp.detach(), mask, adv, ObjectiveConfig(kl_coef=0.5))
    # sequence 0: two tokens * A=1 -> -2 ; sequence 1: one token * A=-2 -> +2 ; mean over 2 -> 0
    assert float(loss.detach()) == pytest.approx(0.0)
    assert stats["kl"] == 0.0 and stats["clip_fraction"] == 0.0 and stats["ess"] == pytest.approx(1.0)
    loss.backward()
    # d loss / d logp = (-w * A * r + kl_coef * w * (r - 1)) / B on real tokens (the KL term's
    # gradient is zero at the parent); no length normalisation
    assert logp.grad is not None
    assert logp.grad.flatten().tolist() == pytest.approx([-0.5, -0.5, 1.0, 0.0])


def test_loss_hand_case_clip_and_truncation() -> None:
    cfg = ObjectiveConfig(clip_low=0.2, clip_high=0.2, truncate_is=1.5, kl_coef=0.0)
    # one token: pi/pi_0 = e^0.5 = 1.65 > 1.2 with A = 1 -> clipped to 1.2
    #            pi_0/mu = e^1 = 2.72 -> truncated to 1.5
    logp = torch.tensor([[-0.5]], requires_grad=True)
    parent = torch.tensor([[-1.0]])
    behavior = torch.tensor([[-2.0]])
    loss, stats = grpo_loss(logp, parent, behavior, torch.ones(1, 1), torch.tensor([1.0]), cfg)
    assert float(loss.detach()) == pytest.approx(-1.5 * 1.2)
    assert stats["clip_fraction"] == 1.0
    assert stats["truncated_fraction"] == 1.0
    loss.backward()
    assert logp.grad is not None and float(logp.grad) == 0.0  # clipped: no gradient
    # negative advantage: the unclipped (larger) ratio is the minimum -> no clip, gradient flows
    logp2 = torch.tensor([[-0.5]], requires_grad=True)
    loss2, stats2 = grpo_loss(logp2, parent, behavior, torch.ones(1, 1), torch.tensor([-1.0]), cfg)
    assert float(loss2) == pytest.approx(1.5 * math.exp(0.5))
    assert stats2["clip_fraction"] == 0.0


def test_loss_matches_reference_on_random_batches() -> None:
    rng = random.Random(2)
    torch.manual_seed(2)
    cfg = ObjectiveConfig(clip_low=0.2, clip_high=0.28, truncate_is=2.0, kl_coef=0.1)
    for _ in range(20):
        b, t = rng.randrange(1, 6), rng.randrange(1, 7)
        lengths = [rng.randrange(1, t + 1) for _ in range(b)]
        behavior = -torch.rand(b, t) * 3
        parent = behavior + torch.randn(b, t) * 0.5
        logp = parent + torch.randn(b, t) * 0.3
        mask = torch.zeros(b, t)
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        adv = torch.randn(b)
        loss, stats = grpo_loss(logp, parent, behavior, mask, adv, cfg)
        ref, ref_kl, ref_clip = ref_loss(
            logp.tolist(), parent.tolist(), behavior.tolist(), lengths, adv.tolist(), cfg
        )
        assert float(loss) == pytest.approx(ref, rel=1e-4, abs=1e-5)
        assert stats["kl"] == pytest.approx(ref_kl, rel=1e-4, abs=1e-5)
        assert stats["clip_fraction"] == pytest.approx(ref_clip)


def test_kl_term_pulls_the_policy_back_to_the_parent() -> None:
    """Gradient descent on the KL term alone, with tokens drawn from the parent, must reduce
    the exact KL(parent || policy) of a categorical policy that has drifted away."""
    torch.manual_seed(0)
    parent_logits = torch.tensor([2.0, 0.5, 0.0, -1.0])
    logits = torch.tensor([0.0, 1.5, 0.5, 1.0], requires_grad=True)
    parent_logp = torch.log_softmax(parent_logits, 0)

    def exact_kl() -> float:
        logp = torch.log_softmax(logits.detach(), 0)
        return float((parent_logp.exp() * (parent_logp - logp)).sum())

    start = exact_kl()
    opt = torch.optim.SGD([logits], lr=0.5)
    cfg = ObjectiveConfig(kl_coef=1.0)
    for _ in range(50):
        tokens = torch.multinomial(parent_logp.exp(), 256, replacement=True)
        logp = torch.log_softmax(logits, 0)[tokens][:, None]
        loss, stats = grpo_loss(logp, parent_logp[tokens][:, None], parent_logp[tokens][:, None],
                                torch.ones(256, 1), torch.zeros(256), cfg)
        assert stats["kl"] >= 0.0  # k3 is non-negative token by token
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert start > 0.5
    assert exact_kl() < 0.1 * start


def test_padding_does_not_change_the_loss() -> None:
    cfg = ObjectiveConfig()
    logp = torch.tensor([[-1.0, -0.3]])
    parent, behavior = torch.tensor([[-1.2, -0.4]]), torch.tensor([[-1.1, -0.5]])
    adv = torch.tensor([0.7])
    a, _ = grpo_loss(logp, parent, behavior, torch.ones(1, 2), adv, cfg)
    pad = torch.tensor([[-9.0]])
    b, _ = grpo_loss(torch.cat([logp, pad], 1), torch.cat([parent, pad], 1),
                     torch.cat([behavior, pad + 5], 1), torch.tensor([[1.0, 1.0, 0.0]]), adv, cfg)
    assert float(a) == pytest.approx(float(b))


# ----------------------------------------------------------------- weights and statistics


def test_importance_weights_and_ess_hand_cases() -> None:
    w = importance_weights(torch.tensor([0.0, 0.0]), torch.tensor([0.0, -5.0]), truncate=2.0)
    assert w.tolist() == pytest.approx([1.0, 2.0])
    # weights 1, 2: (3)^2 / (2 * 5) = 0.9
    assert effective_sample_size(w) == pytest.approx(0.9)
    assert effective_sample_size(torch.ones(7)) == pytest.approx(1.0)
    # one dominant weight -> 1/n
    assert effective_sample_size(torch.tensor([1.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)
    assert effective_sample_size(torch.tensor([5.0, 1.0]), torch.tensor([1.0, 0.0])) == 1.0
    assert effective_sample_size(torch.tensor([])) == 0.0


def test_reward_stats_per_arm() -> None:
    s = reward_stats([1.0, 3.0, 0.0, -2.0], ["stable", "stable", "canary", "canary"])
    assert s["reward_mean"] == pytest.approx(0.5)
    assert s["reward_mean_stable"] == 2.0 and s["reward_std_stable"] == 1.0
    assert s["reward_mean_canary"] == -1.0 and s["reward_std_canary"] == 1.0
    assert s["reward_n_canary"] == 2.0
    assert reward_stats([], [])["reward_n"] == 0.0


def test_next_token_loss_is_mean_nll_over_real_tokens() -> None:
    logp = torch.tensor([[-1.0, -3.0], [-2.0, -7.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert float(next_token_loss(logp, mask)) == pytest.approx(2.0)
