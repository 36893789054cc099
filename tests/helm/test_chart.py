"""The Helm chart in helm/extauthz, checked without a cluster or a helm binary.

helm-python-sdk (Helm's Go library behind ctypes) lints and renders the chart like
``helm lint`` / ``helm template`` and applies values.schema.json; kubernetes-validate checks the
rendered objects against the Kubernetes 1.30 OpenAPI schemas (strict: unknown fields fail);
jsonschema checks values files against values.schema.json on its own.
"""

from __future__ import annotations

import base64
import copy
import json
import math
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from extauthz.core.errors import PolicyError
from extauthz.policy import load_policy
from extauthz.server.app import ServerConfig, stop_budget
from extauthz.server.grpc_h2 import H2Limits
from testinfra import envoy_configs

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "extauthz"
ISTIO = CHART / "examples" / "istio"
KUBE_VERSION = "1.30.0"
RELEASE, NAMESPACE = "extauthz", "extauthz"

# Every optional piece on.
FULL_VALUES: dict[str, Any] = {
    "replicaCount": 3,
    "redis": {"existingSecret": "extauthz-redis", "existingSecretKey": "url"},
    "identitySalt": {"value": "s3cret-salt"},
    "server": {"workers": 2, "logLevel": "debug", "httpPort": 9005, "grpcServer": "grpcio"},
    "extraEnv": [{"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://otel-collector:4317"}],
    "podDisruptionBudget": {"enabled": True},
    "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 12},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
    "networkPolicy": {
        "enabled": True,
        "grpcFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "istio-system"}}}],
        "metricsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
        "httpFrom": [{"podSelector": {"matchLabels": {"app": "front-envoy"}}}],
        "egress": [{"ports": [{"port": 6379, "protocol": "TCP"}]}, {"ports": [{"port": 53, "protocol": "UDP"}]}],
    },
    "service": {"headless": True},
    "podAnnotations": {"example.com/team": "edge"},
    "topologySpreadConstraints": [{
        "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "extauthz"}},
    }],
    "lifecycle": {"preStopMode": "exec"},
    "adminToken": {"existingSecret": "extauthz-admin"},
}
Objects = list[dict[str, Any]]
# Kinds kubernetes-validate has no schema for (CRDs); checked by hand below.
CRD_KINDS = {"ServiceMonitor"}


