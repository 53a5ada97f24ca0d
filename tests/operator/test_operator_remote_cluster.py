"""Learner units in another cluster (spec.clusters): a second real control plane stands for it. The operator puts
the units' pods there from the kubeconfig in a Secret (inline credentials only: an exec plugin or a token file is
refused, and never runs nor is read), heals and scales them there, shows the cluster in
`kubectl get lu`, degrades only those units while that cluster does not answer (its apiserver frozen with SIGSTOP), and removes its
objects there when the job is deleted (a finalizer: ownerReferences do not cross clusters)."""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import yaml

from diloco_devcluster import testbed as testbed_mod
from diloco_kube.labels import POOL_LABEL
from diloco_operator.objects import certs
from test_operator_autoscale_cluster import H100, Nodes, autoscaled_job, running_units, template  # helpers only
from test_operator_cluster import condition, cpu_units, job, running, wait_job_ready  # helpers only

from polling import wait_for
from cluster_kit import Kubectl

pytestmark = pytest.mark.cluster
SYNCER_URL = "https://syncer.west.example:8470"


@pytest.fixture(scope="module")
def remote():
    """The "west" cluster: a second control plane with its own kwok pools."""
    try:
        tb = testbed_mod.start(log=lambda m: print(f"[remote testbed] {m}", file=sys.stderr))
    except testbed_mod.TestbedUnavailable as exc:
        pytest.fail(f"cannot start a second control plane: {exc}")
    yield tb
    os.kill(tb.pids["kube-apiserver"], signal.SIGCONT)  # in case a failed test left it frozen
    tb.stop()


@pytest.fixture(autouse=True)
def remote_logs_on_failure(request, remote):
    """A test that fails here prints the tail of the remote control plane's logs (its work directory goes with it)."""
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed:
        print(f"[remote testbed] logs, last lines:\n{testbed_mod.tail_logs(Path(remote.workdir), 40)}",
              file=sys.stderr)


def kubeconfig_secret(kubectl: Kubectl, ns: str, remote, user: dict | None = None,
                      secret: str = "west-kubeconfig") -> dict:
    """The remote cluster's kubeconfig in a Secret of `ns`, and the spec.clusters entry naming it. The credential
    is inline (a token; `user` replaces it), in a context that is not the current one (whose user's token is wrong:
    using it would fail every call)."""
    config = yaml.safe_load(open(remote.kubeconfig).read())
    config["users"][0]["user"] = {"token": "not-the-token"}
    config["users"].append({"name": "west-user", "user": user or {"token": remote.token}})
    cluster = config["contexts"][0]["context"]["cluster"]
    config["contexts"].append({"name": "west-admin", "context": {"cluster": cluster, "user": "west-user"}})
    kubectl.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret},
                   "stringData": {"kubeconfig": yaml.safe_dump(config)}}, "-n", ns)
    return {"name": "west", "kubeconfigSecret": {"name": secret}, "context": "west-admin",
            "syncerUrl": SYNCER_URL}


def remote_pods(far: Kubectl, ns: str, unit: str) -> list[dict]:
    return [p for p in far.get("pod", ns=ns, selector=f"diloco.dev/unit={unit}") or []
            if not p["metadata"].get("deletionTimestamp")]


