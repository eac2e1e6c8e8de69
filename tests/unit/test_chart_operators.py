"""The chart's operator keys and approval gate: the keys reach the deployer alone, as a
file it re-reads (so a rotated Secret applies), and the rendered settings parse into what
the deployer verifies and waits with."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helm"))
import chart_tools as ct
from chart_docs import Refusal, Render, deployment, env_of

from deployer.operators import parse_keys
from services.runtime.operator_keys import authority
from services.settings.model import settings_from_env

ALICE = hashlib.sha256(b"alice-token").hexdigest()
OLD, NEW = (hashlib.sha256(t).hexdigest() for t in (b"bob-old", b"bob-new"))


def test_operator_keys_are_a_file_in_the_deployer_only(render: Render, tmp_path: Path) -> None:
    docs = render(*ct.REQUIRED, "--set", f"deployer.operators.keys.alice={ALICE}",
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


def test_an_existing_secret_replaces_the_charts_and_no_keys_mount_nothing(render: Render) -> None:
    docs = render(*ct.REQUIRED, "--set", "deployer.operators.existingSecret.name=rtrl-operators",
                  "--set", "deployer.operators.existingSecret.key=keys.txt")
    pod = deployment(docs, "deployer")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "operator-keys")
    assert volume["secret"]["secretName"] == "rtrl-operators"
    assert volume["secret"]["items"] == [{"key": "keys.txt", "path": "keys"}]
    assert all("operator-keys" not in d.get("stringData", {}) for d in docs if d["kind"] == "Secret")
    bare = render(*ct.REQUIRED)
    assert "RTRL_OPERATORS__KEYS_FILE" not in env_of(bare, "deployer")
    volumes = deployment(bare, "deployer")["spec"]["template"]["spec"]["volumes"]
    assert "operator-keys" not in {v["name"] for v in volumes}


def test_approval_and_operator_settings_reach_the_deployer(render: Render) -> None:
    env = env_of(render(*ct.REQUIRED, "--set", "deployer.approval.required=true",
                        "--set", "deployer.approval.timeoutSeconds=7200",
                        "--set", "deployer.operators.maxAgeSeconds=120"), "deployer")
    settings = settings_from_env({k: v for k, v in env.items() if isinstance(v, str)})
    assert settings.deployer.approval.required and settings.deployer.approval.timeout_s == 7200
    assert settings.operators.max_age_s == 120 and not settings.operators.allow_unauthenticated
    bare = env_of(render(*ct.REQUIRED), "deployer")
    default = settings_from_env({k: v for k, v in bare.items() if isinstance(v, str)})
    assert not default.deployer.approval.required and default.deployer.approval.timeout_s == 86400


def test_keys_that_are_not_sha256_hex_are_rejected(refusal: Refusal) -> None:
    assert "alice" in refusal(*ct.REQUIRED, "--set", "deployer.operators.keys.alice=plain-token")
