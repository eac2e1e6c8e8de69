"""The gateway serves the long-term holdout's users their pinned version (fakes for HTTP, Redis
and Kafka): both APIs, before the version is loaded, when it fails, and when it expires."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from pydantic import SecretStr

from deployer.routing import Holdout, RoutingTable, assign_arm
from ingest.events import CompletionServed
from services.gateway.generation import GenRequest, Piece
from services.gateway.models import Backend, Generation, ModelSlots
from services.gateway.server import Gateway
from services.settings.services import GatewaySettings

pytestmark = pytest.mark.unit

KEY = "sk-holdout"
USERS = [f"user-{i}" for i in range(120)]


@pytest.fixture
def holdout() -> Holdout:
    """A holdout running now (built per test: a suite can run for longer than its hour)."""
    now = time.time()
    return Holdout(id="holdout-v0-x", version="0", share=0.3, salt="holdout-salt", started_at=now - 60,
                   until=now + 3600)


class Tagged:
    """A model that answers with its own version as the one token (so the version is visible)."""

    vocab_size = None

    def __init__(self, token: int, fail: bool = False) -> None:
        self.token, self.fail = token, fail

    def generate(self, prompt_tokens: Sequence[int], max_tokens: int, temperature: float) -> Generation:
        if self.fail:
            raise RuntimeError("pinned model broke")
        return Generation([self.token], [-0.5])

    def stream(self, req: GenRequest, stream: bool = True) -> Iterator[Piece]:
        if self.fail:
            raise RuntimeError("pinned model broke")
        yield Piece(text=str(self.token), tokens=[self.token], logprobs=[-0.5], prompt_tokens=[7],
                    finish_reason="stop", client_logprobs={"tokens": ["x"], "token_logprobs": [-0.5]})

    def close(self) -> None:
        pass


def make(holdout: Holdout | None, held_loaded: bool = True, held_fails: bool = False,
         ) -> tuple[Gateway, list[dict[str, Any]], list[tuple[Any, ...]]]:
    backends = {"1": Tagged(10), "2": Tagged(20), "0": Tagged(30, fail=held_fails)}
    slots = ModelSlots(lambda _arm, v: backends[v])  # type: ignore[arg-type,return-value]
    slots.want("1", "2", "0" if held_loaded and holdout is not None else None)
    slots.step()
    table = RoutingTable(0.5, "canary-salt", "1", "2", holdout=holdout)
    logged: list[dict[str, Any]] = []
    counts: list[tuple[Any, ...]] = []
    cfg = GatewaySettings(api_keys={"team": SecretStr(KEY)})
    gw = Gateway(cfg, slots, lambda: table, logged.append, "rtrl-policy",
                 count=lambda v, a, e, u=None: counts.append((v, a, e, u)))
    return gw, logged, counts


def tokens_api(gw: Gateway, user: str) -> dict[str, Any]:
    body = {"user_key": user, "session_id": "s", "prompt_tokens": [1, 2]}
    resp = gw.handle("POST", "/v1/completions", json.dumps(body).encode(), None,
                     {"Authorization": f"Bearer {KEY}"})
    assert resp.code == 200, resp.body
    out: dict[str, Any] = json.loads(resp.body)
    return out


def chat(gw: Gateway, user: str) -> dict[str, Any]:
    body = {"model": "rtrl-policy", "user": user, "messages": [{"role": "user", "content": "hi"}]}
    resp = gw.handle("POST", "/v1/chat/completions", json.dumps(body).encode(), None,
                     {"Authorization": f"Bearer {KEY}"})
    assert resp.code == 200, resp.body
    out: dict[str, Any] = json.loads(resp.body)
    return out


def expected(user: str, holdout: Holdout | None, now: float) -> tuple[str, str]:
    if holdout is not None and holdout.holds(user, now):
        return "holdout", "0"
    arm = assign_arm(user, "canary-salt", 0.5)
    return arm, ("2" if arm == "canary" else "1")


def test_held_out_users_get_the_pinned_version_on_both_apis_and_events_say_so(holdout: Holdout) -> None:
    gw, logged, _ = make(holdout)
    seen = set()
    for user in USERS:
        arm, version = expected(user, holdout, time.time())
        out = tokens_api(gw, user)
        assert (out["arm"], out["model"]["version"]) == (arm, version)
        ext = chat(gw, user)["rtrl"]
        assert (ext["arm"], ext["version"]) == (arm, version)
        seen.add(arm)
    assert seen == {"holdout", "stable", "canary"}
    events = [CompletionServed(**e) for e in logged]  # the event contract accepts the holdout arm
    assert {(e.arm, e.model.version) for e in events if e.arm == "holdout"} == {("holdout", "0")}
    routing = json.loads(gw.handle("GET", "/v1/routing", b"", None, {"Authorization": f"Bearer {KEY}"}).body)
    assert routing["holdout"]["version"] == "0" and routing["holdout"]["share"] == 0.3
    assert routing["holdout"]["active"] is True


def test_until_the_pinned_version_is_loaded_its_users_get_stable_never_the_canary(holdout: Holdout) -> None:
    gw, _, _ = make(holdout, held_loaded=False)
    held = [u for u in USERS if holdout.holds(u, time.time())]
    assert held
    for user in held:
        out = tokens_api(gw, user)
        assert (out["arm"], out["model"]["version"]) == ("stable", "1")


def test_a_failing_pinned_version_falls_back_to_stable_and_is_counted_against_the_holdout(
        holdout: Holdout) -> None:
    gw, logged, counts = make(holdout, held_fails=True)
    user = next(u for u in USERS if holdout.holds(u, time.time()))
    assert tokens_api(gw, user)["arm"] == "stable"
    assert chat(gw, user)["rtrl"]["arm"] == "stable"
    assert counts.count(("0", "holdout", True, user)) == 2
    assert {e["arm"] for e in logged} == {"stable"}


def test_an_expired_holdout_holds_nobody(holdout: Holdout) -> None:
    ended = Holdout(**{**holdout.__dict__, "until": time.time() - 1})
    gw, _, _ = make(ended)
    for user in USERS[:40]:
        arm, _ = expected(user, None, time.time())
        assert tokens_api(gw, user)["arm"] == arm


def test_the_holdout_slot_stops_serving_at_once_when_its_version_changes() -> None:
    loads: list[str] = []

    def loader(_arm: str, version: str) -> Backend:
        loads.append(version)
        return Tagged(int(version))

    slots = ModelSlots(loader)  # type: ignore[arg-type]
    slots.want("1", None, "1")  # pinned = the champion: loaded once, shared
    slots.step()
    assert loads == ["1"] and slots.get("holdout") is not None
    slots.want("1", None, "3")
    assert slots.get("holdout") is None and slots.get("stable") is not None
    slots.step()
    held = slots.get("holdout")
    assert held is not None and held[0] == "3" and loads == ["1", "3"]
    slots.want("1", None, None)
    assert slots.get("holdout") is None
