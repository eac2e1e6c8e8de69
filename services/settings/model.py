"""Settings: the one place where rtrl reads its environment.

Every service builds one frozen settings object at start-up from ``RTRL_*`` variables
(nested fields use ``__``, e.g. ``RTRL_KAFKA__BOOTSTRAP_SERVERS``). The same code runs
against the embedded stack (``rtrl up``) and against production Kafka, Redis and MLflow:
only these values change. Secrets are ``SecretStr`` so they never print in logs or reprs.

This module holds the infrastructure sections (Kafka, topics, Redis, MLflow, Ray, auth,
HTTP, the embedded stack) and ``Settings``, which composes them with the per-service
sections of services/settings/services.py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict
from pydantic_settings.sources.utils import parse_env_vars

from services.settings.cli import CliSettings
from services.settings.demo import DemoSettings, SimulatorSettings
from services.settings.deployer import DeployerSettings
from services.settings.engine import EngineSettings
from services.settings.notify import NotifySettings
from services.settings.operators import OperatorSettings
from services.settings.services import (
    GatewaySettings,
    IngestSettings,
    RewardSettings,
    Section,
    TrainerSettings,
)


class KafkaSettings(Section):
    """How to reach the Kafka-protocol broker."""

    bootstrap_servers: str = "127.0.0.1:9092"
    """Comma-separated host:port list."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """As in the Kafka client configuration; SASL_SSL for most managed clusters."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    """SASL mechanism when security_protocol uses SASL."""
    sasl_username: str | None = None
    """SASL user name when security_protocol uses SASL."""
    sasl_password: SecretStr | None = None
    """SASL password when security_protocol uses SASL."""
    ssl_cafile: str | None = None
    """CA bundle that signs the brokers' certificates (Strimzi: the cluster CA)."""
    ssl_certfile: str | None = None
    """Client certificate for mutual TLS."""
    ssl_keyfile: str | None = None
    """Private key of the client certificate."""
    client_id: str = "rtrl"
    """Client id the broker sees in its logs and quotas."""
    client: Literal["kafka-python", "librdkafka"] = "kafka-python"
    """The Kafka client of the ingest and reward workers' exactly-once loop: kafka-python, or
    librdkafka through confluent-kafka (services/runtime/rdkafka.py). The same connection,
    TLS and SASL settings apply to both; other rtrl processes use kafka-python."""
    request_timeout_ms: int = 30_000
    """Longest wait for one broker request."""
    bootstrap_timeout_ms: Annotated[int, Field(ge=100)] = 30_000
    """How long a client waits for the first broker to answer (kafka-python's default). The
    ``rtrl`` operator commands lower it, with ``request_timeout_ms``, to a few seconds."""
    max_message_bytes: Annotated[int, Field(ge=64 * 1024)] = 1_000_000
    """The largest record on any rtrl topic, measured as Kafka does (a record batch holding
    the record: key, value, headers and framing). rtrl's producers refuse a bigger record
    before sending it, and the topics rtrl creates get it as ``max.message.bytes``. The
    default is librdkafka's ``message.max.bytes`` and fits a broker's default 1 MiB. It must
    exceed ``RTRL_INGEST__MAX_BYTES`` (the largest event) by at least 1 KiB."""

    def client_kwargs(self) -> dict[str, object]:
        """Keyword arguments shared by kafka-python producers, consumers and admins."""
        kw: dict[str, object] = {
            "bootstrap_servers": [s.strip() for s in self.bootstrap_servers.split(",") if s.strip()],
            "security_protocol": self.security_protocol,
            "client_id": self.client_id,
            "request_timeout_ms": self.request_timeout_ms,
            "bootstrap_timeout_ms": self.bootstrap_timeout_ms,
        }
        if self.sasl_mechanism:
            kw["sasl_mechanism"] = self.sasl_mechanism
            kw["sasl_plain_username"] = self.sasl_username
            kw["sasl_plain_password"] = (
                self.sasl_password.get_secret_value() if self.sasl_password else None
            )
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            if getattr(self, name):
                kw[name] = getattr(self, name)
        return kw


