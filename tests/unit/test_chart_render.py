"""The Helm chart, rendered for every values file: lint, Kubernetes schemas, the
prometheus-operator models, and assertions on the parsed manifests (security context,
probes, selectors, NetworkPolicies, secrets, the settings the services read)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from kubernetes_validate.utils import SchemaNotFoundError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helm"))
import chart_tools as ct
from chart_docs import Refusal, Render, by_kind, component_of, env_of, main_container

K8S_VERSIONS = ("1.25.0", "1.37.0")  # the chart's kubeVersion floor and the newest schema
COMPONENTS = ("gateway", "ingest", "reward", "trainer", "deployer")


@pytest.fixture(scope="module")
def rendered(helm: str, helm_env: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for name, args in ct.VALUES_SETS.items():
        proc = ct.helm_template(helm, helm_env, args)
        assert proc.returncode == 0, f"helm template ({name}) failed:\n{proc.stderr}"
        out[name] = ct.documents(proc.stdout)
    return out


def each(rendered: dict[str, list[dict[str, Any]]], kind: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every ``kind`` document of rtrl's own components (not the optional vLLM server, whose
    image and probes are vLLM's: test_vllm_* check it)."""
    for name, docs in rendered.items():
        for doc in docs:
            if doc["kind"] == kind and doc["metadata"]["labels"].get("app.kubernetes.io/component") != "vllm":
                yield name, doc


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pod_labels(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    deps = by_kind(docs, "Deployment")
    return {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in deps}


# --- lint and schemas ---------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(ct.VALUES_SETS))
def test_helm_lint_strict(helm: str, helm_env: dict[str, str], name: str) -> None:
    proc = ct.run([helm, "lint", "--strict", str(ct.CHART), *ct.VALUES_SETS[name]], env=helm_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_core_manifests_valid_under_strict_kubernetes_schemas(rendered, version: str) -> None:
    checked = 0
    for name, docs in rendered.items():
        for doc in docs:
            if doc["apiVersion"].startswith(("monitoring.coreos.com/", "ray.io/", "keda.sh/")):
                continue
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except SchemaNotFoundError:
                pytest.fail(f"{name}: no Kubernetes {version} schema for {doc['kind']} {doc['apiVersion']}")
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']} at {path}: {e.message}")
            checked += 1
    assert checked > 40


def test_raycluster_pod_templates_are_valid_pod_templates(rendered) -> None:
    clusters = list(each(rendered, "RayCluster"))
    assert {name for name, _ in clusters} == {"everything", "strimzi"}
    templates = [ray["spec"]["headGroupSpec"]["template"] for _, ray in clusters]
    templates += [g["template"] for _, ray in clusters for g in ray["spec"]["workerGroupSpecs"]]
    for template in templates:
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "ray"},
                   "template": template}
        kubernetes_validate.validate(wrapped, K8S_VERSIONS[-1], strict=True)
        container = template["spec"]["containers"][0]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert all(ray["spec"]["rayVersion"] == "2.60.0" for _, ray in clusters)


@pytest.mark.parametrize("kind", ["PrometheusRule", "ServiceMonitor"])
def test_monitoring_resources_match_the_prometheus_operator_models(rendered, kind: str) -> None:
    from cloudcoil.models.prometheus_operator import v1

    found = list(each(rendered, kind))
    assert {name for name, _ in found} == {"everything", "strimzi", "extension-points"}
    for name, doc in found:
        model = getattr(v1, kind).model_validate(doc)
        # The models ignore unknown fields: a field lost on the round trip is a typo.
        assert model.model_dump(mode="json", by_alias=True, exclude_none=True) == doc, name


# --- the pods -----------------------------------------------------------------------------
def test_every_component_has_a_deployment(rendered) -> None:
    for name, docs in rendered.items():
        components = {component_of(d) for d in by_kind(docs, "Deployment")}
        assert components - {"vllm"} == set(COMPONENTS), name
        assert ("vllm" in components) == (name in {"vllm", "extension-points"}), name


def test_pods_run_as_non_root_with_a_read_only_root_filesystem(rendered) -> None:
    for name, dep in each(rendered, "Deployment"):
        spec = dep["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] > 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        container = main_container(dep)
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True, name
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]], "a writable /tmp is needed with a read-only root"


