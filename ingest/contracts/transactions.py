"""Kafka transactional ids of the exactly-once workers (ingest and reward).

A transactional id names one producer across restarts so the broker can fence a dead
predecessor: a replica with a stable identity (a StatefulSet pod's instance id, or a
configured base) counts generations in Redis (``ingest.contracts.keys``) and uses
``<base><sep><generation>``; a process without one uses an id unique to it.
"""

from __future__ import annotations


def ingest_base(group_id: str, instance_id: str) -> str:
    """``rtrl-ingest.<group>.<instance>``: the ingest replica's ids, before the generation."""
    return f"rtrl-ingest.{group_id}.{instance_id}"


def generation_id(base: str, sep: str, generation: int) -> str:
    """``<base><sep><generation>`` (ingest uses ``.``, reward ``-``)."""
    return f"{base}{sep}{generation}"


def generation_of(txn_id: str, sep: str) -> int:
    """The generation a :func:`generation_id` carries."""
    return int(txn_id.rsplit(sep, 1)[1])


def process_id(service: str, group_id: str, host: str, pid: int, nonce: str) -> str:
    """``rtrl-<service>.<group>.<host>-<pid>-<nonce>``: unique to one process."""
    return f"rtrl-{service}.{group_id}.{host}-{pid}-{nonce}"
