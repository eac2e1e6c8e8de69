"""Where the deployer announces its decisions (docs/deployer.md, "Notifications")."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator

from services.settings.services import Section


class NotifySettings(Section):
    """Webhooks the deployer POSTs each decision to (promoted, rolled back, aborted), and each
    canary that starts waiting for an operator's approval. Delivery runs in a background
    thread behind a bounded queue: it never delays a tick."""

    urls: tuple[SecretStr, ...] = ()
    """Receivers, e.g. RTRL_NOTIFY__URLS='["https://hooks.slack.com/services/..."]'. Secret,
    because incoming-webhook URLs carry their token; empty: no notifications."""
    format: Literal["json", "slack"] = "json"
    """``json``: rtrl's own document (docs/deployer.md); ``slack``: ``{"text": ...}`` for Slack
    and other incoming webhooks that take that shape."""
    secret: SecretStr | None = None
    """HMAC key: each request then carries ``X-Rtrl-Signature: sha256=<hex>`` over its body."""
    timeout_s: Annotated[float, Field(gt=0.0)] = 5.0
    """Longest wait for one receiver's answer."""
    retries: Annotated[int, Field(ge=0)] = 3
    """Further attempts after a failed one (no answer, 408, 429, 5xx); other 4xx are final."""
    backoff_s: Annotated[float, Field(ge=0.0)] = 1.0
    """Wait before the first retry, doubling for each next one (at most 60 s)."""
    queue_size: Annotated[int, Field(ge=1)] = 100
    """Deliveries waiting for the sender; when full, new ones are dropped and counted."""
    mlflow_ui_url: str | None = None
    """The MLflow UI's address as the receivers' readers reach it, for links to the model
    versions; None: ``mlflow.tracking_uri`` when it is http(s), else no links."""

    @field_validator("urls")
    @classmethod
    def _http_only(cls, urls: tuple[SecretStr, ...]) -> tuple[SecretStr, ...]:
        for i, url in enumerate(urls):
            if not url.get_secret_value().startswith(("http://", "https://")):
                raise ValueError(f"RTRL_NOTIFY__URLS[{i}] must start with http:// or https://")
        return urls