def test_probes_hit_health_endpoints_on_a_declared_port(rendered) -> None:
    for name, dep in each(rendered, "Deployment"):
        container = main_container(dep)
        ports = {p["name"] for p in container["ports"]}
        paths = {
            probe: (container[probe]["httpGet"]["path"], container[probe]["httpGet"]["port"])
            for probe in ("startupProbe", "livenessProbe", "readinessProbe")
        }
        assert paths["livenessProbe"][0] == "/healthz"
        assert paths["startupProbe"][0] == "/healthz"
        assert paths["readinessProbe"][0] == "/readyz"
        assert {port for _, port in paths.values()} <= ports, f"{name}: probe on an undeclared port"
        assert container["resources"]["requests"]["memory"], name
        assert container["command"][:2] == ["rtrl", "serve"]


def test_singletons_run_one_pod_with_recreate(rendered) -> None:
    for _, dep in each(rendered, "Deployment"):
        if dep["metadata"]["labels"]["app.kubernetes.io/component"] in {"trainer", "deployer"}:
            assert dep["spec"]["replicas"] == 1
            assert dep["spec"]["strategy"] == {"type": "Recreate"}


def test_selectors_match_pod_labels(rendered) -> None:
    for name, docs in rendered.items():
        pods = pod_labels(docs)
        for dep in by_kind(docs, "Deployment"):
            template_labels = dep["spec"]["template"]["metadata"]["labels"]
            assert selects(dep["spec"]["selector"]["matchLabels"], template_labels)
        for kind, get in [
            ("Service", lambda d: d["spec"]["selector"]),
            ("PodDisruptionBudget", lambda d: d["spec"]["selector"]["matchLabels"]),
            ("NetworkPolicy", lambda d: d["spec"]["podSelector"]["matchLabels"]),
        ]:
            for doc in by_kind(docs, kind):
                matched = [pod for pod, labels in pods.items() if selects(get(doc), labels)]
                own = doc["metadata"]["name"]
                assert matched == [own], f"{name}: {kind} {own} selects {matched}"


def test_service_target_ports_exist_on_the_selected_pods(rendered) -> None:
    for name, docs in rendered.items():
        deps = {d["metadata"]["name"]: d for d in by_kind(docs, "Deployment")}
        for svc in by_kind(docs, "Service"):
            container = main_container(deps[svc["metadata"]["name"]])
            names = {p["name"] for p in container["ports"]}
            assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names, name
            port_names = {p["name"] for p in svc["spec"]["ports"]}
            assert "metrics" in port_names, "the ServiceMonitor scrapes 'metrics'"


