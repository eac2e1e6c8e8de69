"""Every Redis key rtrl reads or writes, built here and nowhere else.

All keys start with the deployment's ``redis.key_prefix`` (default ``rtrl:``), so several
deployments (or test sessions) can share one Redis. Each function names the structure, who
writes it and who reads it; ``tests/unit/test_layout.py`` fails when a key is built elsewhere.

=====================================  ==========  ======================  =====================
key                                    type        written by              read by
=====================================  ==========  ======================  =====================
``routing:<field>``                    string      deployer                gateway, demo, CLI
``engine:model:<version>``             string      deployer (engine port)  gateway
``engine:state:<version>``             string      deployer (engine port)  deployer
``deployer:status``                    string      deployer                CLI, demo
``deployer:lease``                     string      deployer                deployer
``deployer:commands``                  list        CLI (operator)          deployer
``deployer:wake``                      hash        trainer, demo           deployer
``deployer:executed:<command id>``     string      deployer                deployer
``registry:candidate-lock``            string      trainer                 trainer
``trainer:cadence``                    string      trainer                 CLI
``holdout:report``                     string      deployer                CLI
``gateway:served:<version>:<arm>``     hash        gateway                 deployer
``gateway:rid:<request id>``           string      gateway                 gateway
``ingest:dedup:<event id>``            string      ingest                  ingest
``ingest:txn-generation:<g>:<i>``      counter     ingest                  ingest
``reward:...``                         (join)      reward                  reward
=====================================  ==========  ======================  =====================
"""

from __future__ import annotations

from collections.abc import Iterable

ROUTING_FIELDS = ("canary_weight", "salt", "stable_version", "canary_version", "holdout")
"""The routing table's fields (deployer/routing.py says what each means)."""


def routing_key(prefix: str, field: str) -> str:
    """``routing:<field>``: one field of the routing table the gateway polls."""
    return f"{prefix}routing:{field}"


def routing_keys(prefix: str, fields: Iterable[str] = ROUTING_FIELDS) -> dict[str, str]:
    """field -> key for the routing table's fields."""
    return {name: routing_key(prefix, name) for name in fields}


def engine_model_key(prefix: str, version: str) -> str:
    """``engine:model:<version>``: the model name under which the inference engine serves a
    registered version that passed its check (absent: not loaded, or failed)."""
    return f"{prefix}engine:model:{version}"


def engine_state_key(prefix: str, version: str) -> str:
    """``engine:state:<version>``: the engine port's state of a version (``*`` to scan)."""
    return f"{prefix}engine:state:{version}"


def deployer_status_key(prefix: str) -> str:
    """``deployer:status``: the canary controller's persisted status (JSON)."""
    return f"{prefix}deployer:status"


def deployer_lease_key(prefix: str) -> str:
    """``deployer:lease``: which controller may act (one at a time)."""
    return f"{prefix}deployer:lease"


def deployer_commands_key(prefix: str) -> str:
    """``deployer:commands``: signed operator commands waiting for the controller."""
    return f"{prefix}deployer:commands"


def deployer_wake_key(prefix: str) -> str:
    """``deployer:wake``: a counter (``n``) and the last reason (``reason``) that writers bump
    after changing what the deployer acts on (a new candidate), so it ticks at once."""
    return f"{prefix}deployer:wake"


def deployer_executed_key(prefix: str, command_id: str = "") -> str:
    """``deployer:executed:<command id>``: a command already carried out (replay guard)."""
    return f"{prefix}deployer:executed:{command_id}"


def candidate_lock_key(prefix: str) -> str:
    """``registry:candidate-lock``: held while a trainer moves the candidate alias."""
    return f"{prefix}registry:candidate-lock"


def cadence_key(prefix: str) -> str:
    """``trainer:cadence``: the trainer's schedule (JSON, with a TTL): last and next
    increments, for ``rtrl status``."""
    return f"{prefix}trainer:cadence"


def holdout_report_key(prefix: str) -> str:
    """``holdout:report``: the deployer's latest champion-vs-holdout measurement (JSON)."""
    return f"{prefix}holdout:report"


def served_key(prefix: str, version: str, arm: str) -> str:
    """``gateway:served:<version>:<arm>``: requests and errors per time bucket (a hash)."""
    return f"{prefix}gateway:served:{version}:{arm}"


def request_id_key(prefix: str, request_id: str) -> str:
    """``gateway:rid:<request id>``: a client-supplied request id, claimed once."""
    return f"{prefix}gateway:rid:{request_id}"


def dedup_prefix(prefix: str) -> str:
    """``ingest:dedup:``, followed by an event id: the event's claim (SET NX with a TTL)."""
    return f"{prefix}ingest:dedup:"


def ingest_txn_generation_key(prefix: str, group_id: str, instance_id: str) -> str:
    """``ingest:txn-generation:<group>:<instance>``: the ingest replica's generation counter."""
    return f"{prefix}ingest:txn-generation:{group_id}:{instance_id}"


def reward_txn_generation_key(prefix: str, base: str) -> str:
    """``reward:txgen:<base>``: the reward replica's generation counter."""
    return f"{prefix}reward:txgen:{base}"


def fenced_key(generation_key: str) -> str:
    """``<generation key>:fenced``: generations up to this one are fenced."""
    return f"{generation_key}:fenced"


def reward_join_prefix(prefix: str) -> str:
    """``reward:``: the reward join's state (``w:<rid>`` open windows, ``done:<rid>`` closed
    requests, ``due:<partition>`` close times, ``ckpt:<partition>`` checkpoints)."""
    return f"{prefix}reward:"
