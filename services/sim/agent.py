"""Agent users: multi-step tasks that need tools, in the built-in policy's token ids.

A pure, seeded model (no clients, no clocks), beside services/sim/users.py's one-shot users.

The world
---------
An *agent task* has a marker (the token that names it), a *plan* (the tools it needs, in
order: e.g. ``search`` then ``edit`` then ``run``), preferred content tokens and an ideal
answer length. A session is worked turn by turn; each turn's prompt is what the agent knows::

    [BOS, task marker, progress, last observation, context...]

``progress`` says how many steps of the plan are done (one token per count), ``last
observation`` what the previous turn led to (:data:`OBSERVATIONS`); the context is noise.

A completion is read as one action (:func:`read_action`):

* ``[tool, arg..., EOS]``: a tool call. Its arguments are valid when there are 1 to
  ``max_args`` of them, all content tokens (``schema_mismatch`` for none or too many,
  ``not_json`` for a special or tool token among them, or a call cut off before EOS); a
  completion that starts with a progress or observation token calls a tool nobody declared
  (``unknown_tool``). A valid call of the plan's next tool with at least one argument the
  task prefers (a relevant query, the right file) moves the plan one step.
* ``[ASK, EOS]``: a clarifying question; the user answers it, which helps nothing here.
* ``[content..., EOS]``: the final answer, an edit the user judges as a one-shot user does
  (:func:`services.sim.users.react`) once the plan is done, and rejects before that.
* ``[EOS]`` or nothing: an empty turn.

The users
---------
A session *completes* when the user accepts the final answer. The user *abandons* it when
the agent breaks tools (``max_invalid`` invalid calls), loops (the same call
``max_repeats`` times in a row), stalls (more than ``max_questions`` questions), keeps
answering wrongly (``max_rejections`` rejected answers) or takes more turns than the user's
patience (``max_turns``, scaled by the user type's patience). So a policy completes more
sessions in fewer turns by calling the right tools with relevant arguments, then answering
with what the user keeps.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from services.sim.users import (
    DEFAULT_USER_TYPES,
    Outcome,
    SimUser,
    Task,
    UserType,
    World,
    WorldConfig,
    bootstrap_corpus,
    react,
)
from trainer.tokens import ASK, BOS, EOS, FIRST_CONTENT, VOCAB_SIZE

TOOL_NAMES: tuple[str, ...] = ("search", "edit", "run")
OBSERVATIONS: tuple[str, ...] = ("start", "done", "miss", "error", "answer", "rejected")
"""What the previous turn led to: the session's first turn; a step of the plan done; a call
that ran and moved nothing; an invalid call; a question answered; an answer rejected."""
MAX_PLAN = len(TOOL_NAMES)

ActionKind = Literal["call", "question", "answer", "empty"]
InvalidReason = Literal["unknown_tool", "not_json", "schema_mismatch"]
EndOutcome = Literal["completed", "abandoned", "handed_back"]


@dataclass(frozen=True)
class AgentConfig:
    """Shape of the agent world; every number is a knob."""

    n_tasks: int = 8
    plan_len: tuple[int, int] = (2, 3)
    """Inclusive range of steps per task's plan (at most one per tool)."""
    preferred_per_task: int = 4
    ideal_len: tuple[int, int] = (3, 6)
    context_len: int = 2
    max_args: int = 3
    max_invalid: int = 2
    max_questions: int = 2
    max_repeats: int = 3
    max_rejections: int = 2
    max_turns: int = 10
    """A typical user's patience in turns; scaled by each type's patience_ms / 700."""
    question_annoyance: float = 0.3
    """Chance a question leads to a dissatisfied follow-up."""


@dataclass(frozen=True)
class AgentTask:
    task: Task
    """Marker, preferred tokens and ideal length of the final answer (a clear task)."""
    plan: tuple[str, ...]


