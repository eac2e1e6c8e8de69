"""The simulated user model: hand-computed cases, monotonicity, determinism, and the
reward-hacking opportunity measured with the real reward maths."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from statistics import mean
from typing import cast

import pytest

from ingest.reward.maths import Feedback, compute_reward
from ingest.reward.spec import RewardSpec, load_spec
from services.sim.users import (
    SimUser,
    Task,
    UserType,
    World,
    WorldConfig,
    accept_probability,
    draw_task,
    ideal_completion,
    make_population,
    make_prompt,
    make_world,
    match_fraction,
    mediocre_completion,
    patience_factor,
    question_completion,
    react,
    retained_chars,
    survival_probabilities,
)
from trainer.tokens import ASK, BOS, EOS, FIRST_CONTENT, VOCAB_SIZE, CompletionKind, completion_kind

HORIZONS = (30, 600, 3600)
MakeCompletion = Callable[[Task, SimUser, World, random.Random], list[int]]


def test_match_fraction_hand_cases() -> None:
    assert match_fraction([], {5}) == 0.0
    assert match_fraction([5, 6, 5, 7], {5}) == 0.5
    assert match_fraction([5, 6], {5, 6}) == 1.0


def test_patience_factor_hand_cases() -> None:
    assert patience_factor(100, 200, 100) == 1.0
    assert patience_factor(200, 200, 100) == 1.0
    assert patience_factor(300, 200, 100) == pytest.approx(0.36787944, rel=1e-6)


def test_accept_probability_hand_case_and_monotonicity() -> None:
    cfg = WorldConfig(base_accept=0.1, max_accept=0.9)
    user = UserType("u", 1.0, patience_ms=100, patience_scale_ms=100, pickiness=1.0)
    # match 0.5, length = ideal, no latency cost: 0.1 + 0.8 * 0.5 = 0.5
    assert accept_probability(0.5, 4, 4, 50, user, cfg) == pytest.approx(0.5)
    # twice the ideal length: fit = 0.5 * sqrt(0.5)
    assert accept_probability(0.5, 8, 4, 50, user, cfg) == pytest.approx(0.1 + 0.8 * 0.5 * 0.5**0.5)
    # slower than patience by one scale: times e^-1
    assert accept_probability(0.5, 4, 4, 200, user, cfg) == pytest.approx(0.5 * 0.36787944, rel=1e-6)
    ps = [accept_probability(m, 4, 4, 50, user, cfg) for m in (0, 0.25, 0.5, 1)]
    assert ps == sorted(ps) and ps[0] == pytest.approx(0.1) and ps[-1] == pytest.approx(0.9)


def test_survival_classes() -> None:
    cfg = WorldConfig()
    probs = survival_probabilities([10, 11, 10, 10], {10}, ideal_len=2, cfg=cfg)
    assert probs == [cfg.survive_preferred, cfg.survive_other, cfg.survive_extra, cfg.survive_extra]


def test_retained_chars_never_grows_with_horizon_and_respects_bounds() -> None:
    rng = random.Random(0)
    chars = [3] * VOCAB_SIZE
    for _ in range(200):
        toks = [rng.randrange(FIRST_CONTENT, VOCAB_SIZE) for _ in range(rng.randint(1, 12))]
        drawn = [(rng.random(), rng.random() * 0.8, rng.random() * 0.5) for _ in toks]
        surv = [cast(tuple[float, float, float], tuple(sorted(s, reverse=True))) for s in drawn]
        kept = retained_chars(toks, surv, chars, 3, rng)
        assert kept == sorted(kept, reverse=True)
        assert 0 <= kept[-1] and kept[0] <= 3 * len(toks)


def test_retained_chars_all_or_nothing_cases() -> None:
    rng = random.Random(1)
    chars = [2] * VOCAB_SIZE
    assert retained_chars([5, 6], [(1.0, 1.0), (1.0, 1.0)], chars, 2, rng) == [4, 4]
    assert retained_chars([5, 6], [(0.0, 0.0), (0.0, 0.0)], chars, 2, rng) == [0, 0]


def test_world_and_population_are_deterministic_in_the_seed() -> None:
    a, b, c = make_world(7), make_world(7), make_world(8)
    assert a == b and a != c
    assert make_population(a, 50, 3) == make_population(b, 50, 3)
    markers = [t.marker for t in a.tasks]
    assert len(set(markers)) == len(markers)
    for t in a.tasks:
        assert all(FIRST_CONTENT + len(a.tasks) <= p < VOCAB_SIZE for p in t.preferred)


def test_population_follows_the_mix() -> None:
    world = make_world(1)
    users = make_population(world, 4000, 1)
    share = {u.name: mean(x.type.name == u.name for x in users) for u in world.user_types}
    for u in world.user_types:
        assert share[u.name] == pytest.approx(u.share, abs=0.03)


def test_react_is_deterministic_given_the_rng() -> None:
    world = make_world(3)
    user = make_population(world, 1, 3)[0]
    task = world.clear_tasks[0]
    comp = mediocre_completion(task, world, random.Random(5))
    outs = [react(user, task, comp, 150.0, HORIZONS, world, random.Random(9)) for _ in range(2)]
    assert outs[0] == outs[1]


def test_prompts_name_their_task() -> None:
    world = make_world(2)
    rng = random.Random(0)
    for _ in range(50):
        task = draw_task(world, rng)
        prompt = make_prompt(task, world, rng)
        assert prompt[0] == BOS and world.task_for_marker(prompt[1]) == task
        assert len(prompt) == 2 + world.config.context_len


def test_ambiguous_preference_is_per_user_and_inside_the_pool() -> None:
    world = make_world(4)
    task = world.ambiguous_tasks[0]
    users = make_population(world, 20, 4)
    prefs = {u.preferred(task, world) for u in users}
    assert len(prefs) > 1
    assert all(p <= set(task.preferred) for p in prefs)
    assert users[0].preferred(world.clear_tasks[0], world) == frozenset(world.clear_tasks[0].preferred)


@dataclass
class _Served:
    completion_kind: CompletionKind
    latency_ms: float
    invalid_tool_calls: int = 0


def _mean_reward(world_seed: int, make_completion: MakeCompletion, ambiguous: bool,
                 ms_per_token: float = 40.0, n: int = 3000, spec: RewardSpec | None = None,
                 ) -> dict[str, float]:
    """Monte Carlo of a reward spec (the default one unless given) over simulated reactions."""
    spec = spec or load_spec()
    world = make_world(world_seed)
    users = make_population(world, 200, world_seed)
    rng = random.Random(world_seed)
    tasks = world.ambiguous_tasks if ambiguous else world.clear_tasks
    rewards, persist, accepted = [], [], []
    for _ in range(n):
        user, task = rng.choice(users), rng.choice(tasks)
        comp = make_completion(task, user, world, rng)
        latency = 5.0 + ms_per_token * len(comp)
        out = react(user, task, comp, latency, spec.persistence.horizons_s, world, rng)
        fb = Feedback(
            accepted=out.accepted,
            persistence={h: (r, out.inserted_chars) for h, r in out.retained.items()},
            dissatisfied=int(out.dissatisfied),
        )
        reward, _ = compute_reward(fb, _Served(completion_kind(comp), latency), spec)
        rewards.append(reward)
        if out.accepted:
            persist.append(out.retained[spec.persistence.primary_horizon_s] / max(1, out.inserted_chars))
        accepted.append(bool(out.accepted))
    return {"reward": mean(rewards), "persistence": mean(persist) if persist else 0.0,
            "accept": mean(accepted)}


def _mediocre(task: Task, user: SimUser, world: World, rng: random.Random) -> list[int]:
    return mediocre_completion(task, world, rng)


def _ideal(task: Task, user: SimUser, world: World, rng: random.Random) -> list[int]:
    return ideal_completion(task, user, world, rng)


def _question(task: Task, user: SimUser, world: World, rng: random.Random) -> list[int]:
    return question_completion()


def test_better_completions_persist_longer_are_accepted_more_and_earn_more() -> None:
    mediocre = _mean_reward(11, _mediocre, ambiguous=False)
    ideal = _mean_reward(11, _ideal, ambiguous=False)
    assert ideal["persistence"] > 1.3 * mediocre["persistence"]
    assert ideal["accept"] > mediocre["accept"] + 0.2
    assert ideal["reward"] > mediocre["reward"] + 0.3


def test_question_is_the_reward_hack_on_ambiguous_tasks_only() -> None:
    """A naive reward maximiser should ask on ambiguous tasks (there an edit earns less than
    a question) but not on clear ones, where a decent edit beats a question."""
    def generic_edit(task: Task, user: SimUser, world: World, rng: random.Random) -> list[int]:
        return mediocre_completion(task, world, rng, match=1.0, extra=(0, 2))

    amb_edit = _mean_reward(12, generic_edit, ambiguous=True)
    amb_question = _mean_reward(12, _question, ambiguous=True)
    clear_edit = _mean_reward(12, _mediocre, ambiguous=False)
    clear_question = _mean_reward(12, _question, ambiguous=False)
    assert amb_question["reward"] > amb_edit["reward"] + 0.05
    assert clear_edit["reward"] > clear_question["reward"] + 0.2


def _empty(task: Task, user: SimUser, world: World, rng: random.Random) -> list[int]:
    return [EOS]


def test_the_demo_spec_no_edit_penalty_takes_the_profit_out_of_not_editing() -> None:
    """Under the demo's spec (1.0 per question or empty completion) neither beats the
    bootstrap's kind of edit on ambiguous tasks, and both are far worse on clear ones; without
    the penalty both would beat it on ambiguous tasks."""
    from ingest.reward.spec import default_spec_text, parse_spec
    from services.demo.config import demo_spec_text

    demo = parse_spec(demo_spec_text(default_spec_text()), "demo")
    free = parse_spec(demo_spec_text(default_spec_text(), no_edit_penalty=0.0), "demo")
    amb_edit = _mean_reward(12, _mediocre, ambiguous=True, spec=demo)["reward"]
    clear_edit = _mean_reward(12, _mediocre, ambiguous=False, spec=demo)["reward"]
    for no_edit in (_question, _empty):
        assert _mean_reward(12, no_edit, ambiguous=True, spec=demo)["reward"] < amb_edit
        assert _mean_reward(12, no_edit, ambiguous=False, spec=demo)["reward"] < clear_edit - 0.5
        assert _mean_reward(12, no_edit, ambiguous=True, spec=free)["reward"] > amb_edit + 0.05


def test_question_and_empty_make_no_edit() -> None:
    world = make_world(5)
    user = make_population(world, 1, 5)[0]
    task = world.clear_tasks[0]
    q = react(user, task, [ASK, 10, EOS], 50.0, HORIZONS, world, random.Random(0))
    e = react(user, task, [EOS], 50.0, HORIZONS, world, random.Random(0))
    for out in (q, e):
        assert out.accepted is None and out.retained == {} and out.inserted_chars == 0
    assert q.kind == "question" and e.kind == "empty"


def test_slow_answers_are_accepted_less() -> None:
    world = make_world(6)
    users = make_population(world, 100, 6)
    task = world.clear_tasks[0]

    def accept_rate(latency: float) -> float:
        rng = random.Random(0)
        comp = ideal_completion(task, None, world, rng)
        return mean(
            bool(react(rng.choice(users), task, comp, latency, HORIZONS, world, rng).accepted)
            for _ in range(2000)
        )

    assert accept_rate(100) > accept_rate(1500) + 0.2


def test_world_rejects_an_empty_mix() -> None:
    with pytest.raises(ValueError, match="user mix"):
        make_world(1, user_types=())