def test_units_in_a_remote_cluster_run_heal_scale_degrade_alone_and_are_removed_with_the_job(kubectl, operator, ns,
                                                                                         remote):
    far = Kubectl(remote)
    west = kubeconfig_secret(kubectl, ns, remote)
    units = cpu_units(1) + [{"name": "far", "count": 1, "maxCount": 2, "cluster": "west",
                             "nodeSelector": {POOL_LABEL: "cpu"}}]  # maxCount: scaling moves no data shard
    kubectl.apply(job("two", units, clusters=[west]), "-n", ns)
    wait_job_ready(kubectl, ns, "two", 2, timeout=120)

    # The unit lives at home, its pod in the remote cluster (a namespace of the same name, created there).
    lu = kubectl.get("lu", "two-far-0", ns=ns)
    assert lu["spec"]["cluster"] == "west" and condition(lu, "ClusterReachable")["status"] == "True"
    row = next(line for line in kubectl.run("get", "lu", "-n", ns).stdout.splitlines() if "two-far-0" in line)
    assert "west" in row.split()
    assert kubectl.get("pod", ns=ns, selector="diloco.dev/unit=two-far-0") == []
    (pod,) = remote_pods(far, ns, "two-far-0")
    assert running(pod)
    assert "ownerReferences" not in pod["metadata"]  # their owner is in another cluster
    assert f"LearnerUnit/two-far-0/{lu['metadata']['uid']}" in pod["metadata"]["annotations"]["diloco.dev/home-owner"]
    command = pod["spec"]["containers"][0]["command"]
    assert command[command.index("--syncer") + 1] == SYNCER_URL
    assert far.get("secret", "two-far-0-learner-token", ns=ns) is not None
    assert far.get("configmap", "two-syncer-ca", ns=ns)["data"]["ca.crt"] == \
        kubectl.get("configmap", "two-syncer-ca", ns=ns)["data"]["ca.crt"]
    assert far.get("pod", ns=ns, selector="diloco.dev/unit=two-cpu-0") == []
    # The syncer's certificate also names the address the remote pods dial.
    tls = kubectl.get("secret", "two-syncer-tls", ns=ns)["data"]
    assert "syncer.west.example" in certs.inspect(base64.b64decode(tls["tls.crt"]).decode()).hosts

    # Healing there: a deleted remote pod is replaced there.
    far.run("delete", "pod", pod["metadata"]["name"], "-n", ns, "--wait=false")
    wait_for(lambda: [p for p in remote_pods(far, ns, "two-far-0") if p["metadata"]["uid"] != pod["metadata"]["uid"]
                      and running(p)], 60, "a new pod for two-far-0 in the remote cluster", 0.5)
    wait_job_ready(kubectl, ns, "two", 2, timeout=60)
    assert kubectl.get("lu", "two-far-0", ns=ns)["status"]["restarts"] == 1

    # Scaling works there too: a second remote unit appears there, and once scaled away its objects there go.
    def far_count(n: int) -> None:
        kubectl.run("patch", "dj", "two", "-n", ns, "--type=json", "-p",
                    f'[{{"op": "replace", "path": "/spec/units/1/count", "value": {n}}}]')
    kept = [p["metadata"]["uid"] for p in remote_pods(far, ns, "two-far-0")]
    far_count(2)
    wait_for(lambda: [p for p in remote_pods(far, ns, "two-far-1") if running(p)], 60, "two-far-1's pod there", 0.5)
    wait_job_ready(kubectl, ns, "two", 3, timeout=60)
    far_count(1)
    wait_for(lambda: not remote_pods(far, ns, "two-far-1") and far.get("secret", "two-far-1-learner-token", ns=ns)
             is None, 60, "two-far-1's pod and token Secret swept from the remote cluster", 0.5)
    assert [p["metadata"]["uid"] for p in remote_pods(far, ns, "two-far-0")] == kept, "scaling touched two-far-0"
    wait_job_ready(kubectl, ns, "two", 2, timeout=60)

    # The remote cluster stops answering: only its units are affected, the job says which cluster and why.
    os.kill(remote.pids["kube-apiserver"], signal.SIGSTOP)
    try:
        dj = wait_for(lambda: (d := kubectl.get("dj", "two", ns=ns)) and
                      condition(d, "ClustersReachable").get("status") == "False" and d, 90, "ClustersReachable=False on the job", 0.5)
        assert "west" in condition(dj, "ClustersReachable")["message"]
        wait_for(lambda: condition(kubectl.get("lu", "two-far-0", ns=ns), "ClusterReachable").get("status") ==
                 "False", 60, "ClusterReachable=False on the remote unit", 0.5)
        home = kubectl.get("lu", "two-cpu-0", ns=ns)
        assert home["status"]["phase"] == "Running" and dj["status"]["phase"] == "Running"
        assert any(e["reason"] == "ClusterUnreachable" for e in kubectl.get("events", ns=ns))
    finally:
        os.kill(remote.pids["kube-apiserver"], signal.SIGCONT)
    wait_for(lambda: condition(kubectl.get("dj", "two", ns=ns), "ClustersReachable").get("status") == "True", 90,
             "ClustersReachable=True once the cluster answers again", 0.5)
    wait_job_ready(kubectl, ns, "two", 2, timeout=60)

    # Deleting the job removes its objects in the remote cluster too, then the job itself.
    assert "diloco.dev/remote-cleanup" in kubectl.get("dj", "two", ns=ns)["metadata"]["finalizers"]
    kubectl.run("delete", "dj", "two", "-n", ns, "--wait=false")

    def remote_left():
        return [f"{kind}/{o['metadata']['name']}" for kind in ("pod", "secret", "configmap", "services")
                for o in far.get(kind, ns=ns, selector="diloco.dev/job=two") or []
                if not o["metadata"].get("deletionTimestamp")]
    wait_for(lambda: not remote_left(), 60, "the job's objects gone from the remote cluster", 0.5)
    wait_for(lambda: kubectl.get("dj", "two", ns=ns) is None, 60, "the job gone", 0.5)
    operator.wait_looked_again()  # and its remote units' polling: no unit of the deleted job puts a pod back there
    assert not remote_left(), remote_left()


