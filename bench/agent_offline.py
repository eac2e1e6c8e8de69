"""The agent loop without services: the agent demo's simulated sessions, the session credit
rule and RL increments in one process, so the agent trainer's settings can be compared in
minutes (``rtrl bench loop-offline`` does the same for one-shot users).

    rtrl bench agent-offline --increments 3 --sessions 600
    rtrl bench agent-offline --seed 7 --kl-band 0.2:1.2:0.8 --json

Per increment it works ``--sessions`` sessions with the current policy (one sampled completion
per turn, read by the agent world of services/sim/agent.py), builds each session's events as
the harness sends them, assembles and credits them with the real session stage
(ingest/reward/sessions.py, session_credit.py) under the agent demo's spec, trains one
increment exactly as the trainer does on the credited turns in the order the reward log holds
them (a session's turns together, when it closes), and works sessions again. It prints, per
policy, what the report's "Agent sessions" section measures: session completion rate, turns
per completed session, the share of sessions with an invalid tool call, and of turns that are
questions. The live demo adds the canary judge and the champions-only data rule on top.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from statistics import mean
from typing import Any, cast

from bench.loop_offline import HELDOUT, band_arg
from ingest.events import RewardRecord, SessionEvent, SessionTurn
from ingest.reward.maths import Feedback
from ingest.reward.session_credit import TurnFacts, credit, edit_persisted
from ingest.reward.sessions import SessionWindow, assemble
from ingest.reward.spec import RewardSpec, agent_spec_text, parse_spec
from services.demo.chat_model import AGENT_PRETRAIN_EPOCHS, LORA_TARGETS, cached_demo_model, chat_prompt_ids
from services.demo.config import demo_spec_text, demo_trainer_env, toml_text
from services.demo.engine import LORA_RANK, lora_trainer_env
from services.settings.demo import DemoSettings, SimulatorSettings
from services.settings.model import settings_from_env
from services.sim.agent import AgentSession, AgentWorld, agent_corpus, make_agent_world
from services.sim.agent_events import turn_events
from services.sim.chat_world import ChatVocab
from services.sim.users import SimUser, make_population
from services.sim.wire import as_ended
from trainer.gate import GateConfig, evaluate
from trainer.increment import score_heldout
from trainer.loop import LoopConfig, rl_train, sft_train
from trainer.objective import ObjectiveConfig, assign_groups, group_advantages
from trainer.policy import TinyConfig, TinyTransformer
from trainer.samples import build_samples, to_samples

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class TurnRec:
    """The parts of a reward record the increment reads."""

    prompt_tokens: list[int]
    completion_tokens: list[int]
    behavior_logprobs: list[float]
    reward: float
    session_id: str
    temperature: float = 1.0
    session_credit: object | None = True
    """Set: the record is its session's credit (the trainer groups sessions, not turns)."""


@dataclass(frozen=True)
class SessionRun:
    end: str
    turns: int
    invalid_calls: int
    questions: int
    records: tuple[TurnRec, ...]
    moves: tuple[str, ...] = ()
    """What each turn did: step, miss, invalid, early, rejected, accepted, question, empty."""


@dataclass(frozen=True)
class AgentFigures:
    completion: float
    """Share of sessions completed."""
    turns_completed: float
    """Mean turns per completed session (nan without one)."""
    invalid_sessions: float
    """Share of sessions with at least one invalid tool call."""
    questions: float
    """Share of turns that are clarifying questions."""
    reward: float
    """Mean credited reward per turn."""
    moves: dict[str, float] = field(default_factory=dict)
    kl: float | None = None

    def line(self) -> str:
        kl = "" if self.kl is None else f" gate_kl={self.kl:.2f}"
        return (f"completion={self.completion:.1%} turns/completed={self.turns_completed:.2f} "
                f"invalid-sessions={self.invalid_sessions:.1%} questions={self.questions:.1%} "
                f"reward={self.reward:+.3f}{kl}\n" + " " * 15
                + " ".join(f"{k}={v:.0%}" for k, v in sorted(self.moves.items())))


