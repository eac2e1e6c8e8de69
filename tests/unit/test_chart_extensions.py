"""The chart's extension points, rendered: image registry and digest, common labels, pod
extras (sidecars, init containers, volumes, spread, security contexts, priority) on every
component and the vLLM server, the ServiceMonitor's namespace and relabelings, the
gateway's Ingress, KEDA ScaledObjects and the `helm test` pods."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helm"))
import chart_tools as ct
from chart_docs import Docs, Refusal, Render, by_kind, container, deployments, pod

EXAMPLE = ["-f", str(ct.HELM_DIR / "examples" / "extension-points.yaml")]
DIGEST = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
WORKERS = ("ingest", "reward", "trainer", "deployer")


@pytest.fixture(scope="module")
def example(render: Render) -> Docs:
    return render(*EXAMPLE)


@pytest.fixture(scope="module")
def default(render: Render) -> Docs:
    return render(*ct.REQUIRED)


# --- image ---------------------------------------------------------------------------------
def test_the_default_image_is_the_registry_the_repository_and_the_app_version(default) -> None:
    images = {c["image"] for d in by_kind(default, "Deployment") for c in pod(d)["containers"]}
    assert images == {"ghcr.io/rtrl/rtrl:0.1.0"}


def test_a_digest_wins_over_the_tag_and_the_global_registry_over_the_images(example) -> None:
    deps = deployments(example)
    for component in ("gateway", *WORKERS):
        image = container(deps[component], component)["image"]
        assert image == f"registry.example.internal/mirror/rtrl/rtrl@{DIGEST}", component
    vllm_image = container(deps["vllm"], "vllm")["image"]
    assert vllm_image == "registry.example.internal/mirror/vllm/vllm-openai:v0.32.0"
    for test_pod in by_kind(example, "Pod"):
        assert test_pod["spec"]["containers"][0]["image"].endswith(f"@{DIGEST}")


@pytest.mark.parametrize(("settings", "image"), [
    (["image.registry=", "image.repository=example.org/rtrl"], "example.org/rtrl:1.2.3"),
    (["image.repository=example.org/rtrl"], "example.org/rtrl:1.2.3"),  # a host of its own stays
    (["image.repository=localhost:5000/rtrl", "global.imageRegistry=mirror.example"],
     "localhost:5000/rtrl:1.2.3"),
    (["image.repository=team/rtrl", "global.imageRegistry=mirror.example/"],
     "mirror.example/team/rtrl:1.2.3"),
])
def test_a_tag_is_used_without_a_digest(render: Render, settings: list[str], image: str) -> None:
    sets = [arg for setting in settings for arg in ("--set", setting)]
    docs = render(*ct.REQUIRED, "--set", "image.tag=1.2.3", *sets)
    assert {c["image"] for d in by_kind(docs, "Deployment") for c in pod(d)["containers"]} == {image}


@pytest.mark.parametrize("setting", ["image.digest=sha256:short", "image.digest=latest", "image.registy=x"])
def test_the_schema_rejects_a_bad_digest_and_typos_in_image(refusal: Refusal, setting: str) -> None:
    assert "schema" in refusal(*ct.REQUIRED, "--set", setting)


# --- labels --------------------------------------------------------------------------------
def test_common_labels_reach_every_resource_and_pod(example) -> None:
    for doc in example:
        labels = doc["metadata"]["labels"]
        assert labels["team"] == "ml-platform" and labels["cost-center"] == "4711", doc["kind"]
    for dep in by_kind(example, "Deployment"):
        assert dep["spec"]["template"]["metadata"]["labels"]["team"] == "ml-platform"
        assert "team" not in dep["spec"]["selector"]["matchLabels"], "labels never join selectors"


# --- pod extras ----------------------------------------------------------------------------
def test_pod_extras_reach_the_gateway(example) -> None:
    gw = deployments(example)["gateway"]
    spec = pod(gw)
    main = container(gw, "gateway")
    assert [c["name"] for c in spec["containers"]] == ["gateway", "log-shipper"]
    assert [c["name"] for c in spec["initContainers"]] == ["wait-for-redis"]
    assert spec["priorityClassName"] == "rtrl-high"
    (spread,) = spec["topologySpreadConstraints"]
    assert spread["labelSelector"]["matchLabels"] == gw["spec"]["selector"]["matchLabels"]
    assert {"name": "upstream-token", "secret": {"secretName": "upstream-token"}} in spec["volumes"]
    assert {"name": "upstream-token", "mountPath": "/etc/upstream", "readOnly": True} in main["volumeMounts"]
    assert {"name": "tmp", "mountPath": "/tmp"} in main["volumeMounts"], "the chart's own mounts stay"
    otel = {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://otel-collector.observability:4318"}
    assert otel in main["env"]
    meta = gw["spec"]["template"]["metadata"]
    assert meta["labels"]["tier"] == "edge" and meta["annotations"]["example.com/scrape-logs"] == "true"


def test_security_contexts_merge_over_the_charts_hardening(example) -> None:
    gw = deployments(example)["gateway"]
    psc = pod(gw)["securityContext"]
    assert psc["supplementalGroups"] == [3000]
    assert psc["runAsNonRoot"] is True and psc["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container(gw, "gateway")["securityContext"]
    assert sc["runAsUser"] == 10002
    assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"] == {"drop": ["ALL"]}
    assert pod(deployments(example)["trainer"])["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"


def test_pod_extras_reach_every_component_and_the_vllm_server(example) -> None:
    deps = deployments(example)
    assert pod(deps["ingest"])["topologySpreadConstraints"][0]["labelSelector"] == {
        "matchLabels": {"app.kubernetes.io/component": "ingest"}}, "a given labelSelector is kept"
    assert pod(deps["reward"])["priorityClassName"] == "rtrl-batch"
    assert deps["reward"]["spec"]["template"]["metadata"]["annotations"]["example.com/owner"] == "ml-platform"
    trainer = container(deps["trainer"], "trainer")
    assert {"name": "datasets", "mountPath": "/datasets", "readOnly": True} in trainer["volumeMounts"]
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert any(e["name"] == "HTTPS_PROXY" for e in container(deps["deployer"], "deployer")["env"])
    vllm = deps["vllm"]
    assert pod(vllm)["priorityClassName"] == "inference-critical"
    assert vllm["spec"]["template"]["metadata"]["labels"]["workload"] == "inference"
    assert pod(vllm)["securityContext"] == {"fsGroup": 2000, "seccompProfile": {"type": "RuntimeDefault"}}
    hf_cache = {"name": "hf-cache", "mountPath": "/root/.cache/huggingface"}
    assert hf_cache in container(vllm, "vllm")["volumeMounts"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container(vllm, "vllm")["env"]


def test_without_extras_the_pods_are_unchanged(default) -> None:
    for dep in by_kind(default, "Deployment"):
        spec = pod(dep)
        assert len(spec["containers"]) == 1
        assert not {"initContainers", "topologySpreadConstraints", "priorityClassName"} & set(spec)


@pytest.mark.parametrize("setting", ["gateway.sidecar[0].name=x", "ingest.extraVolume[0].name=x",
                                     "engine.vllm.podSecurityContex.fsGroup=1"])
def test_the_schema_rejects_typos_in_extension_points(refusal: Refusal, setting: str) -> None:
    assert "schema" in refusal(*ct.REQUIRED, "--set", setting)


# --- monitoring ----------------------------------------------------------------------------
def test_servicemonitor_namespace_and_relabelings(example) -> None:
    (sm,) = by_kind(example, "ServiceMonitor")
    assert sm["metadata"]["namespace"] == "monitoring"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["rtrl"]}, "it scrapes the release's namespace"
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["relabelings"][0]["targetLabel"] == "node"
    assert endpoint["metricRelabelings"][0]["action"] == "drop"
    (rule,) = by_kind(example, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"


# --- ingress -------------------------------------------------------------------------------
def test_the_ingress_routes_to_the_gateways_http_port(example) -> None:
    (ing,) = by_kind(example, "Ingress")
    (svc,) = [s for s in by_kind(example, "Service") if s["metadata"]["name"] == "rel-rtrl-gateway"]
    assert ing["spec"]["ingressClassName"] == "nginx"
    assert ing["spec"]["tls"] == [{"hosts": ["rtrl.example.com"], "secretName": "rtrl-example-com-tls"}]
    (rule,) = ing["spec"]["rules"]
    assert rule["host"] == "rtrl.example.com"
    (path,) = rule["http"]["paths"]
    assert path["path"] == "/v1" and path["pathType"] == "Prefix"
    backend = path["backend"]["service"]
    assert backend["name"] == svc["metadata"]["name"]
    assert backend["port"]["name"] in {p["name"] for p in svc["spec"]["ports"]}
    assert ing["metadata"]["annotations"]["cert-manager.io/cluster-issuer"] == "letsencrypt"


def test_no_ingress_by_default_and_none_without_hosts(refusal: Refusal, default) -> None:
    assert not by_kind(default, "Ingress")
    err = refusal(*ct.REQUIRED, "--set", "gateway.ingress.enabled=true")
    assert "gateway.ingress.hosts" in err


# --- KEDA ----------------------------------------------------------------------------------
def test_keda_scales_ingest_and_reward_on_their_input_topics_lag(example) -> None:
    objects = {s["metadata"]["name"]: s for s in by_kind(example, "ScaledObject")}
    assert set(objects) == {"rel-rtrl-ingest", "rel-rtrl-reward"}
    assert not by_kind(example, "HorizontalPodAutoscaler")
    deps = {d["metadata"]["name"]: d for d in by_kind(example, "Deployment")}
    expected = {"rel-rtrl-ingest": ("rtrl.raw.v1", "rtrl-ingest", "500", 1),
                "rel-rtrl-reward": ("rtrl.events.v1", "rtrl-reward", "2000", 0)}
    for name, so in objects.items():
        target = so["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", name)
        assert "replicas" not in deps[name]["spec"], "KEDA owns replicas"
        (trigger,) = so["spec"]["triggers"]
        meta = trigger["metadata"]
        assert trigger["type"] == "kafka"
        assert all(isinstance(v, str) for v in meta.values()), "KEDA's trigger metadata is a map of strings"
        assert (meta["topic"], meta["consumerGroup"], meta["lagThreshold"], so["spec"]["minReplicaCount"]) \
            == expected[name]
        assert meta["bootstrapServers"] == "kafka:9092"
        assert so["spec"]["maxReplicaCount"] == 4


def test_scaled_objects_match_the_keda_models(example, render: Render) -> None:
    from cloudcoil.models.keda import v1alpha1

    secured = render(*ct.REQUIRED, "--set", "reward.keda.enabled=true",
                     "--set", "kafka.securityProtocol=SASL_SSL", "--set", "kafka.sasl.mechanism=PLAIN",
                     "--set", "reward.keda.authenticationRef=kafka-auth")
    docs = by_kind(example, "ScaledObject") + by_kind(secured, "ScaledObject")
    assert len(docs) == 3
    for doc in docs:
        assert doc["apiVersion"] == "keda.sh/v1alpha1"
        model = v1alpha1.ScaledObject.model_validate(doc)
        # The models ignore unknown fields: a field lost on the round trip is a typo.
        assert model.model_dump(mode="json", by_alias=True, exclude_none=True) == doc, doc["metadata"]["name"]


def test_keda_is_off_by_default(default) -> None:
    assert not by_kind(default, "ScaledObject")


def test_keda_and_the_hpa_for_one_component_are_refused(refusal: Refusal) -> None:
    err = refusal(*ct.REQUIRED, "--set", "ingest.keda.enabled=true",
                  "--set", "ingest.autoscaling.enabled=true")
    assert "choose one autoscaler" in err and "ingest.keda.enabled" in err


def test_keda_with_a_secured_kafka_needs_a_trigger_authentication(render: Render, refusal: Refusal) -> None:
    args = [*ct.REQUIRED, "--set", "reward.keda.enabled=true", "--set", "kafka.securityProtocol=SASL_SSL",
            "--set", "kafka.sasl.mechanism=PLAIN"]
    assert "reward.keda.authenticationRef" in refusal(*args)
    docs = render(*args, "--set", "reward.keda.authenticationRef=kafka-auth")
    (so,) = by_kind(docs, "ScaledObject")
    assert so["spec"]["triggers"][0]["authenticationRef"] == {"name": "kafka-auth"}


# --- helm test -----------------------------------------------------------------------------
def test_helm_test_pods_check_the_gateway_and_every_worker_through_their_services(default) -> None:
    pods = {p["metadata"]["name"]: p for p in by_kind(default, "Pod")}
    assert set(pods) == {"rel-rtrl-test-gateway", "rel-rtrl-test-workers"}
    services = {s["metadata"]["name"]: {p["port"] for p in s["spec"]["ports"]}
                for s in by_kind(default, "Service")}
    for p in pods.values():
        assert p["metadata"]["annotations"]["helm.sh/hook"] == "test"
        assert p["spec"]["restartPolicy"] == "Never"
        (c,) = p["spec"]["containers"]
        assert c["command"][:2] == ["python", "-c"]
        assert c["command"][2] == (ct.CHART / "files" / "tests" / "http_check.py").read_text()
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        for url in c["args"]:
            host, port = url.removeprefix("http://").split("/")[0].split(":")
            assert int(port) in services[host], url
    assert [u.rsplit("/", 2)[-2:] for u in pods["rel-rtrl-test-gateway"]["spec"]["containers"][0]["args"]] \
        == [["rel-rtrl-gateway:80", "readyz"], ["v1", "models"]]
    workers = pods["rel-rtrl-test-workers"]["spec"]["containers"][0]["args"]
    assert workers == [f"http://rel-rtrl-{w}:9100/readyz" for w in WORKERS]
    env = {e["name"]: e for e in pods["rel-rtrl-test-gateway"]["spec"]["containers"][0]["env"]}
    assert env["RTRL_GATEWAY__API_KEYS"]["valueFrom"]["secretKeyRef"]["key"] == "gateway-api-keys"


def test_network_policies_let_the_test_pods_reach_the_probes(default) -> None:
    (test_pod,) = [p for p in by_kind(default, "Pod") if p["metadata"]["name"].endswith("workers")]
    labels = test_pod["metadata"]["labels"]
    for policy in by_kind(default, "NetworkPolicy"):
        if policy["metadata"]["labels"]["app.kubernetes.io/component"] == "vllm":
            continue
        peers = [peer for rule in policy["spec"]["ingress"] for peer in rule.get("from", [])]
        assert any("podSelector" in peer and "namespaceSelector" not in peer
                   and all(labels.get(k) == v for k, v in peer["podSelector"]["matchLabels"].items())
                   for peer in peers), policy["metadata"]["name"]


def test_tests_can_be_left_out(render: Render) -> None:
    docs = render(*ct.REQUIRED, "--set", "tests.enabled=false")
    assert not by_kind(docs, "Pod")
    assert "helm-test" not in str(by_kind(docs, "NetworkPolicy"))