def test_servicemonitor_selects_every_service(rendered) -> None:
    for name, sm in each(rendered, "ServiceMonitor"):
        services = by_kind(rendered[name], "Service")
        assert all(selects(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"]) for s in services)
        assert sm["spec"]["endpoints"][0]["port"] == "metrics"


def test_hpa_targets_a_deployment_without_fixed_replicas(rendered) -> None:
    hpas = list(each(rendered, "HorizontalPodAutoscaler"))
    assert {h["metadata"]["name"] for _, h in hpas} == {"rel-rtrl-ingest", "rel-rtrl-reward"}
    for name, hpa in hpas:
        deps = {d["metadata"]["name"]: d for d in by_kind(rendered[name], "Deployment")}
        target = deps[hpa["spec"]["scaleTargetRef"]["name"]]
        assert "replicas" not in target["spec"], "the HPA owns replicas"


def test_every_pod_is_isolated_by_a_network_policy(rendered) -> None:
    for name, docs in rendered.items():
        policies = by_kind(docs, "NetworkPolicy")
        for pod, labels in pod_labels(docs).items():
            mine = [p for p in policies if selects(p["spec"]["podSelector"]["matchLabels"], labels)]
            assert mine, f"{name}: {pod} has no NetworkPolicy"
            assert set(mine[0]["spec"]["policyTypes"]) == {"Ingress", "Egress"}


def test_network_policies_allow_only_what_each_component_needs(rendered) -> None:
    docs = rendered["small"]
    policies = {component_of(p): p for p in by_kind(docs, "NetworkPolicy")}

    def egress_ports(component: str) -> set[int]:
        return {p["port"] for rule in policies[component]["spec"]["egress"] for p in rule["ports"]}

    assert egress_ports("ingest") == {53, 9092, 6379}  # DNS, Kafka, Redis: no MLflow
    assert egress_ports("gateway") == {53, 9092, 6379, 5000}
    assert egress_ports("trainer") == {53, 9092, 6379, 5000}  # Ray runs inside the pod here
    assert egress_ports("deployer") == {53, 9092, 6379, 5000}  # no webhooks configured: no 443
    notifying = next(r for r in by_kind(rendered["everything"], "NetworkPolicy")
                     if r["metadata"]["name"] == "rel-rtrl-deployer")["spec"]["egress"]
    assert {"port": 443, "protocol": "TCP"} in [p for rule in notifying for p in rule["ports"]]
    ingress = policies["ingest"]["spec"]["ingress"]
    assert len(ingress) == 1 and ingress[0]["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert ingress[0]["from"], "metrics only from Prometheus"
    ray_rules = next(r for r in by_kind(rendered["everything"], "NetworkPolicy")
                     if r["metadata"]["name"] == "rel-rtrl-trainer")["spec"]["egress"]
    assert {"podSelector": {"matchLabels": {"ray.io/cluster": "rel-rtrl-ray"}}} in [
        peer for rule in ray_rules for peer in rule.get("to", [])
    ]


# --- settings and secrets -----------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(ct.VALUES_SETS))
@pytest.mark.parametrize("component", COMPONENTS)
def test_services_parse_the_rendered_settings(rendered, name: str, component: str, monkeypatch) -> None:
    from services.settings.model import Settings

    env = env_of(rendered[name], component)
    for key, value in env.items():
        if isinstance(value, dict):  # from a Secret: any well-formed value
            value = {"RTRL_REDIS__URL": "redis://r:6379/0", "RTRL_AUTH__KEYS": '{"gateway": "v"}',
                     "RTRL_GATEWAY__API_KEYS": '{"app": "k"}',
                     "RTRL_NOTIFY__URLS": '["https://hooks.example/x"]'}.get(key, "x")
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.http.host == "0.0.0.0"
    assert settings.kafka.bootstrap_servers == env["RTRL_KAFKA__BOOTSTRAP_SERVERS"]
    if component == "gateway":
        assert settings.gateway.host == "0.0.0.0"
        assert settings.gateway.port == 8080
    if component == "trainer":
        assert str(settings.trainer.data_dir) == "/var/lib/rtrl/trainer"
        want = (2, 2, True) if name == "everything" else (1, 1, False)
        assert (settings.ray.num_workers, settings.ray.cpus_per_worker, settings.ray.use_gpu) == want
    if component == "deployer" and name == "everything":
        assert settings.notify.format == "slack" and settings.notify.secret is not None
        assert settings.notify.mlflow_ui_url == "https://mlflow.example.com"
        assert [u.get_secret_value() for u in settings.notify.urls] == ["https://hooks.example/x"]


def test_credentials_come_from_secrets_never_the_configmap(rendered) -> None:
    docs = rendered["everything"]
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-settings")]
    assert not any("s3cret" in v for v in cm["data"].values())
    (secret,) = by_kind(docs, "Secret")
    assert set(secret["stringData"]) == {"kafka-sasl-password", "redis-url", "auth-keys", "gateway-api-keys",
                                         "engine-api-key", "notify-urls", "notify-hmac-key"}
    assert secret["stringData"]["notify-urls"] == '["https://hooks.example/s3cret-hook"]'
    deployer_env = env_of(docs, "deployer")
    assert deployer_env["RTRL_NOTIFY__URLS"]["secretKeyRef"]["key"] == "notify-urls"
    assert deployer_env["RTRL_NOTIFY__SECRET"]["secretKeyRef"]["key"] == "notify-hmac-key"
    assert "RTRL_NOTIFY__URLS" not in env_of(docs, "gateway"), "only the deployer sends notifications"
    assert env_of(docs, "gateway")["RTRL_GATEWAY__API_KEYS"]["secretKeyRef"]["key"] == "gateway-api-keys"
    for component in ("gateway", "deployer"):
        assert env_of(docs, component)["RTRL_ENGINE__API_KEY"]["secretKeyRef"]["key"] == "engine-api-key"
    assert "RTRL_GATEWAY__API_KEYS" not in env_of(docs, "ingest"), "only the gateway holds client keys"
    assert secret["stringData"]["auth-keys"] == '{"gateway":"s3cret-auth"}'
    assert env_of(docs, "ingest")["RTRL_AUTH__KEYS"]["secretKeyRef"]["key"] == "auth-keys"
    assert "RTRL_AUTH__KEYS" not in env_of(docs, "reward"), "only gateway and ingest hold producer keys"


def test_existing_secrets_replace_the_charts_secret(rendered) -> None:
    docs = rendered["strimzi"]
    assert by_kind(docs, "Secret") == []
    env = env_of(docs, "ingest")
    assert env["RTRL_KAFKA__SASL_PASSWORD"] == {"secretKeyRef": {"name": "rtrl", "key": "password"}}
    assert env["RTRL_REDIS__URL"] == {"secretKeyRef": {"name": "rtrl-redis", "key": "url"}}
    assert env["RTRL_AUTH__KEYS"] == {"secretKeyRef": {"name": "rtrl-auth", "key": "keys"}}
    assert env["RTRL_KAFKA__SSL_CAFILE"] == "/etc/rtrl/kafka-ca/ca.crt"
    dep = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-ingest"))
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["kafka-ca"]["secret"]["secretName"] == "events-cluster-ca-cert"


def test_config_changes_roll_the_pods(render: Render, rendered) -> None:
    def checksum(docs: list[dict[str, Any]]) -> str:
        dep = by_kind(docs, "Deployment")[0]
        return str(dep["spec"]["template"]["metadata"]["annotations"]["checksum/config"])

    assert checksum(render(*ct.REQUIRED, "--set", "logLevel=DEBUG")) != checksum(rendered["default"])


# --- rejected values ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("setting", "why"),
    [
        ("securityContext.runAsUser=0", "runAsUser"),
        ("kafka.securityProtocol=SASL", "securityProtocol"),
        ("gateway.replicas=0", "replicas"),
        ("metrics.port=80", "port"),
        ("redis.url=http://redis:6379", "url"),
        ("ingest.autoscaling.targetCpuUtilizationPercentage=150", "targetCpuUtilizationPercentage"),
        ("trainer.resources.limits.memory=lots", "memory"),
        ("config.LOG_LEVEL=debug", "config"),
        ("ingest.replica=2", "replica"),
        ("prometheusRule.runbookBaseUrl=wiki/runbooks/", "runbookBaseUrl"),
        ("prometheusRule.approvalWaitSeconds=30", "approvalWaitSeconds"),
    ],
)
def test_schema_rejects_bad_values(refusal: Refusal, setting: str, why: str) -> None:
    err = refusal("--set", setting)
    assert "schema" in err and why in err, err


def test_template_refuses_an_install_without_redis(refusal: Refusal) -> None:
    assert "set redis.url or redis.existingSecret.name" in refusal(*ct.REQUIRED, "--set", "redis.url=")


def test_template_refuses_min_replicas_above_max(refusal: Refusal) -> None:
    err = refusal(*ct.REQUIRED, "--set", "reward.autoscaling.enabled=true",
                  "--set", "reward.autoscaling.minReplicas=5", "--set", "reward.autoscaling.maxReplicas=2")
    assert "minReplicas (5) is above maxReplicas (2)" in err


def test_dashboard_configmap_carries_the_sidecar_label_and_the_json(rendered) -> None:
    maps = by_kind(rendered["everything"], "ConfigMap")
    (cm,) = [d for d in maps if d["metadata"]["name"].endswith("-dashboards")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["rtrl.json"] == ct.DASHBOARD.read_text().rstrip("\n")


# --- install-time checks, GPUs and the engine -----------------------------------------------
@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "set gateway.apiKeys.<key-id>=<key>"),
        (["--set", "gateway.apiKeys.app=k"], "set auth.keys.gateway=<secret>"),
        ([*ct.REQUIRED, "--set", "engine.kind=vllm"], "set engine.baseUrl"),
        ([*ct.REQUIRED, "--set", "engine.kind=vllm", "--set", "engine.baseUrl=http://e:8000"],
         "set engine.adapters.claimName"),
        ([*ct.REQUIRED, "--set", "engine.vllm.enabled=true"], "engine.vllm.enabled needs engine.vllm.model"),
    ],
)
def test_an_install_that_would_not_start_fails_saying_what_to_set(
        refusal: Refusal, args: list[str], says: str) -> None:
    err = refusal(*args)
    assert says in err, err