@pytest.fixture(scope="module")
def chart() -> Any:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects: list[dict[str, Any]] = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [found] = [o for o in objects if o["kind"] == kind]
    return found


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [main] = by_kind(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    found: dict[str, Any] = main
    return found


def env_of(main: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in main["env"]}


@pytest.fixture(scope="module")
def default_objects(chart: Any) -> list[dict[str, Any]]:
    return render(chart)


@pytest.fixture(scope="module")
def full_objects(chart: Any) -> list[dict[str, Any]]:
    return render(chart, FULL_VALUES)


def schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
    return loaded


def default_values() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return loaded


def merged(overrides: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(default_values())

    def merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
        for key, value in src.items():
            if isinstance(value, dict) and isinstance(dst.get(key), dict):
                merge(dst[key], value)
            else:
                dst[key] = value

    merge(out, overrides)
    return out


# -- lint and Kubernetes schemas -------------------------------------------------------------------


@pytest.mark.parametrize("values", [None, FULL_VALUES], ids=["default", "full"])
def test_lint_is_clean(values: dict[str, Any] | None) -> None:
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == []
    # severity 1 = info (only "icon is recommended"), 2 = warning, 3 = error
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("name", ["default", "full"])
def test_rendered_objects_match_kubernetes_schemas(name: str, request: pytest.FixtureRequest) -> None:
    objects = request.getfixturevalue(f"{name}_objects")
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_default_render_has_the_base_objects_only(default_objects: list[dict[str, Any]]) -> None:
    assert sorted(o["kind"] for o in default_objects) == ["ConfigMap", "Deployment", "Service", "ServiceAccount"]


def test_full_render_has_every_optional_object(full_objects: list[dict[str, Any]]) -> None:
    assert sorted(o["kind"] for o in full_objects) == sorted([
        "ConfigMap", "Deployment", "HorizontalPodAutoscaler", "NetworkPolicy", "PodDisruptionBudget",
        "Secret", "Service", "ServiceAccount", "ServiceMonitor",
    ])
    for obj in full_objects:
        assert obj["metadata"]["namespace"] == NAMESPACE
    selector = by_kind(full_objects, "Deployment")["spec"]["selector"]["matchLabels"]
    pod_labels = by_kind(full_objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    for kind, path in [("Service", ["spec", "selector"]),
                       ("PodDisruptionBudget", ["spec", "selector", "matchLabels"]),
                       ("NetworkPolicy", ["spec", "podSelector", "matchLabels"]),
                       ("ServiceMonitor", ["spec", "selector", "matchLabels"])]:
        node: Any = by_kind(full_objects, kind)
        for key in path:
            node = node[key]
        assert node == selector, kind
    # The HPA owns the replica count.
    assert "replicas" not in by_kind(full_objects, "Deployment")["spec"]
    hpa = by_kind(full_objects, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"]["name"] == by_kind(full_objects, "Deployment")["metadata"]["name"]


def test_service_monitor_scrapes_the_metrics_port(full_objects: list[dict[str, Any]]) -> None:
    monitor = by_kind(full_objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    # one endpoint per worker process (FULL_VALUES has 2): worker i serves metrics.port + i
    assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [
        ("metrics", "/metrics"), ("metrics-w1", "/metrics")]
    service_ports = {p["name"]: p["port"] for p in by_kind(full_objects, "Service")["spec"]["ports"]}
    assert service_ports == {"grpc": 9001, "http": 9005, "metrics": 9464, "metrics-w1": 9465}
    container_ports = {p["name"]: p["containerPort"] for p in container(full_objects)["ports"]}
    assert container_ports == service_ports


def test_network_policy_opens_only_grpc_http_and_metrics(full_objects: list[dict[str, Any]]) -> None:
    spec = by_kind(full_objects, "NetworkPolicy")["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    ports = [p["port"] for rule in spec["ingress"] for p in rule["ports"]]
    assert ports == ["grpc", "http", "metrics", "metrics-w1"]
    assert spec["ingress"][0]["from"] == FULL_VALUES["networkPolicy"]["grpcFrom"]
    assert spec["ingress"][1]["from"] == FULL_VALUES["networkPolicy"]["httpFrom"]


def test_http_port_is_off_by_default_and_exposed_when_set(default_objects: Objects, full_objects: Objects) -> None:
    assert "EXTAUTHZ_HTTP_LISTEN" not in env_of(container(default_objects))
    assert "http" not in [p["name"] for p in by_kind(default_objects, "Service")["spec"]["ports"]]
    main = container(full_objects)
    assert env_of(main)["EXTAUTHZ_HTTP_LISTEN"]["value"] == "0.0.0.0:9005"
    assert {"name": "http", "containerPort": 9005, "protocol": "TCP"} in main["ports"]
    service = {p["name"]: p for p in by_kind(full_objects, "Service")["spec"]["ports"]}
    assert (service["http"]["port"], service["http"]["targetPort"]) == (9005, "http")


# -- the points that matter for this server -------------------------------------------------------


@pytest.mark.parametrize("name", ["default", "full"])
def test_policies_are_a_directory_mount_without_subpath(name: str, request: pytest.FixtureRequest) -> None:
    objects = request.getfixturevalue(name + "_objects")
    pod = by_kind(objects, "Deployment")["spec"]["template"]["spec"]
    main = container(objects)
    for mount in main["volumeMounts"]:
        assert "subPath" not in mount and "subPathExpr" not in mount, mount
    [mount] = [m for m in main["volumeMounts"] if m["name"] == "policies"]
    assert mount["mountPath"] == "/etc/extauthz/policies"
    assert env_of(main)["EXTAUTHZ_POLICIES"]["value"] == mount["mountPath"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "policies"]
    assert "items" not in volume["configMap"]  # every key of the ConfigMap is a file
    assert volume["configMap"]["name"] == by_kind(objects, "ConfigMap")["metadata"]["name"]


def test_no_checksum_restart_for_policies(full_objects: Objects, default_objects: Objects) -> None:
    """Policies hot-reload: a ConfigMap edit must not change the pod template."""
    default_annotations = by_kind(default_objects, "Deployment")["spec"]["template"]["metadata"].get("annotations")
    assert default_annotations is None
    annotations = by_kind(full_objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert set(annotations) == {"checksum/secret", "example.com/team"}


def test_policy_edit_leaves_the_pod_template_unchanged(chart: Any) -> None:
    edited = {"policies": {"api.yaml": "version: 1\nlimiters: []\n"}}
    before, after = render(chart), render(chart, edited)
    assert by_kind(before, "ConfigMap")["data"] != by_kind(after, "ConfigMap")["data"]
    assert by_kind(before, "Deployment") == by_kind(after, "Deployment")


def test_default_policy_is_the_repository_policy_and_loads(default_objects: Objects, tmp_path: Path) -> None:
    repo_path = ROOT / "policies" / "api.yaml"
    repo_policy = yaml.safe_load(repo_path.read_text())
    # A mapping (so values.schema.json checks it at install), equal to the repository's policy.
    assert default_values()["policies"] == {"api.yaml": repo_policy}
    data = by_kind(default_objects, "ConfigMap")["data"]
    assert set(data) == {"api.yaml"}
    assert yaml.safe_load(data["api.yaml"]) == repo_policy
    (tmp_path / "api.yaml").write_text(data["api.yaml"])
    rendered = load_policy([str(tmp_path)])
    assert rendered.limiters == load_policy([repo_path]).limiters
    assert [limiter.name for limiter in rendered.limiters] == ["user-rate", "user-concurrency", "fleet", "workers"]


def _limiter(policy: dict[str, Any], name: str) -> dict[str, Any]:
    [found] = [limiter for limiter in policy["limiters"] if limiter["name"] == name]
    return found


# Broken edits of the default policy (the mapping in values.yaml) and the schema's message for each.
BROKEN_DEFAULT_EDITS = [
    (lambda p: _limiter(p, "user-rate").update(burst=-1),
     r"/policies/api.yaml/limiters/0/burst': exclusiveMinimum: got -1"),
    (lambda p: _limiter(p, "user-rate").update(burts=500),
     r"/policies/api.yaml/limiters/0': additional properties 'burts' not allowed"),
    (lambda p: p["limiters"].append({"name": "monthly", "type": "quota", "limit": 10000}),
     r"/policies/api.yaml/limiters/4': missing property 'period'"),
    (lambda p: p["test_mode"].update(key_prefix=5),
     r"/policies/api.yaml/test_mode/key_prefix': got number, want string"),
]


@pytest.mark.parametrize(("edit", "message"), BROKEN_DEFAULT_EDITS,
                         ids=["burst-1", "unknown-field", "quota-no-period", "wrong-type"])
def test_a_broken_default_shaped_policy_fails_rendering(chart: Any, edit: Any, message: str) -> None:
    policy = copy.deepcopy(default_values()["policies"]["api.yaml"])
    edit(policy)
    with pytest.raises(helm.HelmValuesError, match=message):
        chart.render({"policies": {"api.yaml": policy}}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    report = helm.lint(CHART, {"policies": {"api.yaml": policy}}, strict=True, kube_version=f"v{KUBE_VERSION}")
    errors = report["errors"]
    assert any(re.search(message, error) for error in errors), errors


def test_a_mapping_given_for_api_yaml_is_merged_into_the_default(chart: Any) -> None:
    # Helm merges maps key by key and replaces lists: what docs/helm.md and values.yaml say.
    mine = {"name": "r", "type": "request_rate", "rate": 5, "burst": 10}
    objects = render(chart, {"policies": {"api.yaml": {"test_mode": None, "limiters": [mine]}}})
    rendered = yaml.safe_load(by_kind(objects, "ConfigMap")["data"]["api.yaml"])
    default = default_values()["policies"]["api.yaml"]
    assert rendered == {key: value for key, value in default.items() if key != "test_mode"} | {"limiters": [mine]}


def test_a_policy_given_as_text_is_rendered_unchecked(chart: Any, tmp_path: Path) -> None:
    # Text is still accepted (compatibility) and replaces the default whole; only the server checks it.
    broken = "version: 1\nlimiters:\n  - {name: r, type: request_rate, rate: 5, burst: -1}\n"
    data = by_kind(render(chart, {"policies": {"api.yaml": broken}}), "ConfigMap")["data"]
    assert data == {"api.yaml": broken}
    (tmp_path / "api.yaml").write_text(data["api.yaml"])
    with pytest.raises(PolicyError, match="burst"):
        load_policy([tmp_path])


def test_the_helm_docs_policy_examples_render_and_load(chart: Any, tmp_path: Path) -> None:
    # docs/helm.md's values blocks (`policies:`) pass the chart's schema and render, and the
    # team ConfigMaps shown beside them load together with the chart's files as one policy.
    blocks = re.findall(r"^```yaml\n(.*?)^```", (ROOT / "docs" / "helm.md").read_text(), re.S | re.M)
    values_blocks = [yaml.safe_load(b) for b in blocks if "\npolicies:" in f"\n{b}"]
    team_files = [doc["data"] for b in blocks for doc in yaml.safe_load_all(b)
                  if isinstance(doc, dict) and doc.get("kind") == "ConfigMap"]
    assert len(values_blocks) >= 2 and team_files
    for number, values in enumerate(values_blocks):
        directory = tmp_path / str(number)
        directory.mkdir()
        files = by_kind(render(chart, values), "ConfigMap")["data"]
        if values["policies"].get("configMaps"):
            files = files | {name: text for data in team_files for name, text in data.items()}
        for name, text in files.items():
            (directory / name).write_text(text)
        assert load_policy([directory]).limiters


def test_structured_policy_values_are_rendered_as_yaml(chart: Any, tmp_path: Path) -> None:
    structured = {"version": 1, "limiters": [{"name": "r", "type": "request_rate", "rate": 5, "burst": 10}]}
    objects = render(chart, {"policies": {"api.yaml": None, "limits.yaml": structured}})
    data = by_kind(objects, "ConfigMap")["data"]
    assert set(data) == {"limits.yaml"}
    assert yaml.safe_load(data["limits.yaml"]) == structured
    (tmp_path / "limits.yaml").write_text(data["limits.yaml"])
    assert [limiter.name for limiter in load_policy([str(tmp_path)]).limiters] == ["r"]


def test_existing_policy_configmap(chart: Any) -> None:
    objects = render(chart, {"existingPolicyConfigMap": "my-policies"})
    assert "ConfigMap" not in {o["kind"] for o in objects}
    pod = by_kind(objects, "Deployment")["spec"]["template"]["spec"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "policies"]
    assert volume["configMap"]["name"] == "my-policies"



def test_dashboard_configmap_is_off_by_default_and_carries_the_dashboard(chart: Any) -> None:
    assert "dashboards" not in json.dumps([o["metadata"]["name"] for o in render(chart)])
    values = {"dashboards": {"enabled": True, "namespace": "monitoring",
                             "annotations": {"grafana_folder": "Edge"}}}
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == []
    objects = render(chart, values)
    [dashboards] = [o for o in objects if o["kind"] == "ConfigMap" and "extauthz.json" in o.get("data", {})]
    kubernetes_validate.validate(dashboards, KUBE_VERSION, strict=True)
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboards["metadata"]["namespace"] == "monitoring"
    assert dashboards["metadata"]["annotations"] == {"grafana_folder": "Edge"}
    shipped = json.loads((CHART / "dashboards" / "extauthz.json").read_text())
    assert json.loads(dashboards["data"]["extauthz.json"]) == shipped

TEAMS = ["team-payments-policy", "team-search-policy"]


@pytest.mark.parametrize("values, sources", [
    ({"policies": {"configMaps": TEAMS}}, [f"{RELEASE}-policies", *TEAMS]),
    ({"policies": {"api.yaml": None, "configMaps": TEAMS}}, TEAMS),
    ({"existingPolicyConfigMap": "platform-policy", "policies": {"configMaps": TEAMS}}, ["platform-policy", *TEAMS]),
], ids=["with-the-chart-file", "teams-only", "with-existing"])
def test_several_policy_configmaps_are_one_projected_directory(
        chart: Any, values: dict[str, Any], sources: list[str]) -> None:
    assert helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")["errors"] == []
    objects = render(chart, values)
    for obj in objects:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    pod = by_kind(objects, "Deployment")["spec"]["template"]["spec"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "policies"]
    assert "configMap" not in volume
    # no items: every key of every ConfigMap is a file of the one directory, which the kubelet
    # updates with the same atomic ..data swap as a ConfigMap volume
    assert volume["projected"] == {"sources": [{"configMap": {"name": n}} for n in sources]}
    main = container(objects)
    [mount] = [m for m in main["volumeMounts"] if m["name"] == "policies"]
    assert mount == {"name": "policies", "mountPath": "/etc/extauthz/policies", "readOnly": True}
    chart_maps = [o for o in objects if o["kind"] == "ConfigMap"]
    assert [o["metadata"]["name"] for o in chart_maps] == [n for n in sources if n == f"{RELEASE}-policies"]
    for o in chart_maps:
        assert set(o["data"]) == {"api.yaml"}  # the configMaps key is not a file


def test_a_team_configmap_edit_leaves_the_pod_template_unchanged(chart: Any) -> None:
    values = {"policies": {"configMaps": TEAMS}}
    edited = {"policies": {"configMaps": TEAMS, "api.yaml": "version: 1\nlimiters: []\n"}}
    assert by_kind(render(chart, values), "Deployment") == by_kind(render(chart, edited), "Deployment")

@pytest.mark.parametrize("name", ["default", "full"])
def test_admin_port_is_never_exposed(name: str, request: pytest.FixtureRequest) -> None:
    objects = request.getfixturevalue(name + "_objects")
    main = container(objects)
    admin = env_of(main)["EXTAUTHZ_ADMIN_LISTEN"]["value"]
    assert admin.startswith("127.0.0.1:")
    admin_port = int(admin.rsplit(":", 1)[1])
    ports = by_kind(objects, "Service")["spec"]["ports"]
    assert {(p["name"], p["port"]) for p in ports} >= {("grpc", 9001), ("metrics", 9464)}
    assert {p["name"] for p in ports} <= {"grpc", "http", "metrics", "metrics-w1"}
    assert admin_port not in {p["port"] for p in ports}
    assert "admin" not in {p["name"] for p in ports}
    assert admin_port not in {p["containerPort"] for p in main["ports"]}


def test_public_admin_listen_is_refused(chart: Any) -> None:
    bad = {"server": {"adminListen": "0.0.0.0:9002"}}
    with pytest.raises(helm.HelmValuesError, match="adminListen"):
        chart.render(bad, name=RELEASE, namespace=NAMESPACE)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(merged(bad), schema())


def test_admin_token_secret_is_mounted_as_a_directory_and_named_by_the_variable(
        chart: Any, default_objects: Objects) -> None:
    objects = render(chart, {"adminToken": {"existingSecret": "ops-admin", "existingSecretKey": "tokens"}})
    kubernetes_validate.validate(by_kind(objects, "Deployment"), KUBE_VERSION, strict=True)
    main = container(objects)
    assert env_of(main)["EXTAUTHZ_ADMIN_TOKEN_FILE"]["value"] == "/etc/extauthz/admin/tokens"
    pod = by_kind(objects, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "admin-token", "secret": {"secretName": "ops-admin", "defaultMode": 0o440,
                                              "items": [{"key": "tokens", "path": "tokens"}]}} in pod["volumes"]
    mount = next(m for m in main["volumeMounts"] if m["name"] == "admin-token")
    assert mount == {"name": "admin-token", "mountPath": "/etc/extauthz/admin", "readOnly": True}  # no subPath
    # off by default: no variable, no volume
    assert "EXTAUTHZ_ADMIN_TOKEN_FILE" not in env_of(container(default_objects))
    assert "admin-token" not in {m["name"] for m in container(default_objects)["volumeMounts"]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(merged({"adminToken": {"existingSecret": "Not_A_Name"}}), schema())


@pytest.mark.parametrize("name", ["default", "full"])
def test_grpc_probes_target_the_check_port(name: str, request: pytest.FixtureRequest) -> None:
    objects = request.getfixturevalue(name + "_objects")
    main = container(objects)
    [grpc_port] = [p["containerPort"] for p in main["ports"] if p["name"] == "grpc"]
    assert env_of(main)["EXTAUTHZ_LISTEN"]["value"] == f"0.0.0.0:{grpc_port}"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["grpc"] == {"port": grpc_port, "service": ""}, probe
    service_grpc = [p for p in by_kind(objects, "Service")["spec"]["ports"] if p["name"] == "grpc"]
    assert service_grpc[0]["targetPort"] == "grpc"
    assert service_grpc[0]["appProtocol"] == "grpc"


def test_graceful_stop_fits_the_termination_grace(default_objects: list[dict[str, Any]],
                                                  full_objects: list[dict[str, Any]]) -> None:
    # what the server computes for its stop after SIGTERM (every port's grace at once, the
    # gRPC port's close linger, the release drain), from the code's own defaults
    budget = stop_budget(ServerConfig().grace_seconds, H2Limits().close_linger)
    for objects, hook in [(default_objects, {"sleep": {"seconds": 5}}),
                          (full_objects, {"exec": {"command": ["sleep", "5"]}})]:
        pod = by_kind(objects, "Deployment")["spec"]["template"]["spec"]
        pre_stop = container(objects)["lifecycle"]["preStop"]
        assert pre_stop == hook
        sleep = int(pre_stop.get("sleep", {}).get("seconds") or pre_stop["exec"]["command"][1])
        # Kubernetes counts the grace from the preStop hook's start: the hook, then the stop,
        # then at least 2 s for the process's exit
        assert pod["terminationGracePeriodSeconds"] >= sleep + budget + 2


@pytest.mark.parametrize("sleep,mode", [(5, "exec"), (0, "exec"), (9, "none"), (30, "sleep")])
def test_a_grace_shorter_than_the_stop_is_refused(chart: Any, sleep: int, mode: str) -> None:
    # the chart's own stop budget is the code's: the shortest grace it takes is exactly the
    # hook's sleep + stop_budget + 2 s
    counted = 0 if mode == "none" else sleep
    shortest = counted + math.ceil(stop_budget(ServerConfig().grace_seconds)) + 2
    lifecycle = {"preStopSleepSeconds": sleep, "preStopMode": mode}
    pod = by_kind(render(chart, merged({"lifecycle": lifecycle, "terminationGracePeriodSeconds": shortest})),
                  "Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == shortest
    # the templates' check, or with no preStop sleep the schema's minimum (the budget + 2 s)
    refused = f"terminationGracePeriodSeconds {shortest - 1} is too short|minimum: got {shortest - 1}, want"
    with pytest.raises(Exception, match=refused):
        render(chart, merged({"lifecycle": lifecycle, "terminationGracePeriodSeconds": shortest - 1}))


def test_security_context(default_objects: list[dict[str, Any]]) -> None:
    pod = by_kind(default_objects, "Deployment")["spec"]["template"]["spec"]
    main = container(default_objects)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    sc = main["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "tmp", "mountPath": "/tmp"} in main["volumeMounts"]


def test_default_image_is_the_projects_at_app_version(default_objects: list[dict[str, Any]]) -> None:
    chart_yaml = yaml.safe_load((CHART / "Chart.yaml").read_text())
    pyproject = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert pyproject is not None and chart_yaml["appVersion"] == pyproject.group(1)
    main = container(default_objects)
    # the name scripts/build-image gives the image by default
    build_image = (ROOT / "scripts" / "build-image").read_text()
    default_repo = re.search(r"^IMAGE=\$\{IMAGE:-([^}]+)\}", build_image, re.M)
    assert default_repo is not None
    assert default_repo.group(1) == "ghcr.io/extauthz/extauthz"
    assert main["image"] == f"ghcr.io/extauthz/extauthz:{chart_yaml['appVersion']}"
    # the image's user (Containerfile USER) is the pod's user
    user = re.search(r"^USER (\d+):(\d+)", (ROOT / "Containerfile").read_text(), re.M)
    pod = by_kind(default_objects, "Deployment")["spec"]["template"]["spec"]
    assert user is not None
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == tuple(map(int, user.groups()))


def test_default_env(default_objects: list[dict[str, Any]]) -> None:
    env = env_of(container(default_objects))
    assert {name: e.get("value") for name, e in env.items()} == {
        "EXTAUTHZ_POLICIES": "/etc/extauthz/policies",
        "EXTAUTHZ_LISTEN": "0.0.0.0:9001",
        "EXTAUTHZ_ADMIN_LISTEN": "127.0.0.1:9002",
        "EXTAUTHZ_METRICS_LISTEN": "0.0.0.0:9464",
        "EXTAUTHZ_STORE_DEADLINE_MS": "5",
        "EXTAUTHZ_CHECK_BUDGET_MS": "200",
        "EXTAUTHZ_KEY_PREFIX": "extauthz",
        "EXTAUTHZ_LOG_LEVEL": "info",
        "EXTAUTHZ_LOG_FORMAT": "json",
    }
    assert container(default_objects)["command"] == ["extauthz", "serve"]


def test_memory_max_keys_is_set_only_when_given(chart: Any) -> None:
    env = env_of(container(render(chart, {"server": {"memoryMaxKeys": 5000, "checkBudgetMs": 400}})))
    assert env["EXTAUTHZ_MEMORY_MAX_KEYS"]["value"] == "5000"
    assert env["EXTAUTHZ_CHECK_BUDGET_MS"]["value"] == "400"


def test_a_million_memory_keys_reach_the_server_as_a_whole_number(chart: Any) -> None:
    """Helm reads a values file's numbers as float64, which toString writes as 1e+06 from a
    million on; --memory-max-keys takes a whole number only (the server refused to start)."""
    from extauthz.core.settings import options

    env = env_of(container(render(chart, {"server": {"memoryMaxKeys": 1_000_000}})))
    value = env["EXTAUTHZ_MEMORY_MAX_KEYS"]["value"]
    assert value == "1000000"
    parse = options()["memory_max_keys"].parse
    assert parse is not None and parse(value) == 1_000_000


@pytest.mark.parametrize("name", ["default", "full"])
def test_env_names_are_the_cli_variables(name: str, request: pytest.FixtureRequest) -> None:
    """Each EXTAUTHZ_* variable the chart sets is one `extauthz serve` reads."""
    from extauthz.core.settings import options  # every option serve reads, once

    read = {opt.env for opt in options().values()}
    env = env_of(container(request.getfixturevalue(name + "_objects")))
    assert {n for n in env if n.startswith("EXTAUTHZ_")} <= read


def test_full_env_uses_secrets(full_objects: list[dict[str, Any]]) -> None:
    env = env_of(container(full_objects))
    assert env["EXTAUTHZ_REDIS_URL"] == {
        "name": "EXTAUTHZ_REDIS_URL",
        "valueFrom": {"secretKeyRef": {"name": "extauthz-redis", "key": "url"}},
    }
    secret = by_kind(full_objects, "Secret")
    assert env["EXTAUTHZ_IDENTITY_SALT"]["valueFrom"]["secretKeyRef"] == {
        "name": secret["metadata"]["name"], "key": "identity-salt",
    }
    assert set(secret["data"]) == {"identity-salt", "lease-secret"}  # lease secret: made by the chart
    assert env["EXTAUTHZ_WORKERS"]["value"] == "2"
    assert env["EXTAUTHZ_GRPC_SERVER"]["value"] == "grpcio"
    assert env["EXTAUTHZ_LOG_LEVEL"]["value"] == "debug"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel-collector:4317"


def test_plain_redis_url_and_existing_salt_secret(chart: Any) -> None:
    objects = render(chart, {"replicaCount": 2, "redis": {"url": "redis://redis:6379/0"},
                             "identitySalt": {"existingSecret": "salt"}})
    env = env_of(container(objects))
    assert env["EXTAUTHZ_REDIS_URL"]["value"] == "redis://redis:6379/0"
    assert env["EXTAUTHZ_IDENTITY_SALT"]["valueFrom"]["secretKeyRef"] == {"name": "salt", "key": "identity-salt"}
    # with Redis (several replicas) the chart makes the replicas' shared lease secret
    secret = by_kind(objects, "Secret")
    assert set(secret["data"]) == {"lease-secret"}
    assert env["EXTAUTHZ_LEASE_SECRET"]["valueFrom"]["secretKeyRef"] == {
        "name": secret["metadata"]["name"], "key": "lease-secret"}


def test_metrics_can_be_turned_off(chart: Any) -> None:
    objects = render(chart, {"metrics": {"enabled": False}})
    main = container(objects)
    assert "EXTAUTHZ_METRICS_LISTEN" not in env_of(main)
    assert [p["name"] for p in by_kind(objects, "Service")["spec"]["ports"]] == ["grpc"]
    assert [p["name"] for p in main["ports"]] == ["grpc"]


@pytest.mark.parametrize("values, message", [
    ({"replicaCount": 2}, "shared store"),
    ({"autoscaling": {"enabled": True}}, "shared store"),
    ({"redis": {"url": "redis://r:6379", "existingSecret": "r"}}, "only one of redis"),
    ({"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}}, "needs metrics.enabled"),
    ({"policies": None}, "existingPolicyConfigMap"),
    ({"policies": {"api.yaml": None, "configMaps": []}}, "policies.configMaps or existingPolicyConfigMap"),
    ({"server": {"workers": 2}}, "shared store"),
    ({"redis": {"url": "redis://r:6379"}, "server": {"workers": 4, "grpcPort": 9466}}, "outside the metrics ports"),
    ({"server": {"httpPort": 9005}, "tls": {"existingSecret": "t"}}, "httpPort is plaintext"),
    ({"server": {"httpPort": 9001}}, "httpPort must differ"),
    ({"server": {"httpPort": 9464}}, "httpPort must lie outside the metrics ports"),
])
def test_impossible_combinations_fail_to_render(chart: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


# -- values.schema.json --------------------------------------------------------------------------


def test_schema_is_valid_and_accepts_the_shipped_values() -> None:
    jsonschema.Draft7Validator.check_schema(schema())
    jsonschema.validate(default_values(), schema())
    jsonschema.validate(merged(FULL_VALUES), schema())
    istio_values = yaml.safe_load((ISTIO / "values-istio.yaml").read_text())
    jsonschema.validate(merged(istio_values), schema())


BAD_VALUES = [
    {"replicaCount": "three"},
    {"server": {"logLevel": "verbose"}},
    {"server": {"grpcPort": 70000}},
    {"server": {"workers": 0}},
    {"server": {"logFormat": "xml"}},
    {"server": {"grpcServer": "grpc.aio"}},
    {"redis": {"url": "http://redis:6379"}},
    {"policies": {"api.json": "{}"}},
    {"policies": {"api.yaml": 42}},
    {"policies": {"configMaps": "team-a-policy"}},  # a list
    {"policies": {"configMaps": ["Team_A"]}},  # not a ConfigMap name
    {"policies": {"configMaps": ["team-a", "team-a"]}},
    {"service": {"type": "ExternalName"}},
    {"lifecycle": {"preStopMode": "later"}},
    {"image": {"pullPolicy": "Sometimes"}},
    {"replicas": 2},  # unknown top-level key (typo of replicaCount)
]


@pytest.mark.parametrize("bad", BAD_VALUES, ids=lambda v: json.dumps(v)[:40])
def test_bad_values_fail_schema_validation(chart: Any, bad: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(merged(bad), schema())
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(bad)


def test_bad_values_file_fails(chart: Any, tmp_path: Path) -> None:
    path = tmp_path / "bad-values.yaml"
    path.write_text("server:\n  logLevel: chatty\n  adminListen: 0.0.0.0:9002\n")
    bad = helm.values_from_yaml(path.read_text())
    errors = sorted(e.message for e in jsonschema.Draft7Validator(schema()).iter_errors(merged(bad)))
    assert len(errors) == 2
    with pytest.raises(helm.HelmValuesError, match="logLevel"):
        chart.render(bad, name=RELEASE, namespace=NAMESPACE)


# -- the Istio example ---------------------------------------------------------------------------


def load_docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((ISTIO / name).read_text()) if d]


def test_istio_example_is_consistent(default_objects: list[dict[str, Any]], tmp_path: Path) -> None:
    [mesh] = load_docs("meshconfig.yaml")
    providers = {p["name"]: p for p in mesh["meshConfig"]["extensionProviders"]}
    authz = providers["extauthz"]["envoyExtAuthzGrpc"]
    als = providers["extauthz-als"]["envoyHttpAls"]
    service = by_kind(default_objects, "Service")
    host = f"{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
    [grpc_port] = [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"]
    assert set(authz) <= {"service", "port", "timeout", "failOpen", "statusOnError", "includeRequestBodyInCheck"}
    assert (authz["service"], authz["port"]) == (als["service"], als["port"]) == (host, grpc_port)
    assert authz["failOpen"] is True
    assert re.fullmatch(r"\d+(\.\d+)?s", authz["timeout"])  # protobuf JSON duration
    assert isinstance(authz["statusOnError"], str)
    assert set(als) <= {"service", "port", "logName", "filterStateObjectsToLog", "additionalRequestHeadersToLog",
                        "additionalResponseHeadersToLog", "additionalResponseTrailersToLog"}

    [policy] = load_docs("authorizationpolicy.yaml")
    assert policy["apiVersion"] == "security.istio.io/v1"
    assert policy["spec"]["action"] == "CUSTOM"
    assert policy["spec"]["provider"]["name"] in providers
    assert policy["spec"]["rules"], "a CUSTOM policy only checks requests its rules match"

    [telemetry] = load_docs("telemetry.yaml")
    names = [p["name"] for entry in telemetry["spec"]["accessLogging"] for p in entry["providers"]]
    assert "extauthz-als" in names
    assert telemetry["spec"]["selector"] == policy["spec"]["selector"]

    [envoy_filter] = load_docs("envoyfilter-als.yaml")
    [patch] = envoy_filter["spec"]["configPatches"]
    [logger] = patch["patch"]["value"]["typed_config"]["access_log"]
    grpc_service = logger["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]
    assert grpc_service["cluster_name"] == f"outbound|{grpc_port}||{host}"

    values = yaml.safe_load((ISTIO / "values-istio.yaml").read_text())
    for name, text in values["policies"].items():
        (tmp_path / name).write_text(text)
    assert load_policy([str(tmp_path)]).limiters


def test_envoy_gateway_values_render_and_validate(chart: Any) -> None:
    values = yaml.safe_load((CHART / "examples" / "envoy-gateway" / "values-envoy-gateway.yaml").read_text())
    jsonschema.validate(merged(values), schema())
    objects = render(chart, values)
    for obj in objects:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    env = env_of(container(objects))
    assert env["EXTAUTHZ_HTTP_PATH_PREFIX"]["value"] == "/authz"
    assert env["EXTAUTHZ_HTTP_LISTEN"]["value"] == "0.0.0.0:9003"


def test_istio_values_render_and_validate(chart: Any) -> None:
    values = yaml.safe_load((ISTIO / "values-istio.yaml").read_text())
    for obj in render(chart, values):
        if obj["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_envoyfilter_access_logger_is_valid_envoy_config() -> None:
    """The logger block of envoyfilter-als.yaml, put in a minimal bootstrap, passes `envoy --mode validate`
    (field names and types; the Istio side of the EnvoyFilter needs a live Istio)."""
    [envoy_filter] = load_docs("envoyfilter-als.yaml")
    [patch] = envoy_filter["spec"]["configPatches"]
    hcm = copy.deepcopy(patch["patch"]["value"]["typed_config"])
    cluster = hcm["access_log"][0]["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
    hcm.update({
        "stat_prefix": "ingress_http",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "direct_response": {"status": 200}}]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    })
    bootstrap = {"static_resources": {
        "listeners": [{"name": "gateway", "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                       "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                       "typed_config": hcm}]}]}],
        "clusters": [{"name": cluster, "type": "STATIC", "load_assignment": {"cluster_name": cluster, "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                                            "port_value": 9001}}}}]}]},
                      "typed_extension_protocol_options": {
                          "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                              "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                              "explicit_http_config": {"http2_protocol_options": {}}}}}],
    }}
    envoy_configs.validate(yaml.safe_dump(bootstrap))


# -- TLS on the grpc port ----------------------------------------------------------------------------


def test_tls_secret_is_mounted_and_probes_use_the_plaintext_health_port(chart: Any) -> None:
    objects = render(chart, {"tls": {"existingSecret": "extauthz-tls", "requireClientCertificate": True}})
    kubernetes_validate.validate(by_kind(objects, "Deployment"), KUBE_VERSION, strict=True)
    main = container(objects)
    env = {n: e.get("value") for n, e in env_of(main).items()}
    assert env["EXTAUTHZ_TLS_CERT"] == "/etc/extauthz/tls/tls.crt"
    assert env["EXTAUTHZ_TLS_KEY"] == "/etc/extauthz/tls/tls.key"
    assert env["EXTAUTHZ_TLS_CLIENT_CA"] == "/etc/extauthz/tls/ca.crt"
    assert env["EXTAUTHZ_HEALTH_LISTEN"] == "0.0.0.0:9003"
    pod = by_kind(objects, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": "extauthz-tls", "defaultMode": 0o440}} in pod["volumes"]
    mount = next(m for m in main["volumeMounts"] if m["name"] == "tls")
    assert mount == {"name": "tls", "mountPath": "/etc/extauthz/tls", "readOnly": True}  # no subPath
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["grpc"] == {"port": 9003, "service": ""}, probe
    assert {"name": "health", "containerPort": 9003, "protocol": "TCP"} in main["ports"]
    assert "health" not in {p["name"] for p in by_kind(objects, "Service")["spec"]["ports"]}
    # server-only TLS: no client CA
    plain_tls = env_of(container(render(chart, {"tls": {"existingSecret": "extauthz-tls"}})))
    assert "EXTAUTHZ_TLS_CLIENT_CA" not in plain_tls and "EXTAUTHZ_TLS_CERT" in plain_tls


def test_tls_off_by_default(default_objects: Objects) -> None:
    main = container(default_objects)
    assert not {n for n in env_of(main) if n.startswith("EXTAUTHZ_TLS") or n == "EXTAUTHZ_HEALTH_LISTEN"}
    assert "tls" not in {m["name"] for m in main["volumeMounts"]}


@pytest.mark.parametrize(("values", "message"), [
    ({"tls": {"requireClientCertificate": True}}, "tls.requireClientCertificate needs tls.existingSecret"),
    ({"tls": {"existingSecret": "s", "healthPort": 9001}}, "tls.healthPort must differ"),
    ({"tls": {"existingSecret": "s", "healthPort": 9464}}, "tls.healthPort must lie outside"),
])
def test_impossible_tls_values_fail(chart: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_lease_secret_from_an_existing_secret_or_a_value(chart: Any) -> None:
    objects = render(chart, {"redis": {"url": "redis://r:6379"},
                             "leaseSecret": {"existingSecret": "fleet-lease", "existingSecretKey": "k"}})
    env = env_of(container(objects))
    assert env["EXTAUTHZ_LEASE_SECRET"]["valueFrom"]["secretKeyRef"] == {"name": "fleet-lease", "key": "k"}
    assert "Secret" not in {o["kind"] for o in objects}
    objects = render(chart, {"leaseSecret": {"value": "v" * 40}})

    assert base64.b64decode(by_kind(objects, "Secret")["data"]["lease-secret"]).decode() == "v" * 40
    # one replica without Redis and no secret given: the server's own random secret is right
    assert "EXTAUTHZ_LEASE_SECRET" not in env_of(container(render(chart)))
    with pytest.raises(helm.HelmError, match="only one of leaseSecret"):
        chart.render({"leaseSecret": {"value": "a", "existingSecret": "b"}}, name=RELEASE, namespace=NAMESPACE)


def test_networkpolicy_example_follows_the_security_doc(chart: Any) -> None:
    example = CHART / "examples" / "networkpolicy.yaml"
    values = yaml.safe_load(example.read_text())
    doc = (ROOT / "docs" / "security.md").read_text()
    block = doc.split("## Recommended NetworkPolicy", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(block)["networkPolicy"] == values["networkPolicy"]
    jsonschema.validate(merged(values), schema())
    objects = render(chart, values)
    policy = by_kind(objects, "NetworkPolicy")
    kubernetes_validate.validate(policy, KUBE_VERSION, strict=True)
    ingress = policy["spec"]["ingress"]
    assert [[p["port"] for p in rule["ports"]] for rule in ingress] == [["grpc"], ["metrics"]]
    assert ingress[0]["from"] == values["networkPolicy"]["grpcFrom"]
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]


@pytest.mark.parametrize("key", ["configMap", "configmaps", "configMaps.yaml-"])
def test_a_misspelt_configmaps_key_is_refused_by_name(chart: Any, key: str) -> None:
    """``policies.configMap: [team-a]`` was read as a policy file named configMap and refused
    as "got array, want string / object": a type error about the wrong thing."""
    with pytest.raises(helm.HelmValuesError) as raised:
        chart.render({"policies": {key: ["team-a"]}}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    message = str(raised.value)
    assert f"at '/policies': additional properties '{key}' not allowed" in message, message
    assert "want string" not in message and "want object" not in message


@pytest.mark.parametrize(("limiter", "field"), [
    ({"name": "r", "type": "request_rate", "rate": 1, "burst": 0}, "/limiters/0/burst': exclusiveMinimum"),
    ({"name": "c", "type": "concurrent_requests", "limit": "ten"}, "/limiters/0/limit': got string, want integer"),
    ({"name": "q", "type": "quota", "limit": 5, "period": "fortnight"}, "/limiters/0/period': value must be one of"),
    ({"name": "r", "type": "request_rat", "rate": 1, "burst": 5}, "/limiters/0/type': value must be one of"),
    ({"name": "r", "type": "request_rate", "rate": 1, "burst": 5, "applies_to": {"tiers": "get"}},
     "/limiters/0/applies_to/tiers': got string, want array"),
])
def test_a_policy_error_at_render_is_one_line_as_check_policies_says_it(
        chart: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], limiter: dict[str, Any], field: str) -> None:
    """One bad field: Helm's message names it in one line (it printed about 20, one per limiter
    kind and optional-field alternative), and check-policies names the same field."""
    from extauthz.commands.cli import main

    policy = {"version": 1, "identity": [{"header": "x-api-key"}], "limiters": [limiter]}
    with pytest.raises(helm.HelmValuesError) as raised:
        chart.render({"policies": {"api.yaml": policy}}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    problems = [line for line in str(raised.value).splitlines() if line.lstrip().startswith("- at ")]
    leaves = [line for line in problems if "'allOf' failed" not in line]
    assert len(leaves) == 1 and f"at '/policies/api.yaml{field}" in leaves[0], str(raised.value)
    assert len(problems) <= 2, str(raised.value)
    (tmp_path / "api.yaml").write_text(yaml.safe_dump(policy))
    assert main(["check-policies", str(tmp_path / "api.yaml")]) == 1
    [said] = capsys.readouterr().err.splitlines()
    assert field.split("'")[0].rsplit("/", 1)[-1] in said, said  # the same field, one line each
