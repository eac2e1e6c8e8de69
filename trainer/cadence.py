"""When the next increment starts: an adaptive cadence that wastes no increment.

An increment starts when

- the interval has passed since the last one (``trainer.interval_s``; a run the interval
  asked for and that had to wait stays *due* until it happens), **or**
- enough reward-complete records have arrived since the cut: at least
  ``trainer.trigger.min_records`` records (0: the interval alone) whose users give an
  effective sample size of at least ``trainer.trigger.min_ess``,

and never while a canary is in flight: a candidate trained then could not be offered (the
canary keeps the ``candidate`` alias until it is decided), so it would be trained for nothing,
from a champion that may be about to change. Once the canary is decided, the increment that
waited starts from the champion of that moment, and the records served during the canary are
classified by its outcome (a promoted version's records are trained on, a rolled-back one's are
excluded), not dropped for being served by an undecided version.

The effective sample size is Kish's, over users: ``(sum n_u)^2 / sum n_u^2`` for ``n_u``
records of user ``u``. Ten thousand records from one user are worth one; from ten thousand
users, ten thousand.

:func:`decide` is the rule; :class:`RecordTally` counts the records after the cut through the
:class:`~trainer.window.RewardLog` port, reading each record once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pydantic import ValidationError

from ingest.events import RewardRecord
from trainer.window import RewardLog, plan_window


@dataclass(frozen=True)
class Trigger:
    """The early trigger on arrived records (``trainer.trigger``)."""

    min_records: int = 0
    """Records since the cut that start an increment before the interval; 0 turns it off."""
    min_ess: float = 0.0
    """And the effective sample size (over users) they must reach."""


@dataclass(frozen=True)
class Readiness:
    """What the rule looks at, at one moment."""

    due: bool
    """The interval has passed since the last increment (or a run it asked for is waiting)."""
    records: int
    """Reward records after the cut that an increment would train on."""
    ess: float
    """Their effective sample size over users."""
    canary: str | None
    """The version under canary (the ``candidate`` alias, undecided), or None."""
    resting: bool = False
    """The last increment the records started did not register a candidate (it failed, or its
    window was too small once split and filtered), less than ``trainer.trigger.retry_s`` ago:
    the records trigger rests so it does not start the same failing increment at every check."""


@dataclass(frozen=True)
class Decision:
    start: bool
    trigger: str
    """Why it starts: ``interval`` or ``records``; ``""`` when it waits."""
    reason: str
    """One line for the log, the metrics' label and ``rtrl status``."""
    waiting_for: str = ""
    """What it waits for: ``canary``, ``records`` or ``""``."""


def kish_ess(counts: Iterable[int]) -> float:
    """Kish's effective sample size of records clustered by user: ``(sum n)^2 / sum n^2``."""
    total = squares = 0
    for n in counts:
        total += n
        squares += n * n
    return total * total / squares if squares else 0.0


def decide(r: Readiness, trigger: Trigger) -> Decision:
    """Start now, or wait (and for what)."""
    if r.canary is not None:
        return Decision(False, "", f"canary v{r.canary} in flight: a candidate trained now could not be "
                                   "offered; the increment starts once it is decided", "canary")
    if r.due:
        return Decision(True, "interval", f"interval passed ({r.records} records since the cut)")
    if trigger.min_records > 0 and r.resting:
        return Decision(False, "", "the last increment started by records registered no candidate: the "
                                   "records trigger rests (trainer.trigger.retry_s); or the interval",
                        "records")
    if trigger.min_records > 0 and r.records >= trigger.min_records and r.ess >= trigger.min_ess:
        return Decision(True, "records", f"{r.records} records (>= {trigger.min_records}), "
                                         f"effective sample size {r.ess:.0f} (>= {trigger.min_ess:g})")
    if trigger.min_records > 0 and r.records < trigger.min_records:
        return Decision(False, "", f"{r.records} of {trigger.min_records} records (effective sample size "
                                   f"{r.ess:.1f} of {trigger.min_ess:g}), or the interval", "records")
    if trigger.min_records > 0:
        return Decision(False, "", f"{r.records} records, but an effective sample size of {r.ess:.1f} of "
                                   f"{trigger.min_ess:g}: too few distinct users; or the interval", "records")
    return Decision(False, "", "waiting for the interval", "")


@dataclass
class RecordTally:
    """The valid reward records after the cut, counted per served version and user.

    Each :meth:`update` reads only what arrived since the last one; when the cut moves (an
    increment committed its window) the tally starts again from the new cut."""

    topic: str
    cut: dict[int, int] = field(default_factory=dict)
    read_to: dict[int, int] = field(default_factory=dict)
    counts: dict[str, Counter[str]] = field(default_factory=dict)
    invalid: int = 0

    def update(self, rewards: RewardLog) -> None:
        committed, beginnings, ends = rewards.positions()
        cut = {p: max(c if c is not None else 0, beginnings.get(p, 0)) for p, c in committed.items()}
        if cut != self.cut:
            self.cut, self.read_to, self.counts, self.invalid = cut, dict(cut), {}, 0
        window = plan_window(self.topic, self.read_to, beginnings, ends)
        if window.offsets == 0:
            return
        for _, _, raw in rewards.read(window):
            try:
                rec = RewardRecord.model_validate_json(raw)
            except ValidationError:
                self.invalid += 1
                continue
            self.counts.setdefault(rec.model.version, Counter())[rec.user_key] += 1
        self.read_to = window.ends()

    def figures(self, keep: Callable[[str], bool] = lambda _v: True) -> tuple[int, float]:
        """Records and their effective sample size, over the versions ``keep`` accepts (the
        trainer's ``train_on`` rule)."""
        per_user: Counter[str] = Counter()
        for version, users in self.counts.items():
            if keep(version):
                per_user.update(users)
        return sum(per_user.values()), kish_ess(per_user.values())
