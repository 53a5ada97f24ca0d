"""Manifests and the dev cluster: every manifest passes a server-side dry-run; `diloco devcluster` works."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from diloco_devcluster.pools import DEFAULT_POOLS
from diloco_kube.labels import POOL_LABEL

from cluster_kit import KUBECTL, PYTHONPATH, ROOT
from polling import alive, wait_for

MANIFESTS = sorted((ROOT / "manifests").glob("*.yaml"))


def test_there_are_sample_jobs_and_operator_manifests():
    names = {p.name for p in MANIFESTS}
    assert {"cpu-job.yaml", "mixed-gpu-tpu-job.yaml", "operator.yaml"} <= names


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / "manifests" / name).read_text()) if d]


def _grants(role: dict) -> dict[tuple[str, str], set[str]]:
    return {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}


def test_the_operator_role_is_least_privilege():
    (role,) = [d for d in _docs("operator.yaml") if d["kind"] == "ClusterRole"]
    grants = _grants(role)
    assert not any("*" in key or "*" in verbs for key, verbs in grants.items())
    # patch: renewing its own syncer certificate (spec.syncer.tls.mode Auto); never list or watch.
    assert grants[("", "secrets")] == {"get", "create", "patch"}, "the operator never lists or watches Secrets"
    # patch: kopf's finalizer on jobs with a spec.chaos daemon, and the chaos start-time annotation (never spec).
    assert grants[("diloco.dev", "dilocojobs")] == {"get", "list", "watch", "patch"}
    # The one cluster-scoped kind it touches is read-only; no CRD or namespace scanning (kopf's scanning is off).
    assert grants[("", "nodes")] == {"get", "list", "watch"}
    assert not {k for k in grants if k[1] in ("customresourcedefinitions", "namespaces")}
    # Create-only; get: an existing object of that name is used only if the job controls it.
    assert grants[("", "services")] == grants[("", "persistentvolumeclaims")] == {"get", "create"}


def test_the_namespaced_install_has_no_cluster_wide_right_and_the_same_namespaced_rules():
    docs = _docs("operator-namespaced.yaml")
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    (role,) = [d for d in docs if d["kind"] == "Role"]
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    (sa,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    watched = role["metadata"]["namespace"]
    assert binding["metadata"]["namespace"] == watched and binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": sa["metadata"]["namespace"]}]
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert f"--namespace={watched}" in command and "--no-watch-nodes" in command
    (cluster_role,) = [d for d in _docs("operator.yaml") if d["kind"] == "ClusterRole"]
    cluster_scoped = {("", "nodes"), ("kueue.x-k8s.io", "resourceflavors"), ("kueue.x-k8s.io", "workloadpriorityclasses")}
    assert _grants(role) == {k: v for k, v in _grants(cluster_role).items() if k not in cluster_scoped}


def test_the_operator_command_watches_only_the_namespaces_given_and_nodes_only_when_asked():
    def command(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "diloco_trainer.cli", "operator", "--dry-print", *args],
                             env={**os.environ, "PYTHONPATH": PYTHONPATH}, capture_output=True, text=True, check=True)
        return out.stdout
    assert "--all-namespaces" in command()
    namespaced = command("--namespace", "a", "-n", "b", "--no-watch-nodes")
    assert "--namespace=a --namespace=b" in namespaced and "--all-namespaces" not in namespaced


@pytest.mark.cluster
@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_each_manifest_passes_a_server_side_dry_run(kubectl, operator, ns, path):
    # operator.yaml is already installed by the operator fixture; the dry run must still accept it unchanged.
    # Namespaces a manifest creates are created for real first: a dry run does not create what later documents need.
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc["kind"] == "Namespace":
            kubectl.run("create", "namespace", doc["metadata"]["name"], check=False)
    args = ["apply", "--dry-run=server", "-f", str(path)]
    if "namespace:" not in path.read_text():
        args += ["-n", ns]
    out = kubectl.run(*args, check=False)
    assert out.returncode == 0, out.stderr
    assert "(server dry run)" in out.stdout


@pytest.mark.cluster
def test_devcluster_up_gives_a_working_kubeconfig_and_down_stops_it(testbed, tmp_path):
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    cli = [sys.executable, "-m", "diloco_trainer.cli", "devcluster"]
    up = subprocess.run([*cli, "up", "--dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=180)
    try:
        assert up.returncode == 0, up.stderr
        kubeconfig = up.stdout.strip().split("KUBECONFIG=", 1)[1]
        assert Path(kubeconfig).exists()
        kenv = {**os.environ, "KUBECONFIG": kubeconfig}
        nodes = subprocess.run([KUBECTL, "get", "nodes", "-L", POOL_LABEL, "--no-headers"], env=kenv,
                               capture_output=True, text=True, check=True).stdout
        assert len(nodes.splitlines()) == sum(p.nodes for p in DEFAULT_POOLS)
        crds = subprocess.run([KUBECTL, "get", "crd", "-o", "name"], env=kenv, capture_output=True, text=True).stdout
        assert "dilocojobs.diloco.dev" in crds
        status = subprocess.run([*cli, "status", "--dir", str(tmp_path)], env=env, capture_output=True, text=True)
        assert status.returncode == 0 and "kube-apiserver" in status.stdout
        pids = yaml.safe_load((tmp_path / "testbed.json").read_text())["pids"]
    finally:
        down = subprocess.run([*cli, "down", "--dir", str(tmp_path)], env=env, capture_output=True, text=True,
                              timeout=60)
    assert down.returncode == 0, down.stderr
    assert not [name for name, pid in pids.items() if alive(pid)], "devcluster down left processes running"


def test_a_control_plane_whose_port_was_taken_before_it_bound_starts_again_on_other_ports(testbed, monkeypatch):
    """The apiserver's port is taken by someone else between being picked and being bound (a busy machine's
    ephemeral ports): the start is made again on new ports instead of failing (seen once in CI)."""
    import socket

    from diloco_devcluster import testbed as testbed_mod

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    picks = iter([port] * 4)  # etcd, its peers, the apiserver, kwok: all taken the first time
    real = testbed_mod._free_port
    monkeypatch.setattr(testbed_mod, "_free_port", lambda: next(picks, None) or real())
    said = []
    try:
        tb = testbed_mod.start(log=said.append)
    finally:
        taken.close()
    try:
        assert any("starting again on other ports" in m for m in said), said
        assert tb.server != f"https://127.0.0.1:{port}"
        assert subprocess.run([KUBECTL, "--kubeconfig", tb.kubeconfig, "get", "--raw", "/readyz"],
                              capture_output=True, text=True).stdout == "ok"
    finally:
        tb.stop()


def test_devcluster_status_without_a_cluster_says_so(tmp_path):
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    out = subprocess.run([sys.executable, "-m", "diloco_trainer.cli", "devcluster", "status", "--dir", str(tmp_path)],
                         env=env, capture_output=True, text=True)
    assert out.returncode == 1 and "no dev cluster" in out.stderr


def test_a_control_plane_process_stops_and_starts_again_with_its_own_command_line(testbed):
    """What the real-node test does to its kubelet (tests/e2e: a node whose kubelet stops), on the scheduler here:
    `stop_process` stops one process and leaves the others serving; `start_process` runs the same command line
    again, in the same place of the stop order, and the cluster schedules again."""
    from diloco_devcluster import testbed as testbed_mod

    tb = testbed_mod.start()
    try:
        order, first = list(tb.pids), tb.pids["kube-scheduler"]
        tb.stop_process("kube-scheduler")
        assert tb.alive() == {name: name != "kube-scheduler" for name in order}
        tb.start_process("kube-scheduler")
        with pytest.raises(RuntimeError, match="is running"):
            tb.start_process("kube-scheduler")
        assert list(tb.pids) == order and tb.pids["kube-scheduler"] != first and all(tb.alive().values())
        saved = testbed_mod.Testbed.load(tb.workdir)
        assert saved.pids == tb.pids and saved.commands["kube-scheduler"] == tb.commands["kube-scheduler"]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "after-restart"},
               "spec": {"containers": [{"name": "c", "image": "none"}], "tolerations": [{"operator": "Exists"}]}}
        tb.create("/api/v1/namespaces/default/pods", pod)
        wait_for(lambda: tb.request("GET", "/api/v1/namespaces/default/pods/after-restart")["spec"].get("nodeName"),
                 60, "the pod bound by the restarted scheduler", 0.5)
    finally:
        tb.stop()
