"""The RL objective of an increment, as small pure functions.

Recipe (in the spirit of Composer 2 / Dr. GRPO):

- **Advantages** are group-relative: a record's reward minus the mean reward of its group.
  Groups have a fixed size; records that share a prompt are grouped together first, the
  rest are pooled in window order. Dividing by the group's standard deviation is optional
  and off by default.
- **No length normalisation**: a completion's loss is the *sum* over its tokens; the batch
  loss is the mean over completions (a constant divisor, not the token count).
- **Off-policy correction** (decoupled PPO): the logged data come from the behavior policy
  ``mu`` that served them, the increment starts from the parent checkpoint ``pi_0``.
  Each token gets a truncated importance weight ``w = min(pi_0 / mu, truncate)`` (no
  gradient) and a PPO-clipped ratio ``r = pi / pi_0`` in ``[1 - clip_low, 1 + clip_high]``::

      pg_t = - w_t * min(r_t * A, clip(r_t) * A)

- **KL** to the parent, KL(pi_0 || pi), with the k3 estimator ``r - 1 - log r`` per token
  (``r = pi / pi_0``; non-negative, unbiased on tokens drawn from ``pi_0``), weighted by
  ``w`` and summed over the completion, added as ``kl_coef * KL``. Its gradient
  ``w (r - 1) grad log pi`` is zero at the parent and pulls the policy back towards it.
  (The plain k1 form ``log pi - log pi_0`` on the parent's tokens estimates *minus* that KL,
  so penalising it would push the policy away from the parent.) The gate measures the same
  quantity on held-out records (trainer/gate.py).

Staleness statistics (clip fraction, effective sample size of ``w``, ratio statistics)
come out of :func:`grpo_loss` with the loss, so every increment records them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# --------------------------------------------------------------------- advantages


def assign_groups(prompt_keys: Sequence[Hashable], group_size: int) -> list[int]:
    """Group ids for records in window order.

    Records sharing a prompt key form groups of ``group_size`` (a trailing part of at least
    two stays a group; a single leftover joins that prompt's last group). Records whose prompt
    appears once, and single leftovers of prompts with no full group, are pooled in window
    order into groups of ``group_size``; a single final leftover joins the previous group.
    """
    if group_size < 2:
        raise ValueError("group_size must be >= 2")
    repeated, pool = _split_by_prompt(prompt_keys)
    same_prompt = [chunk for members in repeated for chunk in _chunks(members, group_size)]
    pooled = _chunks(sorted(pool), group_size)
    if same_prompt and len(pooled) == 1 and len(pooled[0]) == 1:
        same_prompt[-1].extend(pooled.pop())  # a lone record joins the last group
    return _label(same_prompt + pooled, len(prompt_keys))


def _split_by_prompt(prompt_keys: Sequence[Hashable]) -> tuple[list[list[int]], list[int]]:
    """Indices of each prompt seen at least twice (in order of first appearance), and the
    indices of prompts seen once."""
    by_prompt: dict[Hashable, list[int]] = defaultdict(list)
    for i, key in enumerate(prompt_keys):
        by_prompt[key].append(i)
    repeated = [members for members in by_prompt.values() if len(members) >= 2]
    pool = [members[0] for members in by_prompt.values() if len(members) < 2]
    return repeated, pool


def _chunks(members: list[int], size: int) -> list[list[int]]:
    """``members`` cut into runs of ``size``; a single trailing member joins the run before it."""
    chunks = [members[i : i + size] for i in range(0, len(members), size)]
    if len(chunks) > 1 and len(chunks[-1]) == 1:
        chunks[-2].extend(chunks.pop())
    return chunks


def _label(groups: list[list[int]], n: int) -> list[int]:
    """Per-index group ids: the position of the group each index belongs to."""
    ids = [-1] * n
    for group_id, members in enumerate(groups):
        for i in members:
            ids[i] = group_id
    return ids


def group_advantages(
    rewards: Sequence[float], groups: Sequence[int], normalize_std: bool = False, eps: float = 1e-6
) -> list[float]:
    """``r_i - mean(group)``; with ``normalize_std`` divided by ``std(group) + eps``
    (population standard deviation). A group of one has advantage 0."""
    if len(rewards) != len(groups):
        raise ValueError("one group id per reward")
    r = torch.tensor(rewards, dtype=torch.float64)
    g = torch.tensor(groups, dtype=torch.long)
    n_groups = int(g.max()) + 1 if len(groups) else 0
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, torch.ones_like(r))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, r) / count
    adv = r - mean[g]
    if normalize_std:
        var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, adv**2) / count
        adv = adv / (var.sqrt()[g] + eps)
    return [float(a) for a in adv]


def session_advantages(rewards: Sequence[float], sessions: Sequence[Hashable], group_size: int,
                       normalize_std: bool = False, eps: float = 1e-6) -> list[float]:
    """Advantages of session turns against *other sessions* (trajectory-level groups).

    A session's turns share its return, so a group of one session's turns (as window order
    makes them: a session's records arrive together when it closes) compares each turn with
    its own return and learns nothing of the outcome. Here the unit of a group is the session:
    sessions (``sessions[i]`` is turn i's, in order of first appearance) are chunked into
    groups of ``group_size`` sessions (a single leftover session joins the previous group); a
    session's value is the mean reward of its turns, and a turn's advantage is its reward
    minus the mean value of its group's sessions, each session counted once however many turns
    it took. A turn's own deviation (its invalid tool calls) stays in its advantage. With
    ``normalize_std``, divided by the population std of the group's session values + ``eps``.
    """
    if len(rewards) != len(sessions):
        raise ValueError("one session key per reward")
    if group_size < 2:
        raise ValueError("group_size must be >= 2")
    turns: dict[Hashable, list[int]] = defaultdict(list)
    for i, key in enumerate(sessions):
        turns[key].append(i)
    members = list(turns.values())
    out = [0.0] * len(rewards)
    for chunk in _chunks(list(range(len(members))), group_size):
        values = [math.fsum(rewards[i] for i in members[k]) / len(members[k]) for k in chunk]
        base = math.fsum(values) / len(values)
        spread = math.sqrt(math.fsum((v - base) ** 2 for v in values) / len(values))
        scale = spread + eps if normalize_std else 1.0
        for k in chunk:
            for i in members[k]:
                out[i] = (rewards[i] - base) / scale
    return out


def advantages(rewards: Sequence[float], prompt_keys: Sequence[Hashable], sessions: Sequence[Hashable | None],
               group_size: int, normalize_std: bool = False) -> list[float]:
    """An increment's advantages: records of a session (``sessions[i]`` not None) against
    other sessions (:func:`session_advantages`), the others in same-prompt groups first
    (:func:`assign_groups`, :func:`group_advantages`)."""
    out = [0.0] * len(rewards)
    turns = [i for i, s in enumerate(sessions) if s is not None]
    rest = [i for i, s in enumerate(sessions) if s is None]
    if turns:
        part = session_advantages([rewards[i] for i in turns], [sessions[i] for i in turns], group_size,
                                  normalize_std)
        for i, a in zip(turns, part, strict=True):
            out[i] = a
    if rest:
        groups = assign_groups([prompt_keys[i] for i in rest], group_size)
        part = group_advantages([rewards[i] for i in rest], groups, normalize_std)
        for i, a in zip(rest, part, strict=True):
            out[i] = a
    return out


# --------------------------------------------------------------------- the loss


@dataclass(frozen=True)
class ObjectiveConfig:
    clip_low: float = 0.2
    """Lower PPO clip: r = pi / pi_0 below 1 - clip_low gives no further gradient."""
    clip_high: float = 0.28
    """Upper PPO clip (asymmetric, "clip-higher", so rare good tokens can still rise)."""
    truncate_is: float = 2.0
    """Truncation of the importance weight pi_0 / mu (behavior -> parent)."""
    kl_coef: float = 0.02
    """Weight of the k3 KL term to the parent (:func:`k3_tokens`)."""


def importance_weights(parent_logp: Tensor, behavior_logp: Tensor, truncate: float) -> Tensor:
    """Truncated per-token weights ``min(exp(parent - behavior), truncate)``, without gradient."""
    return torch.exp(parent_logp - behavior_logp).clamp(max=truncate).detach()


def k3_tokens(log_ratio: Tensor, weights: Tensor, mask: Tensor) -> Tensor:
    """Per-token terms of the weighted k3 estimate of KL(parent || policy),
    ``w ((pi/pi_0 - 1) - log(pi/pi_0))`` on real tokens; ``log_ratio`` is ``log pi - log pi_0``."""
    return weights * (torch.expm1(log_ratio) - log_ratio) * mask


def padded(rows: Sequence[Sequence[float]], like: Tensor) -> Tensor:
    """Per-token values (e.g. behaviour log-probabilities) as a zero-padded tensor shaped like
    ``like`` [B, T]."""
    out = torch.zeros_like(like)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out


def effective_sample_size(weights: Tensor, mask: Tensor | None = None) -> float:
    """Kish's effective sample size as a share of the sample: ``(sum w)^2 / (n * sum w^2)``,
    in (0, 1]; 1 when every weight is equal. 0 for an empty sample."""
    w = weights if mask is None else weights[mask > 0]
    if w.numel() == 0:
        return 0.0
    s2 = float((w.double() ** 2).sum())
    if s2 == 0.0:
        return 0.0
    return float(w.double().sum()) ** 2 / (w.numel() * s2)


def grpo_loss(
    logp: Tensor,
    parent_logp: Tensor,
    behavior_logp: Tensor,
    mask: Tensor,
    advantages: Tensor,
    cfg: ObjectiveConfig,
) -> tuple[Tensor, dict[str, float]]:
    """The increment's loss for one batch and its statistics.

    ``logp`` (with gradient), ``parent_logp`` and ``behavior_logp`` are per-token
    log-probabilities [B, T] of the logged completion tokens under the policy being trained,
    the parent checkpoint and the behavior policy; ``mask`` [B, T] is 1 on real tokens;
    ``advantages`` is [B]. Returns ``(loss, stats)``; the loss is the mean over completions of
    their summed token terms.
    """
    mask = mask.to(logp.dtype)
    parent_logp = parent_logp.detach()
    behavior_logp = behavior_logp.detach()
    n_seq = max(1, logp.shape[0])
    adv = advantages.to(logp.dtype)[:, None]
    w = importance_weights(parent_logp, behavior_logp, cfg.truncate_is)
    log_ratio = logp - parent_logp
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    pg = -(w * surrogate * mask).sum() / n_seq
    kl_tokens = k3_tokens(log_ratio, w, mask)
    kl = kl_tokens.sum() / n_seq
    loss = pg + cfg.kl_coef * kl

    with torch.no_grad():
        n_tok = float(mask.sum())
        real = mask > 0
        clip_active = ((ratio * adv) != (clipped * adv)) & (surrogate == clipped * adv) & real
        raw_w = torch.exp(parent_logp - behavior_logp)
        stats = {
            "loss": float(loss),
            "pg_loss": float(pg),
            "kl": float(kl),
            "kl_per_token": float(kl_tokens.sum()) / n_tok if n_tok else 0.0,
            "clip_fraction": float(clip_active.sum()) / n_tok if n_tok else 0.0,
            "ess": effective_sample_size(w, mask),
            "truncated_fraction": float(((raw_w > cfg.truncate_is) & real).sum()) / n_tok if n_tok else 0.0,
            "ratio_mean": _masked_mean(ratio, real),
            "ratio_max": float(ratio[real].max()) if n_tok else 1.0,
            "ratio_min": float(ratio[real].min()) if n_tok else 1.0,
            "behavior_ratio_mean": _masked_mean(raw_w, real),
            "behavior_ratio_max": float(raw_w[real].max()) if n_tok else 1.0,
            "tokens": n_tok,
        }
    return loss, stats


def _masked_mean(x: Tensor, real: Tensor) -> float:
    n = int(real.sum())
    return float(x[real].double().sum()) / n if n else 0.0


# --------------------------------------------------------------------- supervised (bootstrap)


def next_token_loss(logp: Tensor, mask: Tensor) -> Tensor:
    """Negative log-likelihood per token, averaged over real tokens (bootstrap training)."""
    return -(logp * mask).sum() / mask.sum().clamp(min=1.0)


# --------------------------------------------------------------------- reward statistics


def reward_stats(rewards: Sequence[float], arms: Sequence[str]) -> dict[str, float]:
    """Mean, standard deviation (population) and count of rewards, overall and per arm:
    keys ``reward_mean``, ``reward_std``, ``reward_n`` and ``reward_mean_<arm>`` etc."""
    out: dict[str, float] = {}
    by_arm: dict[str, list[float]] = defaultdict(list)
    for r, a in zip(rewards, arms, strict=True):
        by_arm[a].append(r)
    for suffix, values in [("", list(rewards))] + [(f"_{a}", v) for a, v in sorted(by_arm.items())]:
        n = len(values)
        mean = math.fsum(values) / n if n else 0.0
        var = math.fsum((v - mean) ** 2 for v in values) / n if n else 0.0
        out[f"reward_mean{suffix}"] = mean
        out[f"reward_std{suffix}"] = math.sqrt(var)
        out[f"reward_n{suffix}"] = float(n)
    return out


@dataclass(frozen=True)
class Sample:
    """One logged completion with its advantage (computed over the whole window)."""

    prompt: list[int]
    completion: list[int]
    behavior_logprobs: list[float]
    advantage: float
    temperature: float = 1.0
    """The sampling temperature of ``behavior_logprobs``: the KL band's probe scores at it, as
    the gate does; the loss scores at 1 (docs/trainer.md)."""