def test_an_autoscaled_job_falls_back_to_a_remote_cluster_and_grows_there_when_nodes_arrive(kubectl, operator, ns,
                                                                                            remote):
    far = Kubectl(remote)
    far_nodes = Nodes(far, ns)
    gpu_node = {"cpu": "208", "memory": "1872Gi", "nvidia.com/gpu": "8", "pods": "110"}
    try:
        far_nodes.add("h100", 1, gpu_node, H100)
        # "near" (home) has a pool without nodes; "far" is the same kind of unit in the remote cluster.
        units = [template(ns, "near", "h100", {"type": "nvidia-h100-80gb", "count": 8}, 2),
                 {**template(ns, "far", "h100", {"type": "nvidia-h100-80gb", "count": 8}, 2), "cluster": "west"}]
        manifest = autoscaled_job("grow", units, minUnits=1, maxUnits=3, preference=["near", "far"])
        manifest["spec"]["clusters"] = [kubeconfig_secret(kubectl, ns, remote)]
        kubectl.apply(manifest, "-n", ns)
        wait_for(lambda: sorted(running_units(kubectl, ns, "grow").values()) == ["far"], 90, "one unit running in the remote cluster (no room at home)", 0.5)
        (first,) = [p["metadata"]["uid"] for p in remote_pods(far, ns, "grow-far-0")]
        # A second node there: the autoscaler sees the room on the remote cluster's Nodes and grows into it.
        far_nodes.add("h100", 1, gpu_node, H100, first=1)
        wait_for(lambda: sorted(running_units(kubectl, ns, "grow").values()) == ["far", "far"], 90, "a second remote unit once its node arrived there", 0.5)
        assert [p["metadata"]["uid"] for p in remote_pods(far, ns, "grow-far-0")] == [first], "healthy unit touched"
        # The job's status follows on the operator's next pass over the job (CI once read runningUnits 1 here).
        wait_for(lambda: (st := kubectl.get("dj", "grow", ns=ns)["status"]["autoscaling"])["runningUnits"] == 2
                 and any(p["name"].startswith("grow-near-") for p in st["parkedUnits"]) and st, 60,
                 "the job's autoscaling status to count both remote units and the parked home one", 0.5)
    finally:
        far_nodes.delete_all()


def test_a_kubeconfig_with_an_exec_plugin_or_a_token_file_is_refused_and_nothing_runs_or_is_read(kubectl, operator,
                                                                                                ns, remote, tmp_path):
    """Both would work if loaded (the plugin prints the remote's token, the file holds it): the operator must refuse
    them by field before building a client, so the plugin never runs (its marker file stays absent) and the file is
    never read (the cluster stays unreachable)."""
    marker = tmp_path / "exec-plugin-ran"
    credential = json.dumps({"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
                             "status": {"token": remote.token}})
    exec_user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "/bin/sh",
                          "args": ["-c", f"touch {marker}; printf '%s' '{credential}'"], "interactiveMode": "Never"}}
    token_file = tmp_path / "token"
    token_file.write_text(remote.token)
    cases = {"plug": (exec_user, "users[1].user.exec"), "file": ({"tokenFile": str(token_file)},
                                                                 "users[1].user.tokenFile")}
    for name, (user, field) in cases.items():
        west = kubeconfig_secret(kubectl, ns, remote, user, secret=f"{name}-kubeconfig")
        kubectl.apply(job(name, [{"name": "far", "count": 1, "cluster": "west",
                                  "nodeSelector": {POOL_LABEL: "cpu"}}], clusters=[west]), "-n", ns)
    for name, (user, field) in cases.items():
        cond = wait_for(lambda: (c := condition(kubectl.get("lu", f"{name}-far-0", ns=ns) or {},
                                                "ClusterReachable")) and c.get("status") == "False" and c, 60, f"ClusterReachable=False on {name}-far-0", 0.5)
        assert cond["reason"] == "KubeconfigRefused", cond
        assert field in cond["message"] and "inline" in cond["message"], cond["message"]
        dj = wait_for(lambda: (d := kubectl.get("dj", name, ns=ns)) and
                      condition(d, "ClustersReachable").get("status") == "False" and d, 60, f"ClustersReachable=False on job {name}", 0.5)
        assert field in condition(dj, "ClustersReachable")["message"]
    assert not marker.exists(), "the exec plugin ran inside the operator"
    assert Kubectl(remote).get("namespaces", ns) is None, "the operator reached the remote cluster"
    for name in cases:  # a cluster never reached holds the job's deletion (its finalizer): give up on it, as users would
        kubectl.run("delete", "dj", name, "-n", ns, "--wait=false")
        kubectl.run("patch", "dj", name, "-n", ns, "--type=merge", "-p", '{"metadata": {"finalizers": null}}')
        wait_for(lambda: kubectl.get("dj", name, ns=ns) is None, 60, f"job {name} gone", 0.5)
