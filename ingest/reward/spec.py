"""The reward spec: a versioned TOML file that defines how feedback becomes a reward.

The packaged default lives at ``ingest/reward/specs/default.toml`` (its comments document every
field); ``ingest/reward/specs/agent.toml`` adds the session terms (``[session]``) to it;
``Settings.reward_spec`` points at another file. ``load_spec`` validates the file
and names the offending field on error, so a bad spec stops the reward service at start-up
instead of producing wrong rewards.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ingest.reward.sessions import SessionWindow

PositiveSeconds = Annotated[int, Field(gt=0, le=30 * 86_400)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PersistenceSpec(_Frozen):
    horizons_s: Annotated[tuple[PositiveSeconds, ...], Field(min_length=1)] = (30, 600, 3600)
    """Horizons (s after the edit) at which clients report persistence."""
    primary_horizon_s: PositiveSeconds = 600
    """The horizon whose retained/inserted ratio enters the reward."""
    weight: float = 1.0

    @model_validator(mode="after")
    def _primary_is_a_horizon(self) -> PersistenceSpec:
        if self.primary_horizon_s not in self.horizons_s:
            raise ValueError(
                f"primary_horizon_s={self.primary_horizon_s} is not one of horizons_s={list(self.horizons_s)}"
            )
        if len(set(self.horizons_s)) != len(self.horizons_s):
            raise ValueError(f"horizons_s has duplicates: {list(self.horizons_s)}")
        return self

    @property
    def max_horizon_s(self) -> int:
        return max(self.horizons_s)


class AcceptanceSpec(_Frozen):
    accepted: float = 0.75
    rejected: float = -0.25


class LatencySpec(_Frozen):
    slo_ms: Annotated[float, Field(gt=0)] = 2000.0
    weight: Annotated[float, Field(ge=0)] = 0.1
    cap: Annotated[float, Field(ge=0)] = 1.0


class DissatisfiedSpec(_Frozen):
    penalty: Annotated[float, Field(ge=0)] = 0.5
    max_count: Annotated[int, Field(ge=0)] = 1


class ToolCallSpec(_Frozen):
    invalid_penalty: Annotated[float, Field(ge=0)] = 0.25
    max_penalty: Annotated[float, Field(ge=0)] = 1.0


class NoEditSpec(_Frozen):
    question: Annotated[float, Field(ge=0)] = 0.0
    empty: Annotated[float, Field(ge=0)] = 0.0


class WindowSpec(_Frozen):
    default_reward: float = 0.0
    grace_s: Annotated[float, Field(ge=0)] = 30.0
    followup_s: Annotated[float, Field(ge=0)] = 60.0


class SessionSpec(_Frozen):
    """Session terms and the session window (docs/rewards.md, "Sessions"). A spec without a
    ``[session]`` table defines no session rewards; its per-request rewards are unchanged."""

    completed: float = 1.0
    """The outcome term: the session ended ``completed``."""
    handed_back: float = 0.0
    abandoned: float = -0.5
    timed_out: float = 0.0
    """No ``session.end`` within the window: nothing is known of the outcome."""
    persisted_edits: Annotated[float, Field(ge=0)] = 1.0
    """Weight of the mean persistence ratio of the session's reported edits."""
    dissatisfied: Annotated[float, Field(ge=0)] = 0.5
    dissatisfied_max_count: Annotated[int, Field(ge=0)] = 2
    per_turn: Annotated[float, Field(ge=0)] = 0.02
    per_1k_tokens: Annotated[float, Field(ge=0)] = 0.002
    """Per 1000 tokens used (prompt + completion tokens of every served turn)."""
    invalid_tool_call: Annotated[float, Field(ge=0)] = 0.25
    """Charged to the turn that made the call, not shared."""
    invalid_max_per_turn: Annotated[float, Field(ge=0)] = 1.0
    idle_s: Annotated[float, Field(gt=0, le=30 * 86_400)] = 1800.0
    """A session without a ``session.end`` closes this long after its latest event ..."""
    max_s: Annotated[float, Field(gt=0, le=30 * 86_400)] = 86_400.0
    """... or this long after its earliest, whichever comes first."""
    max_turns: Annotated[int, Field(gt=0)] = 10_000
    """More turns than this is flagged (``too_many_turns``); every turn is still credited."""

    @property
    def window(self) -> SessionWindow:
        return SessionWindow(idle_s=self.idle_s, max_s=self.max_s, max_turns=self.max_turns)


class RewardSpec(_Frozen):
    """One version of the reward definition (see ingest/reward/specs/default.toml for field docs)."""

    version: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:\-]+$")]
    persistence: PersistenceSpec = PersistenceSpec()
    acceptance: AcceptanceSpec = AcceptanceSpec()
    latency: LatencySpec = LatencySpec()
    dissatisfied: DissatisfiedSpec = DissatisfiedSpec()
    tool_calls: ToolCallSpec = ToolCallSpec()
    no_edit: NoEditSpec = NoEditSpec()
    window: WindowSpec = WindowSpec()
    session: SessionSpec | None = None
    """Session terms; None (no ``[session]`` table): no session rewards."""

    @property
    def window_s(self) -> float:
        """How long a request stays open at most: the largest horizon plus grace."""
        return self.persistence.max_horizon_s + self.window.grace_s


class SpecError(ValueError):
    """The reward spec file is missing, is not TOML, or has invalid fields."""


def default_spec_text() -> str:
    return resources.files("ingest.reward").joinpath("specs/default.toml").read_text(encoding="utf-8")


def agent_spec_text() -> str:
    """The packaged ``agent-v1``: the default plus the session terms (``[session]``)."""
    return resources.files("ingest.reward").joinpath("specs/agent.toml").read_text(encoding="utf-8")


def parse_spec(text: str, source: str = "<string>") -> RewardSpec:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"reward spec {source} is not valid TOML: {exc}") from exc
    try:
        return RewardSpec.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}" for err in exc.errors()
        )
        raise SpecError(f"reward spec {source} is invalid: {problems}") from exc


def load_spec(path: Path | str | None = None) -> RewardSpec:
    """Load and validate a spec file; None loads the packaged default."""
    return parse_spec(spec_text(path), "ingest/reward/specs/default.toml" if path is None else str(path))


def spec_text(path: Path | str | None = None) -> str:
    """A spec file's text as written (None: the packaged default's)."""
    if path is None:
        return default_spec_text()
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read reward spec {path}: {exc}") from exc
