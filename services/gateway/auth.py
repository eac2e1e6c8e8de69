"""Client authentication: API keys sent as ``Authorization: Bearer <key>``.

Keys come from ``RTRL_GATEWAY__API_KEYS`` (a JSON object ``{"<key id>": "<secret>"}``; a
Secret in the chart). Every key is compared with ``hmac.compare_digest`` (constant time per
key, and every key is compared, so the time does not say which one nearly matched). Keys are
never logged; requests are counted per key id (``rtrl_gateway_client_requests_total``).
Anonymous access exists only when ``RTRL_GATEWAY__ALLOW_ANONYMOUS=true`` (development); the
key id of such a request is ``anonymous``.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from pydantic import SecretStr

from ingest.contracts.prometheus import GATEWAY_CLIENT_REQUESTS

ANONYMOUS = "anonymous"


class UnauthorizedError(Exception):
    """-> 401; the message never contains the key that was sent."""


class ApiKeys:
    def __init__(self, keys: Mapping[str, SecretStr], allow_anonymous: bool = False) -> None:
        self._keys = [(kid, secret.get_secret_value().encode()) for kid, secret in keys.items()]
        self.allow_anonymous = allow_anonymous

    @property
    def configured(self) -> bool:
        """Whether any request can pass (keys exist or anonymous access is on)."""
        return bool(self._keys) or self.allow_anonymous

    def key_id(self, authorization: str | None) -> str:
        """The key id of a request's ``Authorization`` header; raises :class:`UnauthorizedError`."""
        if not authorization:
            if self.allow_anonymous:
                return ANONYMOUS
            raise UnauthorizedError("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise UnauthorizedError("malformed Authorization header: use 'Bearer <key>'")
        sent = token.strip().encode("utf-8", "surrogateescape")
        found = None
        for kid, secret in self._keys:  # no early exit: every key is compared
            if hmac.compare_digest(sent, secret) and found is None:
                found = kid
        if found is None:
            raise UnauthorizedError("invalid API key")
        return found

    def check(self, authorization: str | None) -> str:
        """:meth:`key_id`, counted per key id (``rejected`` for refused requests)."""
        try:
            kid = self.key_id(authorization)
        except UnauthorizedError:
            GATEWAY_CLIENT_REQUESTS.labels("rejected").inc()
            raise
        GATEWAY_CLIENT_REQUESTS.labels(kid).inc()
        return kid
