"""The report of ``rtrl reconcile`` (services/cli/reconcile.py): what the accounting found,
its verdict, and the text and JSON it prints."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

LIST_LIMIT = 20
"""Most ids listed per problem in the text report (the JSON report lists them all)."""


@dataclass
class Report:
    """Every record of the four topics accounted for; ``ok`` when nothing is lost or duplicated."""

    raw_records: int = 0
    raw_forwarded: int = 0
    raw_dead_lettered: int = 0
    dead_lettered_by_reason: dict[str, int] = field(default_factory=dict)
    raw_duplicates_dropped: int = 0
    """Raw records whose event_id was forwarded from another position (retries, replays)."""
    raw_pending: int = 0
    """Raw records at or after the ingest group's committed offset (not processed yet)."""
    raw_lost: list[str] = field(default_factory=list)
    """Raw positions ``p:o`` neither forwarded, dead-lettered, dropped nor pending."""
    raw_double_handled: list[str] = field(default_factory=list)
    """Raw positions forwarded more than once, or both forwarded and dead-lettered."""
    dlq_records: int = 0
    dlq_other_source: int = 0
    """DLQ records whose source is not a raw record read here (another topic, retention)."""
    dlq_unreadable: int = 0
    """DLQ records that are not DLQ records of rtrl's format (counted among ``dlq_other_source``)."""
    forwarded_events: int = 0
    forwarded_unparseable: int = 0
    forwarded_without_raw: int = 0
    """Forwarded events whose raw source was not read (retention, or written directly)."""
    duplicate_forwarded: dict[str, int] = field(default_factory=dict)
    """event_id -> times forwarded, for those forwarded more than once."""
    requests_served: int = 0
    reward_records: int = 0
    rewarded_requests: int = 0
    duplicate_rewards: dict[str, int] = field(default_factory=dict)
    """request_id -> reward records, for those with more than one."""
    lost_rewards: list[str] = field(default_factory=list)
    """Requests whose reward is due (closed by their events, or past the due time) but absent."""
    open_requests: int = 0
    """Requests (served or not) not due yet, or whose events the reward group has not committed."""
    orphan_requests: list[str] = field(default_factory=list)
    """Requests with feedback events but no served event (never rewarded by design)."""
    rewards_without_events: int = 0
    """Reward records for requests with no event read here (events topic retention)."""
    rewards_unreadable: int = 0
    """Records on the rewards topic with neither a key nor a readable ``request_id``."""
    unreflected_events: int = 0
    """Raw records neither in a reward (through their request) nor in the DLQ nor dropped."""

    @property
    def lost(self) -> int:
        return len(self.raw_lost) + len(self.lost_rewards)

    @property
    def duplicated(self) -> int:
        return len(self.duplicate_forwarded) + len(self.duplicate_rewards) + len(self.raw_double_handled)

    @property
    def all_reflected(self) -> bool:
        return self.unreflected_events == 0

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated == 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(lost=self.lost, duplicated=self.duplicated, all_reflected=self.all_reflected, ok=self.ok)
        return d

    def render(self) -> str:
        def ids(xs: Iterable[str]) -> str:
            xs = list(xs)
            more = f" (+{len(xs) - LIST_LIMIT} more)" if len(xs) > LIST_LIMIT else ""
            return ", ".join(xs[:LIST_LIMIT]) + more

        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.dead_lettered_by_reason.items())) or "none"
        lines = [
            f"raw records           {self.raw_records}",
            f"  forwarded           {self.raw_forwarded}",
            f"  dead-lettered       {self.raw_dead_lettered}  ({reasons})",
            f"  duplicates dropped  {self.raw_duplicates_dropped}",
            f"  not processed yet   {self.raw_pending}",
            f"  LOST                {len(self.raw_lost)}"
            + (f"  {ids(self.raw_lost)}" if self.raw_lost else ""),
            f"  handled twice       {len(self.raw_double_handled)}"
            + (f"  {ids(self.raw_double_handled)}" if self.raw_double_handled else ""),
            f"forwarded events      {self.forwarded_events}  (unparseable {self.forwarded_unparseable}, "
            f"without a raw record read {self.forwarded_without_raw})",
            f"  DUPLICATE event ids {len(self.duplicate_forwarded)}"
            + (f"  {ids(self.duplicate_forwarded)}" if self.duplicate_forwarded else ""),
            f"dlq records           {self.dlq_records}  (source not among raw records read: "
            f"{self.dlq_other_source}, unreadable {self.dlq_unreadable})",
            f"served requests       {self.requests_served}",
            f"reward records        {self.reward_records}  for {self.rewarded_requests} requests "
            f"({self.rewards_without_events} without events read, unreadable {self.rewards_unreadable})",
            f"  DUPLICATE rewards   {len(self.duplicate_rewards)}"
            + (f"  {ids(f'{k} x{v}' for k, v in self.duplicate_rewards.items())}"
               if self.duplicate_rewards else ""),
            f"  LOST rewards        {len(self.lost_rewards)}"
            + (f"  {ids(self.lost_rewards)}" if self.lost_rewards else ""),
            f"  still open          {self.open_requests}",
            f"  orphan requests     {len(self.orphan_requests)}"
            + (f"  {ids(self.orphan_requests)}" if self.orphan_requests else ""),
            f"every event reflected in a reward or the DLQ: "
            f"{'yes' if self.all_reflected else f'no ({self.unreflected_events} not yet or never)'}",
            f"verdict: {'OK' if self.ok else 'FAILED'}: {self.lost} lost, {self.duplicated} duplicated",
        ]
        return "\n".join(lines)
