"""The gateway's core: serve completions, route users to arms, log every exposure.

:class:`Gateway` is HTTP-independent: ``handle(method, path, body, content_type, headers)``
returns a :class:`Response`. The HTTP server around it (uvicorn with httptools, limits and
workers) is services/gateway/asgi/app.py; it calls ``handle`` on a thread pool, so a
CPU-bound local policy or a blocking engine call never stalls the event loop.

The request path is: parse and validate (pydantic) -> read the routing table in force ->
pick the arm -> generate -> answer -> queue the served event. Everything slow (Redis,
MLflow, Kafka) runs in background threads: :class:`RoutingPoller`, :class:`ModelSlots`'
loader and :class:`ExposureLogger`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Annotated, Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployer.routing import Arm, RoutingTable
from ingest.contracts.prometheus import GATEWAY_ERRORS, GATEWAY_FALLBACKS, GATEWAY_REQUESTS, GATEWAY_SECONDS
from ingest.events import TURN_MAX, Id, TokenId
from services.gateway.auth import ApiKeys, UnauthorizedError
from services.gateway.chat.turns import session_events
from services.gateway.exposure import ALSO
from services.gateway.generation import UpstreamError
from services.gateway.models import Backend, Generation, ModelSlots
from services.gateway.openai_api import Headers, Response
from services.gateway.openai_api import error_response as _error
from services.gateway.openai_api import json_response as _json
from services.gateway.openai_routes import OpenAIRoutes
from services.gateway.request_ids import RequestIds
from services.runtime.health import Health
from services.settings.services import GatewaySettings
from trainer.tokens import completion_kind

log = logging.getLogger(__name__)

MAX_TOKENS_LIMIT = 256


class CompletionRequest(BaseModel):
    """POST /v1/completions body. Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    user_key: Id
    session_id: Id
    prompt_tokens: Annotated[list[TokenId], Field(min_length=1, max_length=32_768)]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    request_id: Id | None = None
    temperature: Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False)] = 1.0
    turn: Annotated[int, Field(ge=0, le=TURN_MAX, strict=True)] | None = None
    """The request's turn index in the agent session ``session_id``: given, the gateway logs
    the turn's ``session.turn`` beside its served event (docs/gateway.md, "Sessions")."""



def is_json_media_type(content_type: str | None) -> bool:
    """True for ``application/json`` (any parameters, e.g. charset) and ``application/*+json``.
    A request without a Content-Type is taken as JSON: many clients send none."""
    if not content_type:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(body: bytes) -> tuple[Any, str | None]:
    """(parsed body, None), or (None, "malformed JSON: ...") for anything that is not RFC 8259
    JSON: bad syntax or encoding, NaN/Infinity literals, nesting deeper than Python recurses.
    Each request body is parsed once, here."""
    try:
        return json.loads(body, parse_constant=_no_constant), None
    except (ValueError, RecursionError) as exc:
        return None, f"malformed JSON: {str(exc)[:200]}"


GENERATION_ROUTES = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
"""The OpenAI generation routes and the kind of request each serves."""


def _unsupported(content_type: str | None) -> Response | None:
    """The 415 for a POST whose body is declared as something other than JSON."""
    if content_type and not is_json_media_type(content_type):
        GATEWAY_REQUESTS.labels("none", "none", "415").inc()
        return _error(415, f"unsupported Content-Type {content_type[:100]!r}; send application/json")
    return None


def validation_message(exc: ValidationError) -> str:
    """One readable line from a pydantic error: 'malformed JSON: ...' or 'field: problem; ...'."""
    errors = exc.errors(include_url=False)
    if any(e["type"] == "json_invalid" for e in errors):
        return "malformed JSON: " + str(errors[0].get("ctx", {}).get("error", errors[0]["msg"]))
    parts = []
    for e in errors[:5]:
        where = ".".join(str(p) for p in e["loc"]) or "body"
        parts.append(f"{where}: {e['msg']}")
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    return "invalid request: " + "; ".join(parts) + more


def settled(resp: Response, defer: bool) -> Response:
    """``resp`` with its deferred bookkeeping run now, unless the caller ``defer`` s it."""
    if defer or resp.after is None:
        return resp
    resp.after()
    return replace(resp, after=None)


