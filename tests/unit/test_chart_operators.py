"""The chart's operator keys and approval gate: the keys reach the deployer alone, as a
file it re-reads (so a rotated Secret applies), and the rendered settings parse into what
the deployer verifies and waits with."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helm"))
import chart_tools as ct

from deployer.operators import parse_keys
from services.runtime.operator_keys import authority
from services.runtime.settings import settings_from_env

ALICE = hashlib.sha256(b"alice-token").hexdigest()
OLD, NEW = (hashlib.sha256(t).hexdigest() for t in (b"bob-old", b"bob-new"))


@pytest.fixture(scope="module")
def render(tmp_path_factory: pytest.TempPathFactory) -> Any:
    helm, env = ct.tool("helm"), ct.helm_env(tmp_path_factory.mktemp("helm-home"))

    def run(*args: str) -> list[dict[str, Any]]:
        proc = ct.helm_template(helm, env, [*ct.REQUIRED, *args])
        assert proc.returncode == 0, proc.stderr
        return ct.documents(proc.stdout)
    return run


def deployment(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == "Deployment"
                and d["metadata"]["labels"]["app.kubernetes.io/component"] == component)


def env_of(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-settings")]
    (container,) = deployment(docs, component)["spec"]["template"]["spec"]["containers"]
    return {**cm["data"], **{e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}}


def test_operator_keys_are_a_file_in_the_deployer_only(render: Any, tmp_path: Path) -> None:
    docs = render("--set", f"deployer.operators.keys.alice={ALICE}",
                  "--set", f"deployer.operators.keys.bob={{{OLD},{NEW}}}")
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    keys = parse_keys(secret["stringData"]["operator-keys"])
    assert keys == {"alice": (bytes.fromhex(ALICE),), "bob": (bytes.fromhex(OLD), bytes.fromhex(NEW))}
    pod = deployment(docs, "deployer")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "operator-keys")
    assert volume["secret"]["items"] == [{"key": "operator-keys", "path": "keys"}]
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["operator-keys"] == {"name": "operator-keys", "mountPath": "/etc/rtrl/operators",
                                       "readOnly": True}
    env = env_of(docs, "deployer")
    assert env["RTRL_OPERATORS__KEYS_FILE"] == "/etc/rtrl/operators/keys"
    for other in ("gateway", "ingest", "reward", "trainer"):
        assert "RTRL_OPERATORS__KEYS_FILE" not in env_of(docs, other)
        spec = deployment(docs, other)["spec"]["template"]["spec"]
        assert "operator-keys" not in {v["name"] for v in spec["volumes"]}
    # the file as mounted is what the deployer reads
    (tmp_path / "keys").write_text(secret["stringData"]["operator-keys"])
    settings = settings_from_env({k: v for k, v in env.items() if isinstance(v, str)}
                                 | {"RTRL_OPERATORS__KEYS_FILE": str(tmp_path / "keys")})
    assert authority(settings.operators).keys == keys


def test_an_existing_secret_replaces_the_charts_and_no_keys_mount_nothing(render: Any) -> None:
    docs = render("--set", "deployer.operators.existingSecret.name=rtrl-operators",
                  "--set", "deployer.operators.existingSecret.key=keys.txt")
    pod = deployment(docs, "deployer")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "operator-keys")
    assert volume["secret"]["secretName"] == "rtrl-operators"
    assert volume["secret"]["items"] == [{"key": "keys.txt", "path": "keys"}]
    assert all("operator-keys" not in d.get("stringData", {}) for d in docs if d["kind"] == "Secret")
    bare = render()
    assert "RTRL_OPERATORS__KEYS_FILE" not in env_of(bare, "deployer")
    volumes = deployment(bare, "deployer")["spec"]["template"]["spec"]["volumes"]
    assert "operator-keys" not in {v["name"] for v in volumes}


def test_approval_and_operator_settings_reach_the_deployer(render: Any) -> None:
    env = env_of(render("--set", "deployer.approval.required=true",
                        "--set", "deployer.approval.timeoutSeconds=7200",
                        "--set", "deployer.operators.maxAgeSeconds=120"), "deployer")
    settings = settings_from_env({k: v for k, v in env.items() if isinstance(v, str)})
    assert settings.deployer.approval.required and settings.deployer.approval.timeout_s == 7200
    assert settings.operators.max_age_s == 120 and not settings.operators.allow_unauthenticated
    default = settings_from_env({k: v for k, v in env_of(render(), "deployer").items() if isinstance(v, str)})
    assert not default.deployer.approval.required and default.deployer.approval.timeout_s == 86400


def test_keys_that_are_not_sha256_hex_are_rejected(tmp_path_factory: pytest.TempPathFactory) -> None:
    helm, env = ct.tool("helm"), ct.helm_env(tmp_path_factory.mktemp("helm-home"))
    proc = ct.helm_template(helm, env, [*ct.REQUIRED, "--set", "deployer.operators.keys.alice=plain-token"])
    assert proc.returncode != 0 and "alice" in proc.stderr