def agent_figures(runs: list[SessionRun]) -> AgentFigures:
    done = [r.turns for r in runs if r.end == "completed"]
    turns = sum(r.turns for r in runs)
    return AgentFigures(mean(r.end == "completed" for r in runs), mean(done) if done else float("nan"),
                        mean(r.invalid_calls > 0 for r in runs), sum(r.questions for r in runs) / turns,
                        mean(x.reward for r in runs for x in r.records),
                        {k: v / turns for k, v in Counter(m for r in runs for m in r.moves).items()})


@dataclass(frozen=True)
class TokenAgent:
    """The built-in policy on the token-id API: the world's ids in and out."""

    policy: Any

    def act(self, prompt: list[int], sim: SimulatorSettings, seed: int) -> Act:
        tokens, logps = self.policy.sample(prompt, sim.max_tokens, temperature=sim.temperature,
                                           seed=seed, min_new_tokens=1)
        return Act(prompt, tokens, logps, tokens)


@dataclass(frozen=True)
class ChatAgent:
    """A Hugging Face model (the LoRA policy the vLLM demo serves) asked in chat: the prompt as
    the engine sees it (the chat template over the user's message), the answer decoded and read
    as the harness reads a chat answer (services/sim/wire.py: the words, then EOS when the
    model ended the answer itself)."""

    policy: Any
    tokenizer: Any
    vocab: ChatVocab

    def act(self, prompt: list[int], sim: SimulatorSettings, seed: int) -> Act:
        ids = chat_prompt_ids(self.tokenizer, self.vocab, prompt)
        tokens, logps = self.policy.sample(ids, sim.max_tokens, temperature=sim.temperature, seed=seed)
        words = self.vocab.read(self.tokenizer.decode(tokens, skip_special_tokens=True))
        return Act(ids, tokens, logps, as_ended(words, bool(tokens) and tokens[-1] in self.policy.eos))


@dataclass(frozen=True)
class Act:
    prompt: list[int]
    """The prompt in the policy's ids (what the trainer learns from)."""
    tokens: list[int]
    logps: list[float]
    read: list[int]
    """The answer in the world's ids, as the harness reads it."""


def work_session(agent: TokenAgent | ChatAgent, aw: AgentWorld, user: SimUser, spec: RewardSpec,
                 sim: SimulatorSettings, seed: int) -> SessionRun:
    """One session from its first turn to its end, credited as the session stage credits it."""
    assert spec.session is not None
    rng = random.Random(f"agent-offline-{seed}")
    session = AgentSession(aw, user, rng.choice(aw.tasks))
    sid, horizons = f"s{seed}", list(spec.persistence.horizons_s)
    events: list[Any] = []
    facts: dict[str, TurnFacts] = {}
    served: dict[str, tuple[list[int], list[int], list[float]]] = {}
    invalid = questions = 0
    moves: list[str] = []
    while session.end is None:
        turn, rid = session.turn, f"{sid}-t{session.turn}"
        act = agent.act(session.prompt(rng), sim, seed * 1009 + turn)
        at = T0 + timedelta(seconds=turn)
        early = session.progress < len(session.task.plan)
        step = session.step(act.read, 300.0, horizons, rng)
        events.append(SessionTurn(event_id=f"{rid}-turn", ts=at, session_id=sid, turn=turn, request_id=rid))
        events.extend(ev for _, ev in turn_events(aw, sid, turn, rid, step, at, sim)
                      if isinstance(ev, SessionEvent))
        o = step.outcome
        persisted = None if o is None else edit_persisted(
            Feedback(accepted=o.accepted,
                     persistence={h: (k, o.inserted_chars) for h, k in o.retained.items()}),
            o.kind, spec.persistence.primary_horizon_s)
        followups = int(step.dissatisfied) + int(bool(o and o.dissatisfied))
        facts[rid] = TurnFacts(len(act.prompt), len(act.tokens), followups, persisted)
        served[rid] = (act.prompt, act.tokens, act.logps)
        moves.append(move_name(step, early))
        invalid += int(step.action.kind == "call" and not step.action.valid)
        questions += int(step.action.kind == "question")
    window = SessionWindow(spec.session.idle_s, spec.session.max_s, spec.session.max_turns)
    closed = assemble(sid, events, T0 + timedelta(days=2), window)
    recs = tuple(TurnRec(*served[c.request_id], c.reward, sid) for c in credit(closed, facts, spec.session))
    return SessionRun(session.end or "open", session.turn, invalid, questions, recs, tuple(moves))