@dataclass(frozen=True)
class AgentWorld:
    tasks: tuple[AgentTask, ...]
    world: World
    """The one-shot world the final answers are judged in (same tasks, same user types)."""
    config: AgentConfig
    tools: dict[str, int] = field(repr=False)
    """Tool name -> its token."""
    progress_tokens: tuple[int, ...] = field(repr=False)
    observation_tokens: dict[str, int] = field(repr=False)
    pool: tuple[int, ...] = field(repr=False)
    """Content tokens: preferred tokens, arguments and context noise are drawn from these."""
    tool_of: dict[int, str] = field(init=False, repr=False, compare=False)
    """Token -> its tool's name (derived once from ``tools``)."""
    content: frozenset[int] = field(init=False, repr=False, compare=False)
    """``pool`` as a set, for reading arguments."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tool_of", {t: name for name, t in self.tools.items()})
        object.__setattr__(self, "content", frozenset(self.pool))

    def prompt(self, task: AgentTask, progress: int, observation: str, rng: random.Random) -> list[int]:
        noise = [rng.choice(self.pool) for _ in range(self.config.context_len)]
        return [BOS, task.task.marker, self.progress_tokens[progress],
                self.observation_tokens[observation], *noise]


def make_agent_world(seed: int, config: AgentConfig | None = None,
                     user_types: Sequence[UserType] = DEFAULT_USER_TYPES) -> AgentWorld:
    """Draw tasks, plans and the token layout deterministically from ``seed``."""
    cfg = config or AgentConfig()
    lo, hi = cfg.plan_len
    if not 1 <= lo <= hi <= MAX_PLAN:
        raise ValueError(f"plan_len must be within 1..{MAX_PLAN}, got {cfg.plan_len}")
    rng = random.Random(f"agent-world-{seed}")
    ids = iter(range(FIRST_CONTENT, VOCAB_SIZE))
    markers = [next(ids) for _ in range(cfg.n_tasks)]
    tools = {name: next(ids) for name in TOOL_NAMES}
    progress = tuple(next(ids) for _ in range(MAX_PLAN + 1))
    observations = {name: next(ids) for name in OBSERVATIONS}
    pool = tuple(ids)
    if len(pool) < cfg.preferred_per_task * 2:
        raise ValueError("vocabulary too small for this many agent tasks")
    tasks = []
    for marker in markers:
        preferred = tuple(sorted(rng.sample(pool, cfg.preferred_per_task)))
        chosen = set(rng.sample(TOOL_NAMES, rng.randint(lo, hi)))
        plan = tuple(name for name in TOOL_NAMES if name in chosen)
        tasks.append(AgentTask(Task(marker, preferred, rng.randint(*cfg.ideal_len)), plan))
    chars = tuple(rng.randint(2, 6) for _ in range(VOCAB_SIZE))
    world = World(tuple(t.task for t in tasks), tuple(user_types),
                  WorldConfig(n_tasks=cfg.n_tasks, n_ambiguous=0, ambiguous_share=0.0), chars)
    return AgentWorld(tuple(tasks), world, cfg, tools, progress, observations, pool)


# --------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    tool: str = ""
    """For a call: the tool's name (``unknown`` for an undeclared one)."""
    args: tuple[int, ...] = ()
    """A call's arguments; an answer's content tokens."""
    invalid_reason: InvalidReason | None = None

    @property
    def valid(self) -> bool:
        return self.kind == "call" and self.invalid_reason is None


def read_action(tokens: Sequence[int], aw: AgentWorld) -> Action:
    """What a completion does in the agent world (the module docstring's rules)."""
    if not tokens or tokens[0] == EOS:
        return Action("empty")
    if tokens[0] == ASK:
        return Action("question")
    body = list(tokens[1:tokens.index(EOS)]) if EOS in tokens else None
    first = tokens[0]
    tool = aw.tool_of.get(first)
    if tool is None and (first in aw.progress_tokens or first in aw.observation_tokens.values()):
        return Action("call", "unknown", tuple(body or tokens[1:]), "unknown_tool")
    if tool is None:
        return Action("answer", args=tuple(tokens[:tokens.index(EOS)] if EOS in tokens else tokens))
    if body is None:
        return Action("call", tool, tuple(tokens[1:]), "not_json")
    if any(t not in aw.content for t in body):
        return Action("call", tool, tuple(body), "not_json")
    if not 1 <= len(body) <= aw.config.max_args:
        return Action("call", tool, tuple(body), "schema_mismatch")
    return Action("call", tool, tuple(body))


