"""What the model registry (MLflow) and the decision ledger say, and how: aliases, tag keys,
and the files a registered policy directory holds.

The trainer writes versions with these tags, the deployer moves the aliases and writes the
ledger, the CLI and the demo read both; product reviewers read the same keys in MLflow's UI.
"""

from __future__ import annotations

# ------------------------------------------------------------------------------- aliases
CHAMPION = "champion"
"""Serves the stable arm."""
CANDIDATE = "candidate"
"""The version under canary (or waiting for one)."""
PREVIOUS = "previous"
"""The champion before the current one."""
ALIASES = (CHAMPION, CANDIDATE, PREVIOUS)
OUTCOME_RUNNING = "running"
"""``rtrl.canary.outcome`` of a version whose canary is in progress."""


class Tag:
    """Version tag keys. Values are strings; structured values are JSON."""

    PARENT_VERSION = "rtrl.parent_version"
    """The version this one was trained from ("" for a bootstrap)."""
    WINDOW = "rtrl.window"
    """JSON: topic, partitions, offset ranges and counts of the data window."""
    REWARD_SPEC_VERSION = "rtrl.reward_spec_version"
    KIND = "rtrl.kind"
    """bootstrap | increment (other values, e.g. corrupted, are test fixtures)."""
    GATE_RESULT = "rtrl.gate.result"
    """pass | fail. A version tagged fail is never canaried."""
    GATE_REASONS = "rtrl.gate.reasons"
    """JSON list of the checks that failed (empty on pass) and the gate's figures."""
    CANARY_OUTCOME = "rtrl.canary.outcome"
    """``running`` while under canary, then promoted | rolled_back | aborted."""
    DECISION = "rtrl.decision"
    DECISION_REASON = "rtrl.decision.reason"
    DECISION_REASONS = "rtrl.decision.reasons"
    """The judge's reasons behind ``rtrl.decision.reason``, a JSON list, one per metric."""
    DECIDED_BY = "rtrl.decided_by"
    RUN_ID = "rtrl.run_id"
    """The MLflow run that produced the version (the fake stores what it is given)."""
    POLICY_KIND = "rtrl.policy.kind"
    """The saved policy's kind (``tiny-transformer``, ``hf``, ``hf-lora``)."""
    BASE_MODEL = "rtrl.base_model"
    """A LoRA version's base model directory, where it was trained."""
    BASE_SHA256 = "rtrl.base_sha256"
    """A LoRA version's base model and tokenizer, by content hash (trainer/lora_policy.py)."""


# ------------------------------------------------------- a version's life (deployer/records.py)
FATE = "rtrl.fate"
CHAMPION_SINCE = "rtrl.champion_since"
"""When the version became the champion (UTC, ISO 8601)."""
CHAMPION_UNTIL = "rtrl.champion_until"
"""When a newer decision replaced it as champion."""
CHAMPION_SUCCESSOR = "rtrl.champion_successor"
"""The version that replaced it as champion (empty while it is the champion)."""
LEDGER_RUN = "rtrl.canary.run_id"
"""The ledger run of the version's latest canary (the adapter fills it in for links)."""

# ------------------------------------------------------- the decision ledger (one run a canary)
TAG_CANARY_ID = "rtrl.canary.id"
TAG_CANDIDATE = "rtrl.candidate_version"
TAG_STABLE = "rtrl.stable_version"
TAG_KIND = "rtrl.canary.kind"
TAG_DECIDED_AT = "rtrl.decided_at"
TAG_CLAIMED_BY = "rtrl.operator.claimed"
TAG_HOLDOUT_VERSION = "rtrl.holdout.version"
TAG_HOLDOUT_SHARE = "rtrl.holdout.share"
TAG_HOLDOUT_END = "rtrl.holdout.end"

# ------------------------------------------------------------------- a training run's tags
RUN_OUTCOME = "rtrl.outcome"
"""success | failed | skipped | interrupted (its trainer stopped before it finished: KILLED)."""
RUN_VERSION = "rtrl.version"
"""The registered version a successful run produced."""
RUN_SKIP_REASON = "rtrl.skip_reason"
RUN_BAND_STOP = "rtrl.band.stop"
"""Why the KL band's probe stopped the increment (trainer/trust_region.py)."""
RUN_RETRY = "rtrl.retry"
RUN_RESUMED_BY = "rtrl.resumed_by"
"""An interrupted run's successor: the run that trained its window again."""
NOTE = "mlflow.note.content"
"""MLflow's description of a run or version (markdown), shown on its page."""

# ------------------------------------------------------- files of a registered policy directory
POLICY_MANIFEST = "policy.json"
"""The manifest every saved policy directory holds (trainer/policy.py writes it)."""
ADAPTER_DIR = "adapter"
"""A LoRA version's adapter, as the inference engine loads it."""
CHECK_FILE = "engine_check.json"
"""A version's own log-probabilities of the engine check (deployer/engine.py)."""