def move_name(step: Any, early: bool) -> str:
    a = step.action
    if a.kind == "call":
        if not a.valid:
            return f"invalid-{a.invalid_reason}"
        return "step" if step.reason.endswith("step done") else "miss"
    if a.kind == "answer":
        return "early" if early else ("accepted" if step.outcome.accepted else "rejected")
    return str(a.kind)


def work(agent: TokenAgent | ChatAgent, aw: AgentWorld, users: list[SimUser], n: int, spec: RewardSpec,
         sim: SimulatorSettings, seed: int) -> list[SessionRun]:
    rng = random.Random(f"agent-offline-users-{seed}")
    return [work_session(agent, aw, rng.choice(users), spec, sim, seed * 100_003 + i) for i in range(n)]


def trainer_base(engine: str) -> Any:
    """The agent demo's trainer settings on ``engine``: the built-in policy's, or (``hf``) the
    LoRA increments' of ``rtrl demo --agent --engine vllm``."""
    lora = lora_trainer_env(agent=True) if engine == "hf" else {}
    return settings_from_env({**demo_trainer_env(agent=True), **lora}).trainer


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rtrl bench agent-offline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0, help="the agent world's and the users' seed")
    ap.add_argument("--engine", choices=("builtin", "hf"), default="builtin",
                    help="builtin: the agent demo's built-in policy on the token-id API; hf: the "
                         "Hugging Face model --engine vllm serves (its base model, built or taken "
                         "from the demo's model cache), asked in chat, trained as LoRA increments")
    ap.add_argument("--increments", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=600, help="sessions worked per increment window")
    ap.add_argument("--eval-sessions", type=int, default=600)
    ap.add_argument("--users", type=int, default=400)
    ap.add_argument("--corpus", type=int, default=2500, help="bootstrap turns (as the demo's; builtin)")
    ap.add_argument("--lr", type=float, default=None, help="default: the agent demo's on the engine")
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--group-size", type=int, default=None)
    ap.add_argument("--kl-coef", type=float, default=None)
    ap.add_argument("--kl-band", default=None, metavar="LOW:HIGH[:TARGET]|off",
                    help="as rtrl bench loop-offline's (default: the agent demo's)")
    ap.add_argument("--length-guard", default=None, metavar="FRACTION|off",
                    help="as rtrl bench loop-offline's (default: the agent demo's)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--grouping", choices=("session", "turns", "state"), default="session",
                    help="how advantages are grouped (default %(default)s: as the trainer does)")
    ap.add_argument("--invalid-penalty", type=float, default=None,
                    help="the spec's penalty per invalid tool call and per turn (default: the agent "
                         "demo spec's)")
    ap.add_argument("--json", action="store_true")
    return ap


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with each trainer flag not given set to the agent demo's on ``--engine``."""
    base = trainer_base(args.engine)
    band = base.band
    edges = f"{band.low:g}:{band.high:g}" + (f":{band.target:g}" if band.target is not None else "")
    guard = band.max_length_change
    defaults = {"lr": base.lr, "epochs": base.epochs, "batch_size": base.batch_size,
                "group_size": base.group_size, "kl_coef": base.kl_coef, "warmup": base.warmup_steps,
                "kl_band": edges if band.enabled else "off",
                "length_guard": f"{guard:g}" if guard is not None else "off"}
    given = {k: v for k, v in vars(args).items() if v is not None}
    return argparse.Namespace(**{**defaults, **given, "probe_every": band.probe_every,
                                 "max_epochs": band.max_epochs})


def loop_config(args: argparse.Namespace) -> LoopConfig:
    """The increments' settings: the flags given, the agent demo's on ``--engine`` otherwise."""
    a = with_defaults(args)
    return LoopConfig(batch_size=a.batch_size, epochs=a.epochs, lr=a.lr, seed=a.seed, checkpoint_every=10**9,
                      objective=ObjectiveConfig(kl_coef=a.kl_coef),
                      band=band_arg(a.kl_band, a.probe_every, a.max_epochs, a.length_guard),
                      warmup_steps=a.warmup)


