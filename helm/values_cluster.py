"""The chart's cluster plumbing that is not a component: the image, helm test, Helm's
global values and the prometheus-operator and Grafana resources, used by
helm/values_model.py. As there, each field's docstring is its comment in values.yaml and
its description in values.schema.json; run ``python helm/generate.py`` after editing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from values_components import VALUES_CONFIG, Duration


class _Values(BaseModel):
    model_config = VALUES_CONFIG


class Global(BaseModel):
    """Helm's global values, shared with a parent chart (whose other keys pass through)."""

    model_config = ConfigDict(**{**VALUES_CONFIG, "extra": "allow"})

    image_registry: str = ""
    """Registry of every image the chart runs (a mirror) whose reference names no registry
    host of its own; empty keeps image.registry and the vLLM image as they are."""


class Image(_Values):
    registry: str = "ghcr.io"
    """Registry host; global.imageRegistry, when set, replaces it."""
    repository: str = "rtrl/rtrl"
    """Image built from the repository's Dockerfile, within the registry. A repository that
    starts with its own registry host (e.g. myregistry.example.com/rtrl) is used as it is."""
    tag: str = ""
    """Image tag; empty uses the chart's appVersion."""
    digest: Annotated[str, Field(pattern=r"^(sha256:[a-f0-9]{64})?$")] = ""
    """Image digest (sha256:...); when set it wins over the tag (repository@digest)."""
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Kubernetes imagePullPolicy."""


class ServiceMonitor(_Values):
    enabled: bool = False
    """Create a prometheus-operator ServiceMonitor for every component."""
    interval: Duration = "30s"
    """Scrape interval."""
    labels: dict[str, str] = {}
    """Extra labels, e.g. {release: kube-prometheus-stack} to match the Prometheus selector."""
    namespace: str = ""
    """Namespace to create the ServiceMonitor in (e.g. monitoring's); empty uses the
    release's. It always selects the release's Services."""
    relabelings: list[dict[str, Any]] = []
    """RelabelConfigs applied to the targets before the scrape, as in a ServiceMonitor endpoint."""
    metric_relabelings: list[dict[str, Any]] = []
    """RelabelConfigs applied to the scraped samples (e.g. to drop series), as in a
    ServiceMonitor endpoint."""


class Slo(_Values):
    availability: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.999
    """Share of gateway requests not answered 5xx (RtrlGatewayErrorBudgetBurn)."""
    latency: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.99
    """Share of gateway requests answered within latencyThresholdSeconds (RtrlGatewayLatencyBudgetBurn)."""
    latency_threshold_seconds: Literal["0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0", "30.0"] = "5.0"
    """The latency objective's threshold: one of the gateway histogram's bucket bounds, as exported."""


class PrometheusRule(_Values):
    enabled: bool = False
    """Create a PrometheusRule with the alerts in files/alerts/."""
    labels: dict[str, str] = {}
    """Extra labels, e.g. {release: kube-prometheus-stack}."""
    runbook_base_url: Annotated[str, Field(pattern=r"^https?://\S+[^/]$")] = (
        "https://github.com/rtrl/rtrl/blob/main/docs/runbooks"
    )
    """Base of every alert's runbook_url (no trailing slash); point it at your fork or wiki."""
    slo: Slo = Slo()
    """The gateway's service-level objectives, for the burn-rate alerts."""
    approval_wait_seconds: Annotated[int, Field(ge=60)] = 3600
    """Seconds a canary may wait in awaiting_approval (deployer.approval.required) before
    RtrlCanaryAwaitingApproval fires. Keep it below deployer.approval.timeoutSeconds, after
    which the deployer rolls the canary back by itself."""


class Dashboards(_Values):
    enabled: bool = False
    """Ship the Grafana dashboard in a ConfigMap for the Grafana sidecar."""
    label: str = "grafana_dashboard"
    """Label the Grafana sidecar watches."""
    label_value: str = "1"
    """Value of that label."""
    annotations: dict[str, str] = {}
    """Annotations, e.g. {grafana_folder: rtrl} for the sidecar's folder support."""


class HelmTests(_Values):
    enabled: bool = True
    """Render the helm test pods (run only by `helm test`): one calls the gateway's /readyz
    and /v1/models through its Service, one each worker's /readyz through the workers'
    Services. They run the rtrl image."""
    timeout_seconds: Annotated[int, Field(ge=1)] = 10
    """Time each HTTP check may take."""