# --------------------------------------------------------------------------- sessions


@dataclass(frozen=True)
class Step:
    """What one turn led to, as the harness reports it."""

    action: Action
    result: Literal["ok"] | None
    """The tool's result status for a dispatched (valid) call; None otherwise."""
    outcome: Outcome | None
    """The user's reaction to an answer (edit events, as a one-shot user sends them)."""
    dissatisfied: bool
    """A dissatisfied follow-up to this turn (besides the one an outcome may carry)."""
    end: EndOutcome | None
    reason: str
    """Why the session ended, or what the turn did (for logs)."""


def turn_budget(user: UserType, cfg: AgentConfig) -> int:
    return max(MAX_PLAN + 1, round(cfg.max_turns * user.patience_ms / 700.0))


@dataclass
class AgentSession:
    """One user's session on one task; :meth:`step` applies a turn's completion."""

    aw: AgentWorld
    user: SimUser
    task: AgentTask
    turn: int = 0
    progress: int = 0
    observation: str = "start"
    invalid: int = 0
    questions: int = 0
    rejections: int = 0
    repeats: int = 0
    last_call: tuple[str, tuple[int, ...]] | None = None
    end: EndOutcome | None = None

    def prompt(self, rng: random.Random) -> list[int]:
        return self.aw.prompt(self.task, self.progress, self.observation, rng)

    def step(self, tokens: Sequence[int], latency_ms: float, horizons_s: Sequence[int],
             rng: random.Random) -> Step:
        """Apply one turn's completion: what it led to, and whether the session ended."""
        if self.end is not None:
            raise RuntimeError("the session has ended")
        action = read_action(tokens, self.aw)
        if action.kind != "call":
            self.last_call = None
        if action.kind == "call":
            step = self._call(action)
        elif action.kind == "question":
            step = self._question(action, rng)
        elif action.kind == "answer":
            step = self._answer(action, latency_ms, horizons_s, rng)
        else:
            self.observation = "miss"
            step = Step(action, None, None, False, None, "an empty turn")
        self.turn += 1
        if step.end is None and self.turn >= turn_budget(self.user.type, self.aw.config):
            step = replace(step, end="abandoned", reason="too many turns")
        self.end = step.end
        return step

    def _call(self, action: Action) -> Step:
        cfg = self.aw.config
        call = (action.tool, action.args)
        self.repeats = self.repeats + 1 if call == self.last_call else 1
        self.last_call = call
        if not action.valid:
            self.invalid += 1
            self.observation = "error"
            if self.invalid >= cfg.max_invalid:
                return Step(action, None, None, False, "abandoned", "the agent breaks its tools")
            end: EndOutcome | None = "abandoned" if self.repeats >= cfg.max_repeats else None
            return Step(action, None, None, False, end, f"invalid call ({action.invalid_reason})")
        plan = self.task.plan
        moves = (self.progress < len(plan) and action.tool == plan[self.progress]
                 and any(a in self.task.task.preferred for a in action.args))
        self.progress += int(moves)
        self.observation = "done" if moves else "miss"
        if self.repeats >= cfg.max_repeats:
            return Step(action, "ok", None, False, "abandoned", "the agent loops on one call")
        return Step(action, "ok", None, False, None,
                    f"{action.tool}: {'step done' if moves else 'nothing gained'}")

    def _question(self, action: Action, rng: random.Random) -> Step:
        self.questions += 1
        self.observation = "answer"
        dissatisfied = rng.random() < self.aw.config.question_annoyance
        if self.questions > self.aw.config.max_questions:
            return Step(action, None, None, dissatisfied, "abandoned", "the agent stalls with questions")
        return Step(action, None, None, dissatisfied, None, "a question")

    def _answer(self, action: Action, latency_ms: float, horizons_s: Sequence[int],
                rng: random.Random) -> Step:
        early = self.progress < len(self.task.plan)
        if early:  # the plan is not done: the user turns the answer down
            outcome = Outcome("edit", False, sum(self.aw.world.chars[t] for t in action.args), {}, False, 0.0)
        else:
            outcome = react(self.user, self.task.task, [*action.args, EOS], latency_ms, horizons_s,
                            self.aw.world, rng)
        if outcome.accepted:
            return Step(action, None, outcome, False, "completed", "answer accepted")
        self.rejections += 1
        self.observation = "rejected"
        if self.rejections >= self.aw.config.max_rejections:
            return Step(action, None, outcome, False, "abandoned", "answers keep missing")
        return Step(action, None, outcome, False, None,
                    "answer rejected" + (" (the plan is not done)" if early else ""))


