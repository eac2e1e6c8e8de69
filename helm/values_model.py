"""The typed model of the chart's values: one source for values.yaml (defaults and
comments) and values.schema.json (what Helm rejects). Run ``python helm/generate.py``
after editing; a test fails when the generated files are stale.

Field docstrings become the comments in values.yaml and the descriptions in the schema,
so every value is documented in one place. The value types and the components' sections
are in helm/values_components.py; the external dependencies, the cluster plumbing and
the top-level ``Values`` are here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field
from values_cluster import Dashboards, Global, HelmTests, Image, PrometheusRule, ServiceMonitor
from values_components import (
    VALUES_CONFIG,
    Deployer,
    Egress,
    Gateway,
    Peer,
    ResourceList,
    Resources,
    SecretKeyRef,
    Trainer,
    UnprivilegedPort,
    WorkerComponent,
)
from values_engine import Engine


class _Values(BaseModel):
    model_config = VALUES_CONFIG


# --- external dependencies ----------------------------------------------------------------
class KafkaSasl(_Values):
    mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    """SASL mechanism; null when securityProtocol has no SASL."""
    username: str = ""
    """SASL user name (Strimzi: the KafkaUser's name)."""
    password: str = ""
    """SASL password, stored in the chart's Secret. Prefer existingSecret."""
    existing_secret: SecretKeyRef = SecretKeyRef(key="password")
    """Read the password from an existing Secret (Strimzi: the KafkaUser's Secret, key password)."""


class ClientCertRef(_Values):
    name: str = ""
    """Existing Secret with the client certificate and key; empty disables mutual TLS."""
    cert_key: str = "user.crt"
    """Key of the PEM certificate (Strimzi KafkaUser with tls auth: user.crt)."""
    key_key: str = "user.key"
    """Key of the PEM private key (Strimzi: user.key)."""


class CaRef(_Values):
    name: str = ""
    """Existing Secret with the CA bundle that signs the brokers (Strimzi:
    <cluster>-cluster-ca-cert); empty uses the image's system CAs."""
    key: str = "ca.crt"
    """Key of the PEM CA bundle in that Secret."""


class KafkaTls(_Values):
    ca_secret: CaRef = CaRef()
    """CA bundle for SSL / SASL_SSL, mounted read-only and set as RTRL_KAFKA__SSL_CAFILE."""
    client_secret: ClientCertRef = ClientCertRef()
    """Client certificate for mutual TLS (RTRL_KAFKA__SSL_CERTFILE / SSL_KEYFILE)."""


class Kafka(_Values):
    bootstrap_servers: Annotated[str, Field(pattern=r"^[^,\s]+:[0-9]+(,[^,\s]+:[0-9]+)*$")] = "kafka:9092"
    """Comma-separated host:port list of the brokers."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """As in the Kafka client configuration; SASL_SSL for most managed clusters."""
    sasl: KafkaSasl = KafkaSasl()
    """SASL authentication."""
    tls: KafkaTls = KafkaTls()
    """TLS material for SSL / SASL_SSL."""
    client_id: str = "rtrl"
    """Client id prefix the brokers see (quotas, logs)."""
    client: Literal["kafka-python", "librdkafka"] = "kafka-python"
    """Kafka client of the ingest and reward workers (librdkafka: confluent-kafka)."""


class Topics(_Values):
    raw: str = "rtrl.raw.v1"
    """Untrusted input from clients and the serving layer."""
    events: str = "rtrl.events.v1"
    """Validated, deduplicated events keyed by request_id."""
    rewards: str = "rtrl.rewards.v1"
    """One closed reward record per served completion."""
    dlq: str = "rtrl.dlq.v1"
    """Rejected input with the original bytes and a reason."""
    sessions: str = "rtrl.reward-sessions.v1"
    """Internal to the reward workers under a spec with a [session] table (agent sessions)."""
    partitions: Annotated[int, Field(ge=1)] = 4
    """Partitions of topics rtrl creates; the most useful ingest/reward replicas."""
    replication_factor: Annotated[int, Field(ge=1)] = 3
    """Replication factor of topics rtrl creates."""
    create: bool = True
    """Create missing topics at start-up; false where topics are managed (Strimzi KafkaTopic)."""


class Redis(_Values):
    url: Annotated[str, Field(pattern=r"^(rediss?://.*)?$")] = "redis://redis:6379/0"
    """redis:// or rediss:// URL, stored in the chart's Secret (it may carry a password)."""
    existing_secret: SecretKeyRef = SecretKeyRef(key="redis-url")
    """Read the URL from an existing Secret instead (the whole URL under this key)."""
    key_prefix: str = "rtrl:"
    """Prefix for every key rtrl writes, so several installs can share one Redis."""


class Mlflow(_Values):
    tracking_uri: Annotated[str, Field(pattern=r"^(https?|databricks|file|sqlite|postgresql)[:+]")] = (
        "http://mlflow:5000"
    )
    """MLflow tracking server."""
    registered_model: str = "rtrl-policy"
    """Registered model that holds the champion, candidate and previous aliases."""
    env_from_secret: str = ""
    """Existing Secret whose keys are loaded as environment (e.g. MLFLOW_TRACKING_TOKEN,
    MLFLOW_TRACKING_USERNAME/PASSWORD, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY for artifacts)."""


class RayGroup(_Values):
    resources: Resources = Resources(
        requests=ResourceList(cpu="2", memory="4Gi"), limits=ResourceList(memory="8Gi")
    )
    """Container resources of each Ray pod in this group; GPUs go under limits, e.g.
    nvidia.com/gpu: 1."""
    node_selector: dict[str, str] = {}
    """Node labels the pods must match (e.g. a GPU node pool)."""
    tolerations: list[dict[str, Any]] = []
    """Tolerations, as in a PodSpec."""
    affinity: dict[str, Any] = {}
    """Affinity, as in a PodSpec."""
    runtime_class_name: str = ""
    """RuntimeClass of the pods (e.g. nvidia); empty uses the cluster default."""


class RayWorkers(RayGroup):
    replicas: Annotated[int, Field(ge=0)] = 1
    """Worker pods to start with."""
    min_replicas: Annotated[int, Field(ge=0)] = 0
    """Lower bound when the Ray autoscaler is used."""
    max_replicas: Annotated[int, Field(ge=0)] = 4
    """Upper bound when the Ray autoscaler is used."""


class RayCluster(_Values):
    enabled: bool = False
    """Create a KubeRay RayCluster (needs the KubeRay operator) and point the trainer at it."""
    ray_version: str = "2.60.0"
    """Ray version in the image; must match the ray package in the rtrl image."""
    head: RayGroup = RayGroup()
    """The head pod."""
    workers: RayWorkers = RayWorkers()
    """The worker group."""


class Ray(_Values):
    address: str = ""
    """Existing Ray cluster (e.g. ray://raycluster-head-svc:10001); empty with
    cluster.enabled false runs Ray inside the trainer pod."""
    cluster: RayCluster = RayCluster()
    """Optional KubeRay RayCluster for the trainer."""
    num_workers: Annotated[int, Field(ge=1)] = 1
    """Ray Train workers per increment (data parallel: gloo on CPU, NCCL on GPU)."""
    cpus_per_worker: Annotated[int, Field(ge=1)] = 1
    """CPUs each Ray Train worker reserves (and torch threads it runs)."""
    use_gpu: bool = False
    """Give each Ray Train worker a GPU (the Ray pods then need nvidia.com/gpu limits)."""


class Auth(_Values):
    keys: dict[str, str] = {}
    """Producer key id -> shared HMAC secret for raw events, stored in the chart's Secret."""
    existing_secret: SecretKeyRef = SecretKeyRef(key="auth-keys")
    """Read the keys from an existing Secret: a JSON object {"key-id": "secret"} under this key."""
    allow_unsigned: bool = False
    """Development only: accept raw events without a signature."""


# --- cluster plumbing ---------------------------------------------------------------------
class SecurityContext(_Values):
    run_as_user: Annotated[int, Field(ge=1)] = 10001
    """Non-root user id the containers run as (the Dockerfile's rtrl user)."""
    run_as_group: Annotated[int, Field(ge=1)] = 10001
    """Group id of the containers."""
    fs_group: Annotated[int, Field(ge=1)] = 10001
    """Group that owns mounted volumes."""


class ServiceAccount(_Values):
    create: bool = True
    """Create a ServiceAccount for the pods (no Kubernetes API token is mounted)."""
    name: str = ""
    """Name to use; empty derives it from the release."""
    annotations: dict[str, str] = {}
    """Annotations, e.g. for cloud workload identity (object storage for MLflow artifacts)."""


class Metrics(_Values):
    port: UnprivilegedPort = 9100
    """Port of /metrics, /healthz and /readyz in every pod (RTRL_HTTP__PORT)."""




class NetworkPolicyEgress(_Values):
    kafka: Egress = Egress(ports=[9092, 9093])
    """Brokers (Strimzi: 9092 plain, 9093 TLS)."""
    redis: Egress = Egress(ports=[6379])
    """Redis."""
    mlflow: Egress = Egress(ports=[80, 443, 5000])
    """MLflow tracking server and the artifact store behind it."""
    engine: Egress = Egress(ports=[8000])
    """An external inference engine (engine.baseUrl), for the gateway and the deployer. With
    engine.vllm.enabled the chart's vLLM pods are allowed instead."""
    ray: Egress = Egress(ports=[6379, 8265, 10001])
    """An external Ray cluster (GCS, dashboard, client). With ray.cluster.enabled the
    chart's RayCluster pods are allowed instead."""
    dns: Egress = Egress(
        to=[{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
        ports=[53],
    )
    """Cluster DNS (TCP and UDP)."""
    extra: list[dict[str, Any]] = []
    """Extra NetworkPolicyEgressRules added to every component."""


class NetworkPolicy(_Values):
    enabled: bool = True
    """Create a NetworkPolicy per component: only the listed traffic is allowed."""
    metrics_from: list[Peer] = [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    ]
    """Peers allowed to scrape /metrics (default: prometheus-operator's Prometheus pods)."""
    egress: NetworkPolicyEgress = NetworkPolicyEgress()
    """Outgoing traffic each component may open."""


class Values(_Values):
    """Values of the rtrl chart."""

    name_override: str = ""
    """Replaces the chart name in resource names."""
    fullname_override: str = ""
    """Replaces the release-derived prefix of resource names."""
    image: Image = Image()
    """Container image of every component."""
    common_labels: dict[str, str] = {}
    """Labels added to every resource the chart creates (never used in selectors)."""
    image_pull_secrets: list[dict[str, str]] = []
    """Secrets for a private registry, e.g. [{name: regcred}]."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of every service (RTRL_LOG_LEVEL)."""
    config: dict[Annotated[str, Field(pattern=r"^RTRL_[A-Z0-9_]+$")], str] = {}
    """Extra settings for every component, added to the ConfigMap (RTRL_* names, see
    services/settings/model.py and service_settings.py). Secrets do not belong here."""
    kafka: Kafka = Kafka()
    """External Kafka."""
    topics: Topics = Topics()
    """Topic names and creation."""
    redis: Redis = Redis()
    """External Redis (traffic split, dedup and window state)."""
    mlflow: Mlflow = Mlflow()
    """External MLflow (registry and decision ledger)."""
    ray: Ray = Ray()
    """Ray for the trainer."""
    auth: Auth = Auth()
    """Producer authentication for the raw topic."""
    engine: Engine = Engine()
    """The inference engine the gateway serves from and the deployer loads candidates into."""
    metrics: Metrics = Metrics()
    """Metrics and health endpoints."""
    security_context: SecurityContext = SecurityContext()
    """Pod user and group (always non-root, read-only root filesystem, no capabilities)."""
    service_account: ServiceAccount = ServiceAccount()
    """The pods' ServiceAccount."""
    gateway: Gateway = Gateway(replicas=2)
    """Serves completions and routes users to the stable or canary arm."""
    ingest: WorkerComponent = WorkerComponent()
    """Validates, authenticates and deduplicates raw events."""
    reward: WorkerComponent = WorkerComponent()
    """Joins events per request and emits rewards."""
    trainer: Trainer = Trainer()
    """Schedules RL increments."""
    deployer: Deployer = Deployer()
    """Runs canaries and rolls back."""
    network_policy: NetworkPolicy = NetworkPolicy()
    """NetworkPolicies."""
    service_monitor: ServiceMonitor = ServiceMonitor()
    """prometheus-operator ServiceMonitor."""
    prometheus_rule: PrometheusRule = PrometheusRule()
    """prometheus-operator PrometheusRule with the alerts."""
    dashboards: Dashboards = Dashboards()
    """Grafana dashboard ConfigMap."""
    tests: HelmTests = HelmTests()
    """The pods `helm test` runs."""
    global_: Global = Field(default=Global(), alias="global")
    """Helm's global values."""