def test_a_development_install_without_keys_renders_when_asked_for(render: Render,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from services.settings.model import Settings

    dev = ["--set", "gateway.allowAnonymous=true", "--set", "auth.allowUnsigned=true"]
    gw = env_of(render(*dev), "gateway")
    for key, value in gw.items():
        monkeypatch.setenv(key, value if isinstance(value, str) else "redis://r:6379/0")
    settings = Settings()
    assert settings.gateway.allow_anonymous and settings.gateway.key_id is None  # served events unsigned


def test_gpus_and_node_placement_reach_the_pods(rendered) -> None:
    docs = rendered["everything"]
    trainer = next(d for d in by_kind(docs, "Deployment") if component_of(d) == "trainer")
    (c,) = trainer["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    (ray,) = by_kind(docs, "RayCluster")
    worker = ray["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert worker["runtimeClassName"] == "nvidia"
    assert worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    vllm = rendered["vllm"]
    trainer = next(d for d in by_kind(vllm, "Deployment") if component_of(d) == "trainer")["spec"]["template"]
    assert trainer["spec"]["runtimeClassName"] == "nvidia"
    assert trainer["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert trainer["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


def test_vllm_server_loads_adapters_from_the_volume_the_deployer_writes(rendered) -> None:
    docs = rendered["vllm"]
    deps = {component_of(d): d for d in by_kind(docs, "Deployment")}
    spec = deps["vllm"]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["command"] == ["vllm", "serve"] and c["args"][0] == "/models/my-model"
    assert "--enable-lora" in c["args"] and "--served-model-name=base" in c["args"]
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in c["env"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["runtimeClassName"] == "nvidia" and spec["nodeSelector"]
    claim = {v["name"]: v for v in spec["volumes"]}["adapters"]["persistentVolumeClaim"]["claimName"]
    dspec = deps["deployer"]["spec"]["template"]["spec"]
    assert {v["name"]: v for v in dspec["volumes"]}["adapters"]["persistentVolumeClaim"]["claimName"] == claim
    (pvc,) = [p for p in by_kind(docs, "PersistentVolumeClaim") if p["metadata"]["name"] == claim]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    engine_path = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["adapters"]
    env = env_of(docs, "deployer")
    assert env["RTRL_ENGINE__ENGINE_ADAPTER_DIR"] == engine_path
    deployer_mounts = {m["name"]: m["mountPath"] for m in dspec["containers"][0]["volumeMounts"]}
    assert env["RTRL_ENGINE__ADAPTER_DIR"] == deployer_mounts["adapters"]
    assert env["RTRL_ENGINE__KIND"] == "vllm" and env["RTRL_ENGINE__BASE_URL"] == "http://rel-rtrl-vllm:8000"
    (svc,) = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "rel-rtrl-vllm"]
    assert {p["port"] for p in svc["spec"]["ports"] if p["name"] == "http"} == {8000}


def test_vllm_network_paths_are_open_only_where_needed(rendered) -> None:
    policies = {component_of(p): p for p in by_kind(rendered["vllm"], "NetworkPolicy")}
    engine_peer = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "rtrl",
                                                   "app.kubernetes.io/instance": "rel",
                                                   "app.kubernetes.io/component": "vllm"}}}
    for component in ("gateway", "deployer"):
        rules = policies[component]["spec"]["egress"]
        assert any(engine_peer in r.get("to", []) and {"port": 8000, "protocol": "TCP"} in r["ports"]
                   for r in rules), component
    for component in ("ingest", "reward", "trainer"):
        assert not any(engine_peer in r.get("to", []) for r in policies[component]["spec"]["egress"])
    api = policies["vllm"]["spec"]["ingress"][0]
    callers = {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in api["from"]}
    assert callers == {"gateway", "deployer"}
    ext = {component_of(p): p for p in by_kind(rendered["everything"], "NetworkPolicy")}
    ports = {p["port"] for r in ext["gateway"]["spec"]["egress"] for p in r["ports"]}
    assert 8000 in ports, "an external engine (engine.baseUrl) is reachable on networkPolicy.egress.engine"


@pytest.mark.parametrize("setting", ["trainer.resources.limits.nvidia\\.com/gpu=lots",
                                     "engine.kind=sglang", "engine.vllm.maxLoras=0"])
def test_schema_rejects_bad_engine_and_gpu_values(refusal: Refusal, setting: str) -> None:
    err = refusal(*ct.REQUIRED, "--set", setting)
    assert "schema" in err, (setting, err)
