"""The chart's value types and its components' sections (resources, replicas, disruption
budget, autoscaling; the gateway, trainer and deployer), used by helm/values_model.py.

As there, each field's docstring is its comment in values.yaml and its description in
values.schema.json; run ``python helm/generate.py`` after editing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

Quantity = Annotated[str, Field(pattern=r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|M|G|T)?$")]
"""A Kubernetes quantity such as 500m, 2, 512Mi or 4Gi."""
Duration = Annotated[str, Field(pattern=r"^[0-9]+(ms|s|m|h)$")]
Port = Annotated[int, Field(ge=1, le=65535)]
UnprivilegedPort = Annotated[int, Field(ge=1024, le=65535)]
EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
Peer = dict[str, Any]
OperatorName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")]
Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
"""A NetworkPolicyPeer (podSelector / namespaceSelector / ipBlock), as in Kubernetes."""


VALUES_CONFIG = ConfigDict(
    extra="forbid",
    alias_generator=to_camel,
    populate_by_name=True,
    use_attribute_docstrings=True,
)
"""Of every section of the values: camelCase keys, unknown keys rejected, field docstrings as
descriptions. Each module of the model has its own base with it (ruff then sees the sections
are pydantic models, whose mutable defaults are copied)."""


class _Values(BaseModel):
    model_config = VALUES_CONFIG


# --- shared building blocks ---------------------------------------------------------------
class ResourceList(BaseModel):
    """CPU and memory, and any extended resource by its name (``nvidia.com/gpu: 1``,
    ``amd.com/gpu: 1``, ``hugepages-2Mi: 1Gi``), as in a PodSpec."""

    model_config = ConfigDict(**{**VALUES_CONFIG, "extra": "allow"})
    __pydantic_extra__: dict[str, Quantity | Annotated[int, Field(ge=0)]] = Field(init=False)

    cpu: Quantity | None = None
    """CPU, e.g. 250m or 2."""
    memory: Quantity | None = None
    """Memory, e.g. 512Mi or 4Gi."""


class Resources(_Values):
    requests: ResourceList = ResourceList(cpu="100m", memory="256Mi")
    """What the scheduler reserves for the container."""
    limits: ResourceList = ResourceList(memory="1Gi")
    """Hard ceiling; the container is OOM-killed above the memory limit."""


class SecretKeyRef(_Values):
    name: str = ""
    """Name of an existing Secret; empty uses the chart's own Secret (from the plain value)."""
    key: str
    """Key inside that Secret."""


class Pdb(_Values):
    enabled: bool = True
    """Create a PodDisruptionBudget for this component."""
    max_unavailable: Annotated[int, Field(ge=1)] = 1
    """Pods that voluntary disruptions (node drains) may take down at once."""


class Autoscaling(_Values):
    enabled: bool = False
    """Create a HorizontalPodAutoscaler (replicas is then ignored). Replicas beyond the
    topic's partition count sit idle: keep maxReplicas <= topics.partitions."""
    min_replicas: Annotated[int, Field(ge=1)] = 1
    """Lower bound of the autoscaler."""
    max_replicas: Annotated[int, Field(ge=1)] = 4
    """Upper bound of the autoscaler."""
    target_cpu_utilization_percentage: Annotated[int, Field(ge=1, le=100)] = 70
    """Average CPU utilisation (percent of requests) the autoscaler aims for."""