class TopicSettings(Section):
    """Topic names (the v1 contract's defaults) and how rtrl creates them when absent."""

    raw: str = "rtrl.raw.v1"
    """Untrusted input from clients and the serving layer."""
    events: str = "rtrl.events.v1"
    """Validated, deduplicated events keyed by request_id."""
    rewards: str = "rtrl.rewards.v1"
    """One closed reward record per served completion."""
    dlq: str = "rtrl.dlq.v1"
    """Rejected input with the original bytes and a reason."""
    sessions: str = "rtrl.reward-sessions.v1"
    """Internal to the reward workers (only under a spec with a ``[session]`` table): session
    events and closed turns re-keyed by session_id, and the session stage's markers. Retain it
    at least a session's ``max_s`` plus the largest horizon."""
    partitions: int = 4
    """Partitions for topics rtrl creates itself. raw/events/rewards must match."""
    replication_factor: int = 1
    """Replication factor for topics rtrl creates itself (3 on a production cluster)."""
    create: bool = True
    """Create missing topics at start-up (turn off where topics are managed, e.g. Strimzi KafkaTopic)."""


class RedisSettings(Section):
    """How to reach Redis (dedup keys, reward windows, the routing table)."""

    url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    """redis:// or rediss:// URL; may carry a password, hence secret."""
    key_prefix: str = "rtrl:"
    """Prefix for every key rtrl writes, so several installs can share one Redis."""


class MlflowSettings(Section):
    """The MLflow server: model registry, training runs and the decision ledger."""

    tracking_uri: str = "http://127.0.0.1:5000"
    """The MLflow tracking server (registry, training runs, decision ledger)."""
    registered_model: str = "rtrl-policy"
    """Registered model holding every candidate; aliases ``champion`` and ``canary`` mark the arms."""
    training_experiment: str = "rtrl-training"
    """Experiment of the trainer's runs (one per increment)."""
    deployments_experiment: str = "rtrl-deployments"
    """Experiment of the decision ledger (one run per canary)."""
    http_timeout_s: Annotated[int, Field(ge=1)] = 20
    """Timeout of one MLflow HTTP request (MLFLOW_HTTP_REQUEST_TIMEOUT) in the trainer and the
    deployer. MLflow's own default is 120 s."""
    http_max_retries: Annotated[int, Field(ge=0)] = 0
    """Retries inside the MLflow client (MLFLOW_HTTP_REQUEST_MAX_RETRIES) in the trainer and the
    deployer. They retry by themselves (``trainer.registry_retry_s``, the deployer's next tick), so
    the client's own are off: MLflow's default (7, exponential backoff) holds one call ~4 min and
    replays POSTs. An MLFLOW_HTTP_REQUEST_* variable set in the environment wins over both."""


class RaySettings(Section):
    """Where RL increments run: an existing Ray cluster, or a local Ray."""

    address: str | None = None
    """Existing Ray cluster (e.g. ray://head:10001 or auto). None: start local Ray."""
    num_cpus: int = 2
    """CPUs of the local Ray started when ``address`` is none."""
    object_store_mb: int = 200
    """Object store of the local Ray, in MiB."""
    num_workers: Annotated[int, Field(ge=1)] = 1
    """Ray Train workers per increment: data parallel, gradients averaged at every step (gloo on
    CPU, NCCL on GPU); each worker trains on its shard of every batch."""
    cpus_per_worker: Annotated[int, Field(ge=1)] = 1
    """CPUs each Ray Train worker reserves (and the torch threads it runs)."""
    use_gpu: bool = False
    """Give each Ray Train worker a GPU."""


class AuthSettings(Section):
    """Producer authentication for the raw topic (HMAC-SHA256 over the payload)."""

    keys: dict[str, SecretStr] = Field(default_factory=dict)
    """key id -> shared secret. Set as JSON, e.g. RTRL_AUTH__KEYS='{"gateway":"..."}'."""
    allow_unsigned: bool = False
    """Development only: accept events without a signature header."""
    signature_header: str = "rtrl-signature"
    """Kafka header carrying the HMAC-SHA256 signature of a raw record."""
    key_id_header: str = "rtrl-key-id"
    """Kafka header naming the key that signed a raw record."""


