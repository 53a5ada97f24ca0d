"""The Helm chart (charts/decoupled-diloco) rendered by a real helm: it lints, its defaults are manifests/operator.yaml
and its namespaced values manifests/operator-namespaced.yaml object for object (so the two install paths cannot
drift), and its values change what they say."""

from __future__ import annotations

import pytest
import yaml

from cluster_kit import ROOT
from helm_kit import CHART

# The standard labels the chart puts on every object's metadata (the pods' own labels, which NetworkPolicies select,
# are the manifests' exactly).
CHART_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by",
                "helm.sh/chart")


def _manifest(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / "manifests" / name).read_text()) if d]


def _key(doc: dict) -> tuple[str, str, str | None]:
    return doc["kind"], doc["metadata"]["name"], doc["metadata"].get("namespace")


def _without_labels(doc: dict) -> dict:
    return {**doc, "metadata": {k: v for k, v in doc["metadata"].items() if k != "labels"}}


def _assert_same_objects(rendered: list[dict], manifest: list[dict]) -> None:
    # Namespaces aside: Helm installs into a namespace that exists (`--create-namespace` or the user's own).
    expected = {_key(d): d for d in manifest if d["kind"] != "Namespace"}
    got = {_key(d): d for d in rendered}
    assert sorted(got) == sorted(expected), "the chart and the manifest create different objects"
    for key, doc in expected.items():
        assert _without_labels(got[key]) == _without_labels(doc), f"{key} differs between the chart and the manifest"
        labels, chart_labels = doc["metadata"].get("labels", {}), got[key]["metadata"]["labels"]
        assert labels.items() <= chart_labels.items() and set(chart_labels) - set(labels) <= set(CHART_LABELS), key


def _by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def _command(docs: list[dict]) -> list[str]:
    (deployment,) = _by_kind(docs, "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]["command"]


def test_the_chart_passes_helm_lint_strict(helm):
    out = helm.run("lint", "--strict", str(CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout, out.stdout
    out = helm.run("lint", "--strict", str(CHART), "--set", "watchNamespaces={team-a,team-b}",
                   "--set", "metrics.service.enabled=true")
    assert "0 chart(s) failed" in out.stdout, out.stdout


def test_the_default_values_render_manifests_operator_yaml(helm):
    _assert_same_objects(helm.render(), _manifest("operator.yaml"))


def test_one_watched_namespace_without_nodes_renders_manifests_operator_namespaced_yaml(helm):
    rendered = helm.render("--set", "watchNamespaces={diloco-jobs}")
    _assert_same_objects(rendered, _manifest("operator-namespaced.yaml"))
    assert not _by_kind(rendered, "ClusterRole") and not _by_kind(rendered, "ClusterRoleBinding")


def test_each_watched_namespace_gets_a_role_a_binding_and_a_flag_and_watch_nodes_adds_only_read_on_nodes(helm):
    rendered = helm.render("--set", "watchNamespaces={team-a,team-b}", "--set", "watchNodes=true",
                           namespace="ops")
    roles, bindings = _by_kind(rendered, "Role"), _by_kind(rendered, "RoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert all(b["subjects"] == [{"kind": "ServiceAccount", "name": "diloco-operator", "namespace": "ops"}]
               for b in bindings)
    command = _command(rendered)
    assert "--namespace=team-a" in command and "--namespace=team-b" in command
    assert "--no-watch-nodes" not in command
    (cluster_role,) = _by_kind(rendered, "ClusterRole")
    assert cluster_role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]
    (cluster_binding,) = _by_kind(rendered, "ClusterRoleBinding")
    assert cluster_binding["roleRef"]["name"] == cluster_role["metadata"]["name"]


def test_a_cluster_wide_install_without_nodes_drops_the_nodes_rule_and_says_so_to_the_operator(helm):
    rendered = helm.render("--set", "watchNodes=false")
    (cluster_role,) = _by_kind(rendered, "ClusterRole")
    assert not [r for r in cluster_role["rules"] if "nodes" in r["resources"]]
    assert "--no-watch-nodes" in _command(rendered)


def test_image_resources_metrics_and_extra_args_reach_the_deployment(helm):
    rendered = helm.render("--set", "image.repository=registry.example/diloco-operator", "--set", "image.tag=9.9.9",
                           "--set", "resources.limits.memory=1Gi", "--set", "metrics.port=9100",
                           "--set", "extraArgs={--workers=8}", "--set", "metrics.service.enabled=true")
    (deployment,) = _by_kind(rendered, "Deployment")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "registry.example/diloco-operator:9.9.9"
    assert container["resources"]["limits"]["memory"] == "1Gi"
    assert container["command"][-2:] == ["--liveness-port=8081", "--workers=8"]
    assert "--metrics-port=9100" in container["command"]
    assert {"name": "metrics", "containerPort": 9100} in container["ports"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9100"
    (service,) = _by_kind(rendered, "Service")
    assert service["spec"]["selector"] == pod["metadata"]["labels"]
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"


def test_the_image_tag_defaults_to_the_charts_app_version(helm):
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    (deployment,) = _by_kind(helm.render(), "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == f"diloco-operator:{app_version}"


@pytest.mark.parametrize("value, where", [
    ("metrics.port=http", "'/metrics/port'"),
    ("watchNamespaces=team-a", "'/watchNamespaces'"),
    ("watchNamespaces={Team_A}", "'/watchNamespaces/0'"),
    ("extraArgs={workers}", "'/extraArgs/0'"),
    ("image.pullPolicy=Sometimes", "'/image/pullPolicy'"),
    ("metricsPort=9100", "'metricsPort' not allowed"),
])
def test_a_bad_value_is_refused_naming_the_field(helm, value, where):
    out = helm.run("template", "x", str(CHART), "--set", value, check=False)
    assert out.returncode != 0 and where in out.stderr, out.stderr


def test_the_chart_installs_the_generated_crds_with_include_crds(helm):
    rendered = helm.render("--include-crds")
    crds = {d["metadata"]["name"] for d in _by_kind(rendered, "CustomResourceDefinition")}
    assert crds == {d["metadata"]["name"] for p in sorted((ROOT / "crds").glob("*.yaml"))
                    for d in yaml.safe_load_all(p.read_text())}
