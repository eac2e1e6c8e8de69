"""Helpers for the deployer integration tests: registered versions, synthetic reward
records for the stable and canary cohorts on the rewards topic, and a controller wired to
real Redis, Kafka and MLflow."""

from __future__ import annotations

import json
import random
import uuid
from datetime import UTC, datetime
from pathlib import Path

from deployer.adapters.mlflow_registry import MlflowRegistry
from deployer.ledger import TAG_GATE
from deployer.operators import key_line, sign
from deployer.status import Command
from ingest.events import ModelRef, RewardRecord
from services.runtime.kafka_io import ensure_topics, make_producer
from services.settings.deployer import DeployerSettings
from services.settings.model import MlflowSettings, Settings
from services.settings.operators import OperatorSettings

QUALITY = {
    # arm quality -> (reward mean, acceptance probability, persistence mean, latency mean)
    "stable": (0.5, 0.95, 0.80, 200.0),
    "better": (0.6, 0.99, 0.85, 190.0),
    "worse": (0.1, 0.5, 0.50, 200.0),
}


def deployer_settings(settings: Settings, tracking_uri: str, **deployer: object) -> Settings:
    """The fixture's settings with MLflow at ``tracking_uri``, a fresh registered model and
    a short canary schedule."""
    tag = uuid.uuid4().hex[:6]
    d = {"tick_s": 0.2, "steps": (0.1, 0.5), "bake_s": 0.5, "max_duration_s": 120.0,
         "lease_ttl_s": 2.0, "judge_min_users": 30, "poll_timeout_ms": 200, **deployer}
    return settings.model_copy(update={
        "mlflow": MlflowSettings(tracking_uri=tracking_uri, registered_model=f"rtrl-policy-{tag}",
                                 deployments_experiment=f"rtrl-deployments-{tag}"),
        "deployer": DeployerSettings(**d),  # type: ignore[arg-type]
    })


def with_operators(settings: Settings, tmp: Path, *names: str) -> tuple[Settings, dict[str, Path]]:
    """The settings with an operator keys file for ``names``, and each operator's token file
    (for the CLI's ``--token-file``)."""
    tokens = {name: tmp / f"{name}.token" for name in names}
    for name, path in tokens.items():
        path.write_text(f"{name}-{uuid.uuid4().hex}\n")
    keys = tmp / "operator-keys"
    keys.write_text("".join(key_line(n, p.read_text().strip()) + "\n" for n, p in tokens.items()))
    return settings.model_copy(update={"operators": OperatorSettings(keys_file=keys)}), tokens


def operator_command(tokens: dict[str, Path], by: str, kind: str, version: str | None = None) -> Command:
    """A manual command signed now with ``by``'s token (from :func:`with_operators`)."""
    import time

    cmd = Command(id=uuid.uuid4().hex, kind=kind, by=by, version=version)  # type: ignore[arg-type]
    return sign(cmd, tokens[by].read_text().strip(), time.time())


def register_versions(settings: Settings, tmp: Path, n: int = 2) -> MlflowRegistry:
    """Versions 1..n with a passed gate; 1 is the champion, n the candidate."""
    reg = MlflowRegistry(settings.mlflow.tracking_uri, settings.mlflow.registered_model)
    src = tmp / "policy"
    src.mkdir(exist_ok=True)
    (src / "policy.json").write_text(json.dumps({"kind": "test"}))
    for i in range(1, n + 1):
        lineage = {"rtrl.parent_version": str(i - 1) if i > 1 else "", "rtrl.reward_spec_version": "test-1"}
        v = reg.register(None, src, tags={TAG_GATE: "pass", **lineage})
        assert v == str(i)
    reg.set_alias("champion", "1")
    reg.set_alias("candidate", str(n))
    return reg


def reward_record(arm: str, version: str, quality: str, i: int, rng: random.Random,
                  served_at: datetime | None = None) -> RewardRecord:
    reward, p_acc, persist, latency = QUALITY[quality]
    now = served_at or datetime.now(UTC)
    rid = f"{arm}-{version}-{i}-{uuid.uuid4().hex[:6]}"
    return RewardRecord(
        request_id=rid, served_event_id=f"{rid}-s", session_id="s", user_key=f"u-{arm}-{i}",
        served_ts=now, closed_ts=now, model=ModelRef(name="rtrl-policy", version=version),
        arm=arm,  # type: ignore[arg-type]
        prompt_tokens=[1, 2], completion_tokens=[3, 4, 5, 6, 7, 8, 9, 10], behavior_logprobs=[-0.5] * 8,
        latency_ms=max(1.0, rng.gauss(latency, 10.0)), tool_calls=1,
        accepted=rng.random() < p_acc,
        persistence={"3600": min(1.0, max(0.0, rng.gauss(persist, 0.05)))},
        reward=rng.gauss(reward, 0.1), components={"persistence": persist}, reward_spec_version="test-1",
    )


def feed_rewards(settings: Settings, stable: str, canary: str, quality: str, n: int = 500,
                 seed: int = 0) -> None:
    """n records per arm on the rewards topic, served now."""
    feed_arms(settings, [("stable", stable, "stable"), ("canary", canary, quality)], n, seed)


def feed_arms(settings: Settings, arms: list[tuple[str, str, str]], n: int = 500, seed: int = 0,
              served_at: datetime | None = None) -> None:
    """n records for each (arm, version, quality) on the rewards topic, served now (or at
    ``served_at``)."""
    ensure_topics(settings, [settings.topics.rewards])
    rng = random.Random(seed)
    producer = make_producer(settings.kafka)
    try:
        for i in range(n):
            for arm, version, q in arms:
                rec = reward_record(arm, version, q, i, rng, served_at)
                producer.send(settings.topics.rewards, key=rec.request_id.encode(),
                              value=rec.model_dump_json().encode())
        producer.flush(30)
    finally:
        producer.close()


def rolled_back_canary(settings: Settings, tmp: Path, timeout_s: float = 120.0) -> tuple[object, str]:
    """Versions 1 (champion) and 2 (candidate); the real controller canaries 2 against worse
    rewards until it rolls it back. Returns the controller and the canary id."""
    import time

    from deployer.status import Phase
    from services.wiring.deployer import build_controller, build_ports, reward_reader

    register_versions(settings, tmp)
    controller = build_controller(settings, build_ports(settings), reward_reader(settings))
    first = controller.step()
    assert first is not None and first.canary_id is not None
    feed_rewards(settings, "1", "2", "worse", n=100)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = controller.step()
        assert status is not None, "the controller lost its lease"
        if status.phase in (Phase.ROLLED_BACK, Phase.ABORTED, Phase.SUCCEEDED):
            assert status.phase == Phase.ROLLED_BACK, status
            return controller, first.canary_id
        time.sleep(settings.deployer.tick_s)
    raise AssertionError(f"no decision within {timeout_s}s")