class HttpSettings(Section):
    """Each process's own HTTP endpoint (metrics and health checks)."""

    host: str = "127.0.0.1"
    """Address the process's HTTP server listens on (0.0.0.0 in a pod)."""
    port: int = 0
    """Port for /metrics, /healthz and /readyz; 0 picks a free port (printed at start)."""


class StackSettings(Section):
    """The embedded default stack started by ``rtrl up``."""

    data_dir: Path = Path(".rtrl")
    """Where ``rtrl up`` keeps the embedded broker's, Redis's and MLflow's data and logs."""
    kafka_port: int = 9092
    """Port of the embedded Kafka-protocol broker."""
    redis_port: int = 6390
    """Port of the embedded Redis."""
    mlflow_port: int = 5000
    """Port of the embedded MLflow server."""


class Settings(BaseSettings):
    """All of rtrl's configuration. Each service reads the parts it needs."""

    model_config = SettingsConfigDict(
        env_prefix="RTRL_", env_nested_delimiter="__", frozen=True, extra="ignore",
        use_attribute_docstrings=True,
        env_parse_none_str="null",  # RTRL_GATEWAY__KEY_ID=null: an optional setting set to None
    )

    kafka: KafkaSettings = KafkaSettings()
    topics: TopicSettings = TopicSettings()
    redis: RedisSettings = RedisSettings()
    mlflow: MlflowSettings = MlflowSettings()
    ray: RaySettings = RaySettings()
    auth: AuthSettings = AuthSettings()
    ingest: IngestSettings = IngestSettings()
    reward: RewardSettings = RewardSettings()
    trainer: TrainerSettings = TrainerSettings()
    http: HttpSettings = HttpSettings()
    gateway: GatewaySettings = GatewaySettings()
    engine: EngineSettings = EngineSettings()
    stack: StackSettings = StackSettings()
    simulator: SimulatorSettings = SimulatorSettings()
    demo: DemoSettings = DemoSettings()
    deployer: DeployerSettings = DeployerSettings()
    operators: OperatorSettings = OperatorSettings()
    cli: CliSettings = CliSettings()
    notify: NotifySettings = NotifySettings()
    log_level: str = "INFO"
    """Python logging level of every process (DEBUG, INFO, WARNING, ERROR)."""
    reward_spec: Path | None = None
    """Reward spec file; None uses the packaged default (ingest/reward/specs/default.toml)."""

    @model_validator(mode="after")
    def _event_fits_a_record(self) -> Settings:
        if self.ingest.max_bytes + RECORD_FRAMING_BYTES > self.kafka.max_message_bytes:
            raise ValueError(
                f"RTRL_INGEST__MAX_BYTES ({self.ingest.max_bytes}) must be at least {RECORD_FRAMING_BYTES} "
                f"bytes below RTRL_KAFKA__MAX_MESSAGE_BYTES ({self.kafka.max_message_bytes}): "
                "an event of the largest accepted size must fit one Kafka record")
        return self


RECORD_FRAMING_BYTES = 1024
"""Room a record's key, headers and batch framing take beside an event's value."""


def stack_env_file() -> Path:
    """Where ``rtrl up`` writes the embedded stack's connection settings."""
    return Path(os.environ.get("RTRL_STACK__DATA_DIR", ".rtrl")) / "stack.env"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings: environment first, then the embedded stack's env file."""
    env_file = stack_env_file()
    if env_file.exists():
        return Settings(_env_file=env_file)
    return Settings()


class _MappingEnvSource(EnvSettingsSource):
    """pydantic-settings' environment source, reading a given mapping instead of os.environ."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]) -> None:
        self._mapping = dict(env)
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._mapping, self.case_sensitive, self.env_ignore_empty,
                              self.env_parse_none_str)


def settings_from_env(env: Mapping[str, str]) -> Settings:
    """The Settings a process started with exactly the environment ``env`` would read: the
    same parsing of RTRL_* variables, and ``env`` as the only source (not os.environ)."""
    return Settings(_build_sources=((_MappingEnvSource(Settings, env),), {}))