def bootstrap(args: argparse.Namespace, aw: AgentWorld, work_dir: Path) -> TokenAgent | ChatAgent:
    """The policy every run starts from: the built-in policy trained on the agent corpus, or the
    vLLM demo's base model under an identity LoRA adapter (as ``rtrl demo --agent --engine
    vllm`` bootstraps it)."""
    if args.engine == "builtin":
        tiny = TinyTransformer(TinyConfig())
        sft_train(tiny, agent_corpus(args.corpus, args.seed),
                  LoopConfig(batch_size=32, epochs=2, lr=1e-3, seed=args.seed))
        return TokenAgent(tiny)
    from transformers import AutoTokenizer

    from trainer.lora_policy import LoRAPolicy, LoraSpec

    model = cached_demo_model(work_dir / "model", args.seed, DemoSettings().model_cache_dir,
                              epochs=AGENT_PRETRAIN_EPOCHS, agent=True)
    policy = LoRAPolicy.create(model, LoraSpec(rank=LORA_RANK, targets=LORA_TARGETS), seed=args.seed)
    return ChatAgent(policy, AutoTokenizer.from_pretrained(str(model)), ChatVocab(aw.world))


def samples(window: list[RewardRecord], grouping: str, size: int) -> list[Any]:
    """The increment's samples: ``session`` as the trainer builds them; ``turns`` as it did
    before sessions were grouped (each turn on its own, in window order); ``state`` grouped by
    the agent world's state (task, progress, last observation), which no trainer can see."""
    if grouping == "session":
        return build_samples(window, size, False)
    if grouping == "turns":
        return build_samples([cast(Any, replace(cast(TurnRec, r), session_credit=None)) for r in window],
                             size, False)
    groups = assign_groups([tuple(r.prompt_tokens[:4]) for r in window], size)
    return to_samples(window, group_advantages([r.reward for r in window], groups))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rtrl-agent-offline-") as work_dir:
        return run(args, Path(work_dir))


def run(args: argparse.Namespace, work_dir: Path) -> int:
    loop, group_size = loop_config(args), with_defaults(args).group_size
    doc = tomllib.loads(demo_spec_text(agent_spec_text()))
    if args.invalid_penalty is not None:
        pen = args.invalid_penalty
        doc["session"].update(invalid_tool_call=pen, invalid_max_per_turn=pen)
    spec = parse_spec(toml_text(doc), "agent demo spec")
    sim = SimulatorSettings()
    aw = make_agent_world(args.seed)
    users = make_population(aw.world, args.users, args.seed)
    t0 = time.monotonic()
    agent = bootstrap(args, aw, work_dir)
    print(f"engine {args.engine}: lr {loop.lr:g}, warm-up {loop.warmup_steps}, band {loop.band}", flush=True)
    rows = [("bootstrap", agent_figures(work(agent, aw, users, args.eval_sessions, spec, sim, 10_000)))]
    print(f"{rows[0][0]:>13}: {rows[0][1].line()}  ({time.monotonic() - t0:.0f}s)", flush=True)
    for k in range(1, args.increments + 1):
        records = [x for r in work(agent, aw, users, args.sessions, spec, sim, k) for x in r.records]
        heldout = cast(list[RewardRecord], records[-HELDOUT:])
        window = cast(list[RewardRecord], records[:-HELDOUT])
        child = agent.policy.clone()
        history = rl_train(child, agent.policy, samples(window, args.grouping, group_size),
                           replace(loop, seed=args.seed + k), probe=to_samples(heldout, [0.0] * len(heldout)))
        losses = [h["loss"] for h in history]
        gate = evaluate(score_heldout(child, agent.policy, heldout), losses, GateConfig())
        agent = replace(agent, policy=child)
        f = replace(agent_figures(work(agent, aw, users, args.eval_sessions, spec, sim, 10_000 + k)),
                    kl=gate.figures.get("kl_parent"))
        rows.append((f"increment {k}", f))
        print(f"{rows[-1][0]:>13}: {f.line()}  steps={len(history)} ({time.monotonic() - t0:.0f}s)",
              flush=True)
    first, last = rows[0][1], rows[-1][1]
    print(f"last vs bootstrap: completion {last.completion - first.completion:+.1%} (absolute), "
          f"turns per completed session {last.turns_completed - first.turns_completed:+.2f}, "
          f"sessions with an invalid call {last.invalid_sessions - first.invalid_sessions:+.1%}")
    if args.json:
        print(json.dumps({"rows": [{"policy": n, **f.__dict__} for n, f in rows]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
