"""Session credit (ingest/reward/session_credit.py): the worked example and the terms of
docs/rewards.md read from the page, hand-computed cases, and a plain reference on seeded random
sessions with hostile extras, in any arrival order."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ingest.events import SessionEnd, SessionEvent, SessionSummary, SessionTurn, ToolCall, parse_event
from ingest.reward.maths import Feedback
from ingest.reward.session_credit import (
    COMPONENTS,
    RETURN_COMPONENTS,
    TurnCredit,
    TurnFacts,
    credit,
    edit_persisted,
    session_return,
)
from ingest.reward.sessions import assemble
from ingest.reward.spec import SessionSpec, load_spec

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "rewards.md"


def agent_terms() -> SessionSpec:
    """The session terms of the packaged agent-v1 spec."""
    terms = load_spec(ROOT / "ingest" / "reward" / "specs" / "agent.toml").session
    assert terms is not None
    return terms


AGENT = agent_terms()
T0 = datetime(2026, 11, 22, 10, 0, tzinfo=UTC)
SID = "s1"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


# ------------------------------------------------------------------ the worked example of the doc
def doc_section() -> str:
    text = DOC.read_text()
    return text[text.index("### Worked example"):text.index("\n## ", text.index("### Worked example"))]


def number(cell: str) -> float:
    return float(cell.strip().replace("−", "-"))


def table_rows(section: str, first: str) -> list[list[str]]:
    """The cells of the rows of the table whose header starts with ``| first |``."""
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def example() -> tuple[list[SessionEvent], dict[str, TurnFacts]]:
    lines = (ROOT / "docs" / "examples" / "session.jsonl").read_text().splitlines()
    events = [e for e in (parse_event(line) for line in lines if line.strip())
              if isinstance(e, SessionEvent)]
    block = re.search(r"```json\n(.*?)```", doc_section(), re.S)
    assert block is not None
    facts = {req: TurnFacts(**f) for req, f in json.loads(block.group(1)).items()}
    return events, facts


def test_the_worked_example_in_docs_rewards_md_is_what_the_code_gives() -> None:
    events, facts = example()
    session = assemble("sess-7f3a", events, max(e.ts for e in events))
    assert session.status == "completed" and session.anomalies == ()
    terms = {row[0]: number(row[1]) for row in table_rows(doc_section(), "term")}
    got = session_return(session, facts, AGENT)
    assert {k: terms[k] for k in RETURN_COMPONENTS} == pytest.approx(got, abs=1e-12)
    assert terms["return"] == pytest.approx(sum(got.values()), abs=1e-12)
    credits = credit(session, facts, AGENT)
    rows = table_rows(doc_section(), "turn")
    assert [(int(r[0]), r[1], int(r[3])) for r in rows] == [
        (c.turn, c.request_id, round(-c.components["invalid_tool_calls"] / AGENT.invalid_tool_call))
        for c in credits]
    assert [number(r[4]) for r in rows] == pytest.approx([c.reward for c in credits], abs=1e-12)


def test_the_worked_example_timed_out_has_the_return_the_doc_gives() -> None:
    events, facts = example()
    no_end = [e for e in events if not isinstance(e, SessionEnd)]
    latest = max(e.ts for e in no_end)
    session = assemble("sess-7f3a", no_end, latest + timedelta(seconds=AGENT.idle_s), AGENT.window)
    assert session.status == "timed_out"
    said = re.search(r"timed_out`.*?return of ([+\-][0-9]+\.[0-9]+)", doc_section(), re.S)
    assert said is not None
    assert sum(session_return(session, facts, AGENT).values()) == pytest.approx(number(said.group(1)))


def test_the_terms_table_of_docs_rewards_md_gives_agent_v1s_values() -> None:
    text = DOC.read_text()
    section = text[text.index("## Sessions\n"):text.index("### The credit rule")]
    cells = {row[0]: row[1] for row in table_rows(section, "term")}
    a = AGENT
    expected = {
        "outcome": [a.completed, a.handed_back, a.abandoned, a.timed_out],
        "persisted_edits": [a.persisted_edits],
        "dissatisfied": [-a.dissatisfied, a.dissatisfied_max_count],
        "turns": [-a.per_turn],
        "tokens": [-a.per_1k_tokens, 1000],
        "invalid_tool_calls": [-a.invalid_tool_call, -a.invalid_max_per_turn],
    }
    numbers = {k: [number(n) for n in re.findall(r"[+\-−]?\d+(?:\.\d+)?", v)] for k, v in cells.items()}
    assert numbers == expected
    window = re.search(r"`idle_s` \(([\d ]+)\), `max_s` \(([\d ]+)\) and `max_turns` \(([\d ]+)\)", section)
    assert window is not None
    assert [number(g.replace(" ", "")) for g in window.groups()] == [a.idle_s, a.max_s, a.max_turns]


# ------------------------------------------------------------------ building sessions
def base(eid: str, n: int, t: float, req: str, sid: str = SID) -> dict[str, Any]:
    return {"event_id": eid, "session_id": sid, "turn": n, "ts": at(t), "request_id": req}


def call(eid: str, n: int, cid: str, valid: bool, t: float, req: str, sid: str = SID) -> ToolCall:
    return ToolCall(**base(eid, n, t, req, sid), call_id=cid, tool="run", arguments_valid=valid,
                    invalid_reason=None if valid else "schema_mismatch", outcome="blocked")


@dataclass
class PlanTurn:
    valid: int
    invalid: int
    facts: TurnFacts | None


@dataclass
class Plan:
    turns: list[PlanTurn]
    outcome: str | None
    """None: no session.end (the session times out)."""
    summary_at: int | None = None
    extra_facts: dict[str, TurnFacts] = field(default_factory=dict)

    def facts(self) -> dict[str, TurnFacts]:
        own = {f"r{i}": t.facts for i, t in enumerate(self.turns) if t.facts is not None}
        return {**own, **self.extra_facts}


def events_of(plan: Plan) -> list[SessionEvent]:
    evs: list[SessionEvent] = []
    for i, t in enumerate(plan.turns):
        evs.append(SessionTurn(**base(f"t{i}", i, 60.0 * i, f"r{i}")))
        evs += [call(f"c{i}.{k}", i, f"k{i}.{k}", k >= t.invalid, 60.0 * i + 1 + k, f"r{i}")
                for k in range(t.valid + t.invalid)]
    if plan.summary_at is not None:
        n = plan.summary_at
        evs.append(SessionSummary(**base(f"m{n}", n, 60.0 * n + 30, f"r{n}"), replaced_from=0,
                                  replaced_to=n - 1, summary_tokens=100))
    if plan.outcome is not None:
        last = len(plan.turns) - 1
        evs.append(SessionEnd(**base("end", last, 60.0 * last + 50, f"r{last}"), outcome=plan.outcome))
    return evs


def hostile(plan: Plan) -> list[SessionEvent]:
    """Events that change no credit. Set aside: an invalid call of another session, of an
    unseen turn, of turn 0 under another request, reusing a call id; a turn 0 of another
    request (whose request has facts); an exact repeat of an event. Placed: a valid call."""
    n = len(plan.turns)
    plan.extra_facts["r-conflict"] = TurnFacts(prompt_tokens=5000, completion_tokens=5000, dissatisfied=3)
    evs: list[SessionEvent] = [
        call("h1", 0, "hk1", False, 5, "r0", sid="s-other"),
        call("h2", n + 3, "hk2", False, 5, f"r{n + 3}"),
        call("h3", 0, "hk3", False, 5, "r-other"),
        SessionTurn(**base("h4", 0, 30, "r-conflict")),
        call("h5", 0, "k-dup", True, 2, "r0"),
        call("h6", 0, "k-dup", False, 3, "r0"),
    ]
    return [*evs, evs[1]]


def random_plan(rng: random.Random) -> Plan:
    def facts() -> TurnFacts | None:
        if rng.random() < 0.15:
            return None
        persisted = rng.choice([None, None, 0.0, round(rng.random(), 3)])
        return TurnFacts(rng.randrange(5000), rng.randrange(500), rng.choice([0, 0, 1, 2]), persisted)

    turns = [PlanTurn(rng.randrange(3), rng.choice([0, 0, 1, 2, 5]), facts())
             for _ in range(rng.randint(1, 9))]
    summary_at = rng.randrange(1, len(turns)) if len(turns) > 1 and rng.random() < 0.5 else None
    outcome = rng.choice(["completed", "abandoned", "handed_back", None])
    return Plan(turns, outcome, summary_at)


def reference(plan: Plan, spec: SessionSpec) -> dict[str, float]:
    """The rule, written plainly from the plan (docs/rewards.md, "Sessions")."""
    served = [(i, t) for i, t in enumerate(plan.turns) if t.facts is not None]
    outcome_values = {"completed": spec.completed, "abandoned": spec.abandoned,
                      "handed_back": spec.handed_back, None: spec.timed_out}
    ret = outcome_values[plan.outcome]
    reported = []
    dissatisfied = 0
    tokens = 0
    for _, t in served:
        assert t.facts is not None
        if t.facts.edit_persisted is not None:
            reported.append(t.facts.edit_persisted)
        dissatisfied += t.facts.dissatisfied
        tokens += t.facts.prompt_tokens + t.facts.completion_tokens
    if reported:
        ret += spec.persisted_edits * sum(reported) / len(reported)
    ret -= spec.dissatisfied * min(dissatisfied, spec.dissatisfied_max_count)
    ret -= spec.per_turn * len(served)
    ret -= spec.per_1k_tokens * tokens / 1000
    out = {}
    for i, t in served:
        out[f"r{i}"] = ret - min(spec.invalid_max_per_turn, spec.invalid_tool_call * t.invalid)
    return out


def credit_of(events: list[SessionEvent], plan: Plan, spec: SessionSpec = AGENT) -> tuple[TurnCredit, ...]:
    now = at(60.0 * len(plan.turns) + 10 * 86_400)  # closed: ended, or long idle
    return credit(assemble(SID, events, now, spec.window), plan.facts(), spec)


# ------------------------------------------------------------------ hand-computed cases
def test_a_hand_worked_abandoned_trajectory() -> None:
    # turn 0: 2 invalid calls; turn 1: no facts (never served); turn 2: 5 invalid (capped at 1.0)
    plan = Plan([PlanTurn(1, 2, TurnFacts(1000, 100, dissatisfied=2, edit_persisted=0.0)),
                 PlanTurn(0, 0, None),
                 PlanTurn(0, 5, TurnFacts(2000, 400, dissatisfied=1, edit_persisted=0.5))], "abandoned")
    got = credit_of(events_of(plan), plan)
    # return = -0.5 (abandoned) + 1.0 * (0.0 + 0.5) / 2 - 0.5 * min(3, 2) - 0.02 * 2 - 0.002 * 3.5
    #        = -0.5 + 0.25 - 1.0 - 0.04 - 0.007 = -1.297
    assert [(c.turn, c.request_id) for c in got] == [(0, "r0"), (2, "r2")]
    assert got[0].components == pytest.approx({"outcome": -0.5, "persisted_edits": 0.25, "dissatisfied": -1.0,
                                               "turns": -0.04, "tokens": -0.007, "invalid_tool_calls": -0.5})
    assert got[0].reward == pytest.approx(-1.797) and got[1].reward == pytest.approx(-2.297)


def test_an_open_session_is_not_credited() -> None:
    plan = Plan([PlanTurn(0, 0, TurnFacts(10, 10))], None)
    session = assemble(SID, events_of(plan), at(60), AGENT.window)
    assert session.status == "open"
    with pytest.raises(ValueError, match="open session"):
        credit(session, plan.facts(), AGENT)


def test_a_session_without_served_turns_credits_nothing() -> None:
    plan = Plan([PlanTurn(0, 1, None)], "completed")
    assert credit_of(events_of(plan), plan) == ()


def test_no_reported_edit_is_no_persistence_term_and_no_negative_zero() -> None:
    plan = Plan([PlanTurn(0, 0, TurnFacts(0, 0))], None)
    spec = SessionSpec(per_turn=0.0)
    (only,) = credit_of(events_of(plan), plan, spec)
    assert only.reward == 0.0 and all(str(v) == "0.0" for v in only.components.values())
    assert list(only.components) == list(COMPONENTS)


def test_edit_persisted_reads_the_per_request_feedback() -> None:
    kept = Feedback(accepted=True, persistence={30: (90, 100), 600: (70, 100)})
    assert edit_persisted(kept, "edit", 600) == pytest.approx(0.7)
    assert edit_persisted(Feedback(accepted=False, persistence={600: (70, 100)}), "edit", 600) == 0.0
    assert edit_persisted(Feedback(accepted=True), "edit", 600) is None
    assert edit_persisted(kept, "tool_call", 600) is None


# ------------------------------------------------------------------ against the reference
@pytest.mark.parametrize("seed", range(40))
def test_random_sessions_match_the_reference_in_any_order_and_ignore_set_aside_events(seed: int) -> None:
    rng = random.Random(seed)
    plan = random_plan(rng)
    clean = credit_of(events_of(plan), plan)
    assert {c.request_id: c.reward for c in clean} == pytest.approx(reference(plan, AGENT), abs=1e-12)
    noisy = [*events_of(plan), *hostile(plan)]
    rng.shuffle(noisy)
    assert credit_of(noisy, plan) == clean
    rng.shuffle(noisy)
    assert credit_of(noisy, plan) == clean


@pytest.mark.parametrize("seed", range(40))
def test_every_served_turn_carries_the_return_plus_its_own_penalty(seed: int) -> None:
    plan = random_plan(random.Random(1000 + seed))
    session = assemble(SID, events_of(plan), at(60.0 * len(plan.turns) + 10 * 86_400), AGENT.window)
    got = credit(session, plan.facts(), AGENT)
    ret = sum(session_return(session, plan.facts(), AGENT).values())
    penalties = [c.components["invalid_tool_calls"] for c in got]
    assert all(c.reward == sum(c.components.values()) for c in got)
    assert all(c.reward - p == pytest.approx(ret, abs=1e-12) for c, p in zip(got, penalties, strict=True))
    assert sum(c.reward for c in got) == pytest.approx(len(got) * ret + sum(penalties), abs=1e-9)
    assert all(-AGENT.invalid_max_per_turn <= p <= 0 for p in penalties)
    assert len(got) == sum(1 for t in plan.turns if t.facts is not None)