class PodExtras(_Values):
    """What every pod the chart runs (the components and the optional vLLM server) can be
    extended with; each entry is as in a PodSpec and is added to what the chart sets."""

    extra_env: list[dict[str, Any]] = []
    """Extra EnvVar entries as in a PodSpec, e.g. a valueFrom.secretKeyRef for an upstream API key."""
    pod_annotations: dict[str, str] = {}
    """Annotations added to the pods."""
    pod_labels: dict[str, str] = {}
    """Labels added to the pods (never used in selectors)."""
    priority_class_name: str = ""
    """PriorityClass of the pods; empty uses the cluster default."""
    topology_spread_constraints: list[dict[str, Any]] = []
    """TopologySpreadConstraints, as in a PodSpec; an empty labelSelector is filled with the
    component's selector labels."""
    pod_security_context: dict[str, Any] = {}
    """Merged over the pod securityContext the chart sets (for rtrl's pods: runAsNonRoot,
    the user and group from the top-level securityContext, seccomp RuntimeDefault)."""
    security_context: dict[str, Any] = {}
    """Merged over the main container's securityContext (for rtrl's pods: non-root,
    read-only root filesystem, no privilege escalation, every capability dropped)."""
    init_containers: list[dict[str, Any]] = []
    """Containers run to completion before the main one, as in a PodSpec."""
    sidecars: list[dict[str, Any]] = []
    """Extra containers beside the main one, as in a PodSpec (e.g. a log shipper or a proxy)."""
    extra_volumes: list[dict[str, Any]] = []
    """Extra Volumes of the pods, as in a PodSpec."""
    extra_volume_mounts: list[dict[str, Any]] = []
    """Extra VolumeMounts of the main container (sidecars and init containers list their own)."""


class _Placement(_Values):
    """Settings every component shares, besides its pod extras."""

    enabled: bool = True
    """Run this component."""
    resources: Resources = Resources()
    """Container resources."""
    env: dict[EnvName, str] = {}
    """Extra environment for this component only, e.g. RTRL_<SERVICE>__<FIELD>: value
    (see services/settings/services.py for the settings each service reads)."""
    node_selector: dict[str, str] = {}
    """Node labels the pods must match."""
    tolerations: list[dict[str, Any]] = []
    """Tolerations, as in a PodSpec."""
    affinity: dict[str, Any] = {}
    """Affinity, as in a PodSpec."""
    runtime_class_name: str = ""
    """RuntimeClass of the pods (e.g. nvidia for GPU nodes); empty uses the cluster default."""
    termination_grace_period_seconds: Annotated[int, Field(ge=0)] = 60
    """Time between SIGTERM and SIGKILL: the service finishes its batch and commits in it."""
    tmp_size_limit: Quantity = "1Gi"
    """Size limit of the writable /tmp emptyDir (the root filesystem is read-only)."""


class Component(PodExtras, _Placement):
    """Settings every component shares: placement first, then the pod extras."""


class ScalableComponent(Component):
    replicas: Annotated[int, Field(ge=1)] = 1
    """Pods when autoscaling is off."""
    pdb: Pdb = Pdb()
    """PodDisruptionBudget."""


class Keda(_Values):
    enabled: bool = False
    """Create a KEDA ScaledObject (needs the KEDA operator) that scales on the consumer
    group's lag instead of CPU; replicas is then ignored. Not with autoscaling.enabled."""
    min_replica_count: Annotated[int, Field(ge=0)] = 1
    """Lower bound; 0 lets KEDA stop every pod while there is no lag."""
    max_replica_count: Annotated[int, Field(ge=1)] = 4
    """Upper bound; replicas beyond the topic's partition count sit idle."""
    lag_threshold: Annotated[int, Field(ge=1)] = 1000
    """Messages of lag per replica the scaler aims for (the kafka scaler's lagThreshold)."""
    polling_interval: Annotated[int, Field(ge=1)] = 30
    """Seconds between lag checks."""
    cooldown_period: Annotated[int, Field(ge=0)] = 300
    """Seconds without lag before scaling to minReplicaCount 0."""
    bootstrap_servers: str = ""
    """Brokers the scaler reads the lag from; empty uses kafka.bootstrapServers."""
    consumer_group: str = ""
    """Consumer group whose lag counts; empty uses the service's default (rtrl-ingest,
    rtrl-reward): set it when env overrides the group id."""
    topic: str = ""
    """Topic whose lag counts; empty uses the component's input (topics.raw for ingest,
    topics.events for reward)."""
    authentication_ref: str = ""
    """An existing TriggerAuthentication with the brokers' SASL/TLS material; needed when
    kafka.securityProtocol is not PLAINTEXT."""


class WorkerComponent(ScalableComponent):
    autoscaling: Autoscaling = Autoscaling()
    """Optional HorizontalPodAutoscaler on CPU."""
    keda: Keda = Keda()
    """Optional KEDA ScaledObject on consumer lag (instead of the HorizontalPodAutoscaler)."""