# --------------------------------------------------------------------------- scripted agents


def scripted_turn(session: AgentSession, rng: random.Random, skill: float) -> list[int]:
    """A scripted agent's completion: with probability ``skill`` the right move (the plan's
    next tool with one relevant argument, or the ideal answer once the plan is done), else a
    plausible mistake (another tool, an irrelevant argument, an early or overlong answer).
    ``skill=1`` is the ideal agent; the bootstrap corpus uses a middling one."""
    aw, task = session.aw, session.task
    done = session.progress >= len(task.plan)
    if rng.random() < skill:
        if done:
            return [rng.choice(task.task.preferred) for _ in range(task.task.ideal_len)] + [EOS]
        return [aw.tools[task.plan[session.progress]], rng.choice(task.task.preferred), EOS]
    mistake = rng.randrange(3)
    if mistake == 0:
        return [aw.tools[rng.choice(TOOL_NAMES)], *(rng.choice(aw.pool) for _ in range(rng.randint(1, 3))),
                EOS]
    if mistake == 1:
        n = task.task.ideal_len + rng.randint(3, 7)
        return [rng.choice(task.task.preferred) if rng.random() < 0.5 else rng.choice(aw.pool)
                for _ in range(n)] + [EOS]
    tool = task.plan[min(session.progress, len(task.plan) - 1)]
    return [aw.tools[tool], *(rng.choice(aw.pool) for _ in range(rng.randint(1, 3))), EOS]


def agent_corpus(n: int, seed: int, skill: float = 0.5) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) turns of scripted agents of middling ``skill`` in sessions of the
    agent world of ``seed``: a bootstrap champion that completes some sessions, slowly."""
    aw = make_agent_world(seed)
    rng = random.Random(f"agent-corpus-{seed}")
    users = [SimUser(f"corpus-{i}", rng.choice(aw.world.user_types), rng.randrange(2**31))
             for i in range(16)]
    pairs: list[tuple[list[int], list[int]]] = []
    while len(pairs) < n:
        session = AgentSession(aw, rng.choice(users), rng.choice(aw.tasks))
        while session.end is None and len(pairs) < n:
            prompt = session.prompt(rng)
            completion = scripted_turn(session, rng, skill)
            pairs.append((prompt, completion))
            session.step(completion, 300.0, (3600,), rng)
    return pairs


def world_corpus(n: int, seed: int, agent: bool = False) -> list[tuple[list[int], list[int]]]:
    """A bootstrap corpus of the simulated world: one-shot users' mediocre answers
    (:func:`services.sim.users.bootstrap_corpus`), or with ``agent`` middling agents' turns
    (:func:`agent_corpus`)."""
    return agent_corpus(n, seed) if agent else bootstrap_corpus(n, seed)