class Gateway:
    """The HTTP-independent core: ``handle(method, path, body)`` -> :class:`Response`."""

    def __init__(
        self,
        settings: GatewaySettings,
        slots: ModelSlots,
        table: Callable[[], RoutingTable],
        log_exposure: Callable[[dict[str, Any]], object],
        model_name: str,
        health: Health | None = None,
        registry: CollectorRegistry = REGISTRY,
        count: Callable[..., object] | None = None,
        request_ids: RequestIds | None = None,
    ) -> None:
        self.settings = settings
        self.count = count or (lambda _version, _arm, _error, _user=None: None)
        """Per (version, arm) request/error counts for the judge, errors also per user
        (deployer/adapters/served_counts.py): ``count(version, arm, error, user)``."""
        self.slots = slots
        self._table = table
        self.log_exposure = log_exposure
        self.model_name = model_name
        self.health = health or Health()
        self._registry = registry
        self.keys = ApiKeys(settings.api_keys, settings.allow_anonymous)
        self.request_ids = request_ids or RequestIds(None, "")
        """Client-supplied request ids already served (services/gateway/request_ids.py)."""
        self.openai = OpenAIRoutes(self)

    # ----------------------------------------------------------------- routing
    def handle(self, method: str, path: str, body: bytes, content_type: str | None = None,
               headers: Headers | None = None, authenticated: bool = False, defer: bool = False) -> Response:
        """``content_type``: the request's Content-Type header (None when absent); ``headers``:
        all of them (``Authorization``, ``X-Rtrl-User``, ...); ``authenticated``: the caller
        has already passed the request through :meth:`authenticate`; ``defer``: the caller runs
        the answer's :attr:`~services.gateway.openai_api.Response.after` once it is sent (else
        it has run when this returns)."""
        path = path.split("?", 1)[0]
        headers = headers or {}
        routes: dict[str, tuple[str, Callable[[bytes], Response]]] = {
            "/v1/completions": ("POST", lambda b: self.completions(b, headers)),
            "/v1/chat/completions": ("POST", lambda b: self._openai("chat", b, headers)),
            "/v1/models": ("GET", lambda _b: self.openai.models()),
            "/v1/routing": ("GET", lambda _b: self.routing()),
            "/metrics": ("GET", lambda _b: self.metrics()),
            "/healthz": ("GET", lambda _b: self._probe(*self.health.live())),
            "/readyz": ("GET", lambda _b: self._probe(*self.health.ready())),
        }
        refused = None if authenticated else self.authenticate(path, headers)
        if refused is not None:
            return refused
        if path not in routes:
            return _error(404, f"no such path {path[:200]}; the API is POST /v1/chat/completions, "
                               "POST /v1/completions and GET /v1/models")
        allowed, fn = routes[path]
        if method != allowed:
            return _error(405, f"{method} not allowed on {path}; use {allowed}",
                          headers=(("Allow", allowed),))
        if method == "POST" and (refused := _unsupported(content_type)) is not None:
            return refused
        return settled(fn(body), defer)

    def relays(self, method: str, path: str) -> bool:
        """Whether :meth:`ahandle` serves this request on the event loop: an OpenAI generation
        route while the models are on an engine (their backends relay asynchronously)."""
        stable = self.slots.get("stable")
        return (method == "POST" and path.split("?", 1)[0] in GENERATION_ROUTES
                and stable is not None and getattr(stable[1], "relays", False))

    async def ahandle(self, path: str, body: bytes, content_type: str | None,
                      headers: Headers, defer: bool = False) -> Response | None:
        """An authenticated request that :meth:`relays`, answered on the event loop; None when
        it is the token-id API after all (blocking: run :meth:`handle` in a thread).
        ``defer`` as in :meth:`handle`."""
        refused = _unsupported(content_type)
        if refused is not None:
            return refused
        kind = GENERATION_ROUTES[path.split("?", 1)[0]]
        data, refused = self._generation_body(kind, body)
        if refused is not None:
            return refused
        if kind == "completion" and "prompt_tokens" in data:
            return None
        return settled(await self.openai.acomplete(kind, data, headers), defer)

    def authenticate(self, path: str, headers: Headers) -> Response | None:
        """The 401 for a ``/v1/*`` request without a valid API key, else None. It comes before
        any other check, so an unauthenticated client learns nothing about the API and cannot
        make the gateway read its body."""
        if not path.startswith("/v1/"):
            return None
        try:
            self.keys.check(headers.get("Authorization"))
        except UnauthorizedError as exc:
            GATEWAY_REQUESTS.labels("none", "none", "401").inc()
            return _error(401, str(exc), headers=(("WWW-Authenticate", 'Bearer realm="rtrl"'),))
        return None

    def completions(self, body: bytes, headers: Headers) -> Response:
        """``POST /v1/completions``: the token-id API when the body has ``prompt_tokens``, else
        the OpenAI completions API."""
        data, refused = self._generation_body("completion", body)
        if refused is not None:
            return refused
        if "prompt_tokens" in data:
            return self.complete(data)
        return self.openai.complete("completion", data, headers)

    def _openai(self, kind: str, body: bytes, headers: Headers) -> Response:
        data, refused = self._generation_body(kind, body)
        return refused if refused is not None else self.openai.complete(kind, data, headers)

    @staticmethod
    def _generation_body(kind: str, body: bytes) -> tuple[Any, Response | None]:
        """The parsed body of a generation request, or the 400 that refuses it."""
        data, problem = parse_json(body)
        if problem is None and kind == "completion" and not isinstance(data, dict):
            problem = "invalid request: the body must be a JSON object"
        if problem is not None:
            GATEWAY_REQUESTS.labels("none", "none", "400").inc()
            return None, _error(400, problem)
        return data, None

    def pick(self, user_key: str) -> tuple[Arm, str, Backend, tuple[str, Backend]] | Response:
        """The arm, version and backend serving ``user_key``, and stable's (for a fallback);
        503 while no stable model is loaded."""
        stable, canary, held = self.slots.get("stable"), self.slots.get("canary"), self.slots.get("holdout")
        if stable is None:
            GATEWAY_REQUESTS.labels("none", "none", "503").inc()
            wanted = self.slots.wanted("stable")
            why = f"version {wanted} is loading or failed to load" if wanted else "no champion yet"
            return _error(503, f"no champion model loaded yet ({why})", "model_not_loaded",
                          headers=(("Retry-After", "5"),))
        arm: Arm = self._table().arm_for(user_key, canary is not None, held is not None)
        version, backend = {"canary": canary, "holdout": held}.get(arm) or stable
        return arm, version, backend, stable

    def metrics(self) -> Response:
        return Response(200, generate_latest(self._registry), CONTENT_TYPE_LATEST)

    @staticmethod
    def _probe(ok: bool, body: dict[str, object]) -> Response:
        return _json(200 if ok else 503, {"ok": ok, **body})

    def routing(self) -> Response:
        table = self._table()
        stable, canary, held = self.slots.get("stable"), self.slots.get("canary"), self.slots.get("holdout")
        h = table.holdout
        return _json(200, {
            "canary_weight": table.canary_weight,
            "stable": {"version": stable[0]} if stable else None,
            "canary": {"version": canary[0]} if canary else None,
            "salt": table.salt,
            "holdout": None if h is None else {
                "id": h.id, "version": held[0] if held else None, "pinned": h.version, "share": h.share,
                "salt": h.salt, "until": h.until, "active": h.active(time.time())},
        })

    # ----------------------------------------------------------------- completions
    def complete(self, data: Any) -> Response:
        """The token-id API (docs/gateway.md), on the parsed body."""
        try:
            req = CompletionRequest.model_validate(data)
        except ValidationError as exc:
            GATEWAY_REQUESTS.labels("none", "none", "400").inc()
            return _error(400, validation_message(exc))
        picked = self.pick(req.user_key)
        if isinstance(picked, Response):
            return picked
        if req.request_id is not None and not self.request_ids.claim(req.request_id):
            GATEWAY_REQUESTS.labels("none", "none", "409").inc()
            return _error(409, f"request_id {req.request_id} was already served; send a new id per request",
                          "duplicate_request_id")
        response = self._complete(req, *picked)
        if response.code != 200 and req.request_id is not None:
            self.request_ids.release(req.request_id)
        return response

    def _complete(self, req: CompletionRequest, arm: Arm, version: str, backend: Backend,
                  stable: tuple[str, Backend]) -> Response:
        started = time.perf_counter()
        result = self._generate(arm, version, backend, req)
        if isinstance(result, Response):
            if result.code >= 500:
                self.count(version, arm, True, req.user_key)
            return result
        gen, gen_s = result
        if arm != "stable" and gen is None:  # canary or holdout raised: stable serves, counted
            GATEWAY_FALLBACKS.inc()
            self.count(version, arm, True, req.user_key)  # counted by assignment
            arm, (version, backend) = "stable", stable
            retry = self._generate(arm, version, backend, req)
            if isinstance(retry, Response):
                return retry
            gen, gen_s = retry
        else:
            self.count(version, arm, False)
        assert gen is not None
        return self._served(req, arm, version, gen, gen_s, started)

    def _generate(
        self, arm: Arm, version: str, backend: Backend, req: CompletionRequest
    ) -> tuple[Generation | None, float] | Response:
        """(generation, seconds); (None, _) when a canary or holdout failed; a Response for errors."""
        vocab = backend.vocab_size
        if vocab is not None and max(req.prompt_tokens) >= vocab:
            GATEWAY_REQUESTS.labels(arm, version, "400").inc()
            return _error(400, f"invalid request: prompt_tokens must be below the vocabulary size {vocab}")
        max_tokens = req.max_tokens or self.settings.default_max_tokens
        t0 = time.perf_counter()
        try:
            gen = backend.generate(req.prompt_tokens, max_tokens, req.temperature)
            if len(gen.tokens) != len(gen.logprobs):
                raise ValueError(f"model returned {len(gen.tokens)} tokens but {len(gen.logprobs)} logprobs")
        except Exception as exc:
            kind = "upstream" if isinstance(exc, UpstreamError) else "generate"
            GATEWAY_ERRORS.labels(arm, version, kind).inc()
            if arm != "stable":
                log.warning("%s %s failed, serving from stable: %s", arm, version, exc)
                return None, 0.0
            code = exc.status if isinstance(exc, UpstreamError) else 500
            GATEWAY_REQUESTS.labels(arm, version, str(code)).inc()
            log.error("stable %s failed: %s", version, exc)
            return _error(code, f"model {version} failed: {exc}")
        return gen, time.perf_counter() - t0

    def _served(
        self, req: CompletionRequest, arm: Arm, version: str, gen: Generation, gen_s: float, started: float
    ) -> Response:
        sim_ms = self.settings.simulated_ms_per_token * len(gen.tokens)
        if sim_ms and self.settings.sleep_simulated_latency:
            time.sleep(sim_ms / 1000.0)
        latency_ms = round(gen_s * 1000.0 + sim_ms, 3)
        request_id = req.request_id or uuid.uuid4().hex
        kind = completion_kind(gen.tokens)
        invalid = min(gen.invalid_tool_calls, gen.tool_calls)
        model = {"name": self.model_name, "version": version}
        payload = _json(200, {
            "request_id": request_id, "model": model, "arm": arm,
            "completion_tokens": gen.tokens, "logprobs": gen.logprobs, "completion_kind": kind,
            "latency_ms": latency_ms, "tool_calls": gen.tool_calls, "invalid_tool_calls": invalid,
        })
        ts = datetime.now(UTC)
        fields: dict[str, Any] = {
            "event_id": uuid.uuid4().hex, "request_id": request_id, "ts": ts,
            "session_id": req.session_id, "user_key": req.user_key, "model": model, "arm": arm,
            "prompt_tokens": req.prompt_tokens, "completion_tokens": gen.tokens,
            "logprobs": gen.logprobs, "latency_ms": latency_ms, "tool_calls": gen.tool_calls,
            "invalid_tool_calls": invalid, "completion_kind": kind, "temperature": req.temperature,
        }
        if req.turn is not None:
            fields[ALSO] = session_events(req.session_id, request_id, req.turn, ts, [], [])
        self.log_exposure(fields)
        GATEWAY_REQUESTS.labels(arm, version, "200").inc()
        GATEWAY_SECONDS.labels(arm).observe(time.perf_counter() - started)
        return payload