class GatewayService(_Values):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """Service type for the completions API."""
    port: Port = 80
    """Service port for the completions API."""
    annotations: dict[str, str] = {}
    """Annotations on the Service (e.g. for a cloud load balancer)."""


class IngressPath(_Values):
    path: str = "/"
    """URL path routed to the gateway."""
    path_type: Literal["Prefix", "Exact", "ImplementationSpecific"] = "Prefix"
    """How the path matches."""


class IngressHost(_Values):
    host: str
    """Host name routed to the gateway."""
    paths: list[IngressPath] = [IngressPath()]
    """Paths of that host routed to the gateway."""


class IngressTls(_Values):
    hosts: list[str] = []
    """Host names the certificate covers."""
    secret_name: str = ""
    """TLS Secret with the certificate and key (empty: the controller's default)."""


class GatewayIngress(_Values):
    enabled: bool = False
    """Create an Ingress for the completions API. With gateway.allowedClients set, list the
    ingress controller's pods there too."""
    class_name: str = ""
    """IngressClass (e.g. nginx); empty uses the cluster default."""
    annotations: dict[str, str] = {}
    """Annotations, e.g. for cert-manager or the controller's timeouts."""
    hosts: list[IngressHost] = []
    """Hosts and paths routed to the gateway's Service. Required when enabled."""
    tls: list[IngressTls] = []
    """TLS termination, as in an Ingress."""


class Gateway(ScalableComponent):
    port: UnprivilegedPort = 8080
    """Container port of the HTTP API (POST /v1/completions), which also serves /metrics,
    /healthz and /readyz (RTRL_GATEWAY__PORT)."""
    service: GatewayService = GatewayService()
    """The Service in front of the API."""
    ingress: GatewayIngress = GatewayIngress()
    """An optional Ingress in front of that Service."""
    allowed_clients: list[Peer] = []
    """NetworkPolicy peers allowed to call the API; empty allows every source (ingress
    controllers, other namespaces). Example: [{namespaceSelector: {matchLabels:
    {kubernetes.io/metadata.name: serving}}}]."""
    api_keys: dict[str, str] = {}
    """Client API keys, key id -> key, stored in the chart's Secret; clients send
    Authorization: Bearer <key> (RTRL_GATEWAY__API_KEYS). The install fails without keys
    unless allowAnonymous is set."""
    api_keys_secret: SecretKeyRef = SecretKeyRef(key="gateway-api-keys")
    """Read the API keys from an existing Secret: a JSON object {"key-id": "key"} under this key."""
    allow_anonymous: bool = False
    """Development only: serve requests without an API key."""
    signing_key_id: str = "gateway"
    """The producer key id (in auth.keys) that signs the served events the gateway sends to
    the raw topic (RTRL_GATEWAY__KEY_ID)."""
    tmp_size_limit: Quantity = "2Gi"
    """Size limit of /tmp, which also holds the spool of served events waiting for the broker
    (up to RTRL_GATEWAY__SPOOL_MAX_BYTES, 1 GiB by default): keep it above that."""


class TrainerPersistence(_Values):
    enabled: bool = False
    """Keep the data directory on a PersistentVolumeClaim; false uses an emptyDir (lost
    with the pod: an interrupted increment then starts over at the next cadence)."""
    size: Quantity = "20Gi"
    """Size of the claim."""
    storage_class_name: str = ""
    """StorageClass of the claim; empty uses the cluster default."""
    existing_claim: str = ""
    """Use this existing PersistentVolumeClaim instead of creating one."""


class Trainer(Component):
    """The scheduler of RL increments. Always one replica (Recreate strategy): two
    schedulers would train on the same data window twice."""

    resources: Resources = Resources(
        requests=ResourceList(cpu="1", memory="2Gi"), limits=ResourceList(memory="8Gi")
    )
    """Container resources (the increment runs here when no Ray cluster is set)."""
    termination_grace_period_seconds: Annotated[int, Field(ge=0)] = 300
    """Time between SIGTERM and SIGKILL: a running increment is handed back cleanly."""
    tmp_size_limit: Quantity = "10Gi"
    """Size limit of /tmp (model artifacts are staged here before MLflow upload)."""
    persistence: TrainerPersistence = TrainerPersistence()
    """The trainer's data directory (RTRL_TRAINER__DATA_DIR): scheduler job store, the
    pending data window and Ray checkpoints, so a restart resumes an interrupted increment."""


