"""The Helm chart (charts/decoupled-diloco) rendered by a real helm: it lints, its defaults watch the release's own
namespace only, `clusterWide: true` is manifests/operator.yaml and its namespaced values
manifests/operator-namespaced.yaml object for object (so the two install paths cannot drift), and its values
change what they say."""

from __future__ import annotations

import re

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


def test_cluster_wide_renders_manifests_operator_yaml(helm):
    _assert_same_objects(helm.render("--set", "clusterWide=true"), _manifest("operator.yaml"))


def test_the_default_install_watches_only_the_release_namespace_with_no_cluster_wide_right(helm):
    """Issue 38, Medium 6: the namespaced install is the default; every namespace is an explicit choice."""
    rendered = helm.render(namespace="ml-team")
    assert not _by_kind(rendered, "ClusterRole") and not _by_kind(rendered, "ClusterRoleBinding")
    (role,), (binding,) = _by_kind(rendered, "Role"), _by_kind(rendered, "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "ml-team"
    (manifest_role,) = _by_kind(_manifest("operator-namespaced.yaml"), "Role")
    assert role["rules"] == manifest_role["rules"]
    command = _command(rendered)
    assert "--namespace=ml-team" in command and "--no-watch-nodes" in command
    both = helm.run("template", "r", str(CHART), "--set", "clusterWide=true", "--set", "watchNamespaces={team-a}",
                    check=False)
    assert both.returncode and "leave watchNamespaces empty" in both.stderr, both.stderr


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
    rendered = helm.render("--set", "clusterWide=true", "--set", "watchNodes=false")
    (cluster_role,) = _by_kind(rendered, "ClusterRole")
    assert not [r for r in cluster_role["rules"] if "nodes" in r["resources"]]
    assert "--no-watch-nodes" in _command(rendered)


def test_kueue_enabled_runs_the_operator_with_kueue_and_its_read_of_flavors_is_there_either_way(helm):
    assert "--kueue" not in _command(helm.render())
    rendered = helm.render("--set", "clusterWide=true", "--set", "kueue.enabled=true")
    assert "--kueue" in _command(rendered)
    (cluster_role,) = _by_kind(rendered, "ClusterRole")
    assert {"apiGroups": ["kueue.x-k8s.io"], "resources": ["resourceflavors", "workloadpriorityclasses"],
            "verbs": ["get"]} in cluster_role["rules"]
    assert {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads/status"], "verbs": ["patch"]} \
        in cluster_role["rules"]


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


def _selects(monitor: dict, pod_meta: dict, pod_spec: dict) -> bool:
    """Whether a PodMonitor's selector and one of its endpoints' port names pick this pod (as prometheus-operator
    matches them: every matchLabels pair on the pod, and a container port of the endpoint's name)."""
    labels = pod_meta.get("labels") or {}
    wanted = monitor["spec"]["selector"]["matchLabels"]
    ports = {p.get("name") for c in pod_spec["containers"] for p in c.get("ports", [])}
    return all(labels.get(k) == v for k, v in wanted.items()) and any(
        e["port"] in ports for e in monitor["spec"]["podMetricsEndpoints"])


def test_pod_monitors_and_the_dashboard_render_only_when_enabled_and_select_the_pods_that_serve_metrics(helm):
    from diloco_operator.objects import builders as objects
    from test_operator_decisions import JOB, job_spec

    default = helm.render()
    assert not _by_kind(default, "PodMonitor") and not _by_kind(default, "ConfigMap")
    rendered = helm.render("--set", "metrics.podMonitor.enabled=true", "--set", "metrics.podMonitor.interval=30s",
                           "--set", "metrics.podMonitor.labels.release=kube-prometheus-stack")
    monitors = {m["metadata"]["name"]: m for m in _by_kind(rendered, "PodMonitor")}
    assert sorted(monitors) == ["diloco-learners", "diloco-operator", "diloco-syncers"]
    assert not _by_kind(rendered, "ConfigMap")  # the dashboard is a value of its own
    for m in monitors.values():
        assert m["apiVersion"] == "monitoring.coreos.com/v1"
        assert m["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert {e["interval"] for e in m["spec"]["podMetricsEndpoints"]} == {"30s"}
    # Each monitor picks the pods it names and no other: the operator's own, a job's syncer, a job's learner.
    spec = job_spec()
    syncer = objects.syncer_deployment(JOB, spec)["spec"]["template"]
    unit = objects.learner_unit(JOB, objects.unit_spec("demo", spec, spec.units[0], 0, 0))
    unit["metadata"]["uid"] = "lu-1"
    learner = objects.unit_pod(unit, incarnation=0, rank=0)
    (deployment,) = _by_kind(rendered, "Deployment")
    operator_pod = deployment["spec"]["template"]
    pods = {"diloco-operator": operator_pod, "diloco-syncers": syncer, "diloco-learners": learner}
    for name, monitor in monitors.items():
        for pod_name, pod in pods.items():
            assert _selects(monitor, pod["metadata"], pod["spec"]) == (pod_name == name), (name, pod_name)
    # The syncer serves https with the job's TLS (its pod says so): the monitor takes the scheme from the pod.
    assert syncer["metadata"]["annotations"]["prometheus.io/scheme"] == "https"
    (endpoint,) = monitors["diloco-syncers"]["spec"]["podMetricsEndpoints"]
    scheme = endpoint["relabelings"][-1]
    assert scheme["sourceLabels"] == ["__meta_kubernetes_pod_annotation_prometheus_io_scheme"]
    assert scheme["targetLabel"] == "__scheme__"
    # Issue 38, Low 9: bounded samples, targets and labels; only pods whose controller is of the kind the operator
    # makes them with are kept (a learner's LearnerUnit, a spare's DilocoJob, a syncer's ReplicaSet).
    learner_owner = learner["metadata"]["ownerReferences"][0]["kind"]
    assert learner_owner == "LearnerUnit"
    for name, kinds in (("diloco-syncers", "ReplicaSet"), ("diloco-learners", "LearnerUnit|DilocoJob")):
        m = monitors[name]["spec"]
        (keep,) = [r for e in m["podMetricsEndpoints"] for r in e.get("relabelings", []) if r.get("action") == "keep"]
        assert keep == {"sourceLabels": ["__meta_kubernetes_pod_controller_kind"], "regex": kinds, "action": "keep"}
        assert m["sampleLimit"] > 0 and m["targetLimit"] > 0 and m["labelLimit"] == 64
    assert re.fullmatch(monitors["diloco-learners"]["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["regex"],
                        learner_owner)
    assert monitors["diloco-operator"]["spec"]["sampleLimit"] == 20000
    for name in ("diloco-syncers", "diloco-learners"):
        assert monitors[name]["spec"]["namespaceSelector"] == {"matchNames": ["diloco-system"]}
    every = helm.render("--set", "metrics.podMonitor.enabled=true", "--set", "clusterWide=true")
    for m in _by_kind(every, "PodMonitor"):
        if m["metadata"]["name"] != "diloco-operator":
            assert m["spec"]["namespaceSelector"] == {"any": True}
    namespaced = helm.render("--set", "metrics.podMonitor.enabled=true", "--set", "watchNamespaces={team-a,team-b}")
    for m in _by_kind(namespaced, "PodMonitor"):
        if m["metadata"]["name"] != "diloco-operator":
            assert m["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def test_the_dashboard_configmap_carries_the_dashboard_json_with_the_sidecar_label(helm):
    import json

    rendered = helm.render("--set", "metrics.dashboard.enabled=true", "--set", "metrics.dashboard.namespace=grafana")
    (cm,) = _by_kind(rendered, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["namespace"] == "grafana"
    assert json.loads(cm["data"]["diloco.json"]) == json.loads((CHART / "dashboards" / "diloco.json").read_text())
    assert not _by_kind(rendered, "PodMonitor")


def test_a_namespaced_install_with_kueue_binds_only_the_cluster_scoped_kueue_reads(helm):
    assert _by_kind(helm.render("--set", "watchNamespaces={team-a}"), "ClusterRole") == []
    rendered = helm.render("--set", "watchNamespaces={team-a}", "--set", "kueue.enabled=true")
    (cluster_role,) = _by_kind(rendered, "ClusterRole")
    assert cluster_role["rules"] == [{"apiGroups": ["kueue.x-k8s.io"],
                                      "resources": ["resourceflavors", "workloadpriorityclasses"], "verbs": ["get"]}]
    (binding,) = _by_kind(rendered, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == "diloco-operator"