class Operators(_Values):
    """Who may promote, roll back, pause, resume and approve by hand (docs/operations.md)."""

    keys: dict[OperatorName, Sha256Hex | list[Sha256Hex]] = {}
    """Operator name -> the SHA-256 (hex) of that operator's token, or a list of them while a
    token is rotated; create one with: printf %s "$TOKEN" | sha256sum. The CLI signs commands
    with it, so it is a secret: stored in the chart's Secret and mounted into the deployer
    only (RTRL_OPERATORS__KEYS_FILE). Prefer existingSecret. Without keys every manual
    command is refused."""
    existing_secret: SecretKeyRef = SecretKeyRef(key="operator-keys")
    """Read the keys from an existing Secret: name:sha256-hex lines (or a JSON object) under
    this key. Mounted as a file, so a rotated Secret applies without restarting the deployer."""
    allow_unauthenticated: bool = False
    """Development only: execute unsigned commands as operator "unauthenticated"."""
    max_age_seconds: Annotated[int, Field(ge=1)] = 300
    """A signed command is executed only this long after it was signed (clock skew included);
    older copies are refused (RTRL_OPERATORS__MAX_AGE_S)."""


class Approval(_Values):
    required: bool = False
    """A canary that passes the judge waits in phase awaiting_approval until an operator runs
    rtrl approve VERSION (promote) or rtrl rollback (reject) (RTRL_DEPLOYER__APPROVAL__REQUIRED)."""
    timeout_seconds: Annotated[int, Field(ge=1)] = 86400
    """Longest wait for the approval; then the canary is rolled back with the reason
    "approval timed out" (RTRL_DEPLOYER__APPROVAL__TIMEOUT_S)."""


class Egress(_Values):
    to: list[Peer] = []
    """Peers allowed; empty allows any destination on these ports."""
    ports: list[Port] = []
    """TCP ports allowed."""


class Notifications(_Values):
    urls: list[Annotated[str, Field(pattern=r"^https?://")]] = []
    """Webhook URLs, stored in the chart's Secret (incoming-webhook URLs carry their token);
    empty (and no urlsSecret) sends nothing."""
    urls_secret: SecretKeyRef = SecretKeyRef(key="notify-urls")
    """Read the URLs from an existing Secret instead: a JSON list under this key."""
    format: Literal["json", "slack"] = "json"
    """json: rtrl's decision document; slack: {"text": ...} for Slack-style incoming webhooks."""
    hmac_key: str = ""
    """Signing key, stored in the chart's Secret: requests then carry X-Rtrl-Signature:
    sha256=<hex HMAC of the body>."""
    hmac_key_secret: SecretKeyRef = SecretKeyRef(key="notify-hmac-key")
    """Read the signing key from an existing Secret instead."""
    timeout_s: Annotated[float, Field(gt=0)] = 5.0
    """Longest wait for one receiver's answer."""
    retries: Annotated[int, Field(ge=0)] = 3
    """Further attempts after a failure (no answer, 408, 429, 5xx), with doubling backoff."""
    backoff_s: Annotated[float, Field(ge=0)] = 1.0
    """Wait before the first retry."""
    mlflow_ui_url: str = ""
    """The MLflow UI's address as the receivers' readers reach it (e.g. https://mlflow.example.com),
    for links in the notices; empty: mlflow.trackingUri."""
    egress: Egress = Egress(ports=[443])
    """What the deployer's NetworkPolicy opens for the receivers (when URLs are set)."""


class Deployer(Component):
    """The canary controller with the rollback judge. Always one replica (Recreate)."""

    operators: Operators = Operators()
    """Operator keys the deployer verifies every manual command with."""
    approval: Approval = Approval()
    """The optional approval gate before a promotion."""
    notifications: Notifications = Notifications()
    """Webhooks announcing every decision (promoted, rolled back, aborted; awaiting approval): RTRL_NOTIFY__*,
    docs/deployer.md."""
