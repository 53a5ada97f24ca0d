"""A real node beside kwok's fake pools: kubelet on containerd (CRI), kube-proxy and CoreDNS on this machine.

Pods run as real containers on the CNI bridge (10.88.0.0/16) and reach the apiserver, Services (kube-proxy,
iptables) and cluster DNS (CoreDNS, at the bridge gateway) as on a real cluster. Needs root and the container
engine of hack/container-engine.sh. Storage: static local PersistentVolumes on this machine (class `real-local`).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
import urllib.error
from pathlib import Path
from typing import Callable

import yaml

from diloco_kube.labels import POOL_LABEL

NODE_NAME = "real-cpu-0"
POOL = "real-cpu"
BRIDGE = "cni0"
GATEWAY = "10.88.0.1"  # the bridge's address on the host: apiserver, kubelet and cluster DNS listen here
POD_CIDR = "10.88.0.0/16"
SERVICE_CIDR = "10.96.0.0/24"
KUBERNETES_SERVICE_IP = "10.96.0.1"
CRI_SOCKET = "/run/containerd/containerd.sock"
STORAGE_CLASS = "real-local"
VOLUMES = 12  # static local PVs made at start (each job's syncer checkpoint takes one; Retain keeps its data)
VOLUME_SIZE = "10Gi"
ROOT = Path(__file__).resolve().parents[2]
ENGINE_SCRIPT = ROOT / "hack" / "container-engine.sh"
BINARIES = ("kubelet", "kube-proxy", "coredns")


class RealNodeUnavailable(RuntimeError):
    """This machine cannot run the real node; the message says why and what to do."""


def check_host(bin_dir: Path) -> None:
    """Raise RealNodeUnavailable unless this process can run a kubelet here (root, binaries, tools, no other kubelet)."""
    if os.geteuid() != 0:
        raise RealNodeUnavailable("a real node needs root (the kubelet, containerd and the CNI bridge run as root)")
    missing = [b for b in BINARIES if not os.access(bin_dir / b, os.X_OK)]
    if missing:
        raise RealNodeUnavailable(f"missing in {bin_dir}: {', '.join(missing)}; build them with hack/build-testbed.sh")
    if not ENGINE_SCRIPT.is_file():
        raise RealNodeUnavailable(f"{ENGINE_SCRIPT} is missing (it starts containerd with the CRI for the kubelet)")
    running = subprocess.run(["pgrep", "-x", "kubelet"], capture_output=True, text=True).stdout.split()
    if running:
        raise RealNodeUnavailable(f"a kubelet already runs on this machine (pid {', '.join(running)}); "
                                  "stop it first (`diloco devcluster down`)")


def engine(action: str, log: Callable[[str], None] = lambda _m: None) -> bool:
    """Run hack/container-engine.sh ACTION; for `status`, whether it answers."""
    proc = subprocess.run(["bash", str(ENGINE_SCRIPT), action], capture_output=True, text=True)
    if action == "status":
        return proc.returncode == 0
    if proc.returncode != 0:
        raise RealNodeUnavailable(f"hack/container-engine.sh {action} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    log(f"container engine {action}: ok")
    return True


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check)


# iptables rules this node needs: forwarded pod traffic is accepted even where Docker set FORWARD to DROP.
FORWARD_RULES = (("-i", BRIDGE, "-j", "ACCEPT"), ("-o", BRIDGE, "-j", "ACCEPT"))


def setup_network() -> None:
    """The CNI bridge with the gateway address (so CoreDNS can bind it before the first pod), forwarding on."""
    if _run("ip", "link", "show", BRIDGE, check=False).returncode != 0:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
    if f"{GATEWAY}/" not in _run("ip", "-o", "addr", "show", "dev", BRIDGE).stdout:
        _run("ip", "addr", "add", f"{GATEWAY}/16", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
    for rule in FORWARD_RULES:
        if _run("iptables", "-C", "FORWARD", *rule, check=False).returncode != 0:
            _run("iptables", "-I", "FORWARD", "1", *rule)


def teardown_network() -> None:
    for rule in FORWARD_RULES:
        _run("iptables", "-D", "FORWARD", *rule, check=False)
    for tool in ("iptables", "ip6tables"):
        remove_kube_chains(tool)
    _run("ip", "link", "del", BRIDGE, check=False)


def remove_kube_chains(tool: str) -> None:
    """Remove every KUBE-* chain (the kubelet's canaries and firewall; kube-proxy's if `--cleanup` left any) and
    the jumps into them, so a stopped node leaves the host's firewall as it found it."""
    for table in ("filter", "nat", "mangle"):
        rules = _run(tool, "-t", table, "-S", check=False).stdout.splitlines()
        for rule in rules:
            parts = shlex.split(rule)
            if parts[:1] == ["-A"] and not parts[1].startswith("KUBE-") and "KUBE-" in rule:
                _run(tool, "-t", table, "-D", *parts[1:], check=False)
        chains = [r.split()[1] for r in rules if r.startswith("-N KUBE-")]
        for chain in chains:
            _run(tool, "-t", table, "-F", chain, check=False)
        for chain in chains:
            _run(tool, "-t", table, "-X", chain, check=False)


def pki_extras(pki: Path, openssl: Callable[..., None]) -> None:
    """The kubelet's serving certificate and the apiserver's client certificate for talking to kubelets."""
    (pki / "kubelet.ext").write_text(f"subjectAltName=IP:{GATEWAY},DNS:{NODE_NAME}\nextendedKeyUsage=serverAuth\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "kubelet.key", "-out", "kubelet.csr",
            "-subj", f"/CN={NODE_NAME}", cwd=pki)
    openssl("x509", "-req", "-in", "kubelet.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "kubelet.crt", "-days", "3650", "-extfile", "kubelet.ext", cwd=pki)
    (pki / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "kubelet-client.key", "-out", "kubelet-client.csr",
            "-subj", "/O=system:masters/CN=kube-apiserver-kubelet-client", cwd=pki)
    openssl("x509", "-req", "-in", "kubelet-client.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "kubelet-client.crt", "-days", "3650", "-extfile", "client.ext", cwd=pki)


def apiserver_flags(pki: Path) -> list[str]:
    """What the apiserver needs beyond the kwok-only testbed: reachable from pods at the gateway, the
    `kubernetes` Service pointing there, node authorization, and a client certificate for kubelet logs/exec."""
    return ["--bind-address=0.0.0.0", f"--advertise-address={GATEWAY}", "--endpoint-reconciler-type=lease",
            "--authorization-mode=Node,RBAC", "--kubelet-preferred-address-types=InternalIP,Hostname",
            f"--kubelet-client-certificate={pki / 'kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'kubelet-client.key'}"]


def kubelet_config(pki: Path) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # this VM has the cgroup v1 hierarchy; 1.36 refuses it unless told
        "cgroupDriver": "cgroupfs", "containerRuntimeEndpoint": f"unix://{CRI_SOCKET}", "failSwapOn": False,
        "address": GATEWAY, "readOnlyPort": 0, "healthzPort": 0,
        "tlsCertFile": str(pki / "kubelet.crt"), "tlsPrivateKeyFile": str(pki / "kubelet.key"),
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(pki / "ca.crt")}},
        "authorization": {"mode": "Webhook"},
        "clusterDNS": [GATEWAY], "clusterDomain": "cluster.local", "resolvConf": "",
        "serializeImagePulls": False, "maxPods": 110,
        # Images are imported, never pulled: a busy shared disk must not garbage-collect or evict them.
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "nodeStatusReportFrequency": "10s", "nodeStatusUpdateFrequency": "5s",
    }


def kube_proxy_config(kubeconfig_path: Path, metrics_port: int) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig_path)}, "mode": "iptables",
        "clusterCIDR": POD_CIDR, "hostnameOverride": NODE_NAME,
        # Pods on one bridge reach each other's Services without br_netfilter: every Service hop is masqueraded.
        "iptables": {"masqueradeAll": True},
        "conntrack": {"maxPerCore": 0},  # leave the host's conntrack sysctls alone
        "metricsBindAddress": f"127.0.0.1:{metrics_port}", "healthzBindAddress": "",
    }


def corefile(kubeconfig_path: Path) -> str:
    return (f".:53 {{\n    bind {GATEWAY}\n    errors\n"
            f"    kubernetes cluster.local in-addr.arpa ip6.arpa {{\n        kubeconfig {kubeconfig_path} diloco-testbed\n"
            "        pods insecure\n        fallthrough in-addr.arpa ip6.arpa\n    }\n    cache 5\n}\n")


def volume_dir(work: Path) -> Path:
    return work / "volumes"


def storage_objects(work: Path) -> list[tuple[str, dict]]:
    """The default StorageClass `real-local` and VOLUMES static local PVs on this node (API path, object)."""
    sc = {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
          "metadata": {"name": STORAGE_CLASS, "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
          "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "WaitForFirstConsumer",
          "reclaimPolicy": "Retain"}
    out = [("/apis/storage.k8s.io/v1/storageclasses", sc)]
    for i in range(VOLUMES):
        path = volume_dir(work) / f"pv-{i}"
        path.mkdir(parents=True, exist_ok=True)
        out.append(("/api/v1/persistentvolumes", {
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{NODE_NAME}-pv-{i}",
                                                                       "labels": {POOL_LABEL: POOL}},
            "spec": {"capacity": {"storage": VOLUME_SIZE}, "accessModes": ["ReadWriteOnce"],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": STORAGE_CLASS,
                     "local": {"path": str(path)},
                     "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                         {"key": "kubernetes.io/hostname", "operator": "In", "values": [NODE_NAME]}]}]}}},
        }))
    return out


def process_args(work: Path, tokens: dict[str, str], kubeconfig: Callable[[str, str], dict],
                 free_port: Callable[[], int]) -> dict[str, list[str]]:
    """Write the configs and return the command line of each node process (kubelet, kube-proxy, coredns);
    `kubeconfig(token, user)` builds a kubeconfig for the control plane."""
    pki = work / "pki"
    node = work / "node"
    node.mkdir(exist_ok=True)
    files = {
        "kubelet.kubeconfig": kubeconfig(tokens["node"], f"system:node:{NODE_NAME}"),
        "kube-proxy.kubeconfig": kubeconfig(tokens["proxy"], "system:kube-proxy"),
        "admin.kubeconfig": kubeconfig(tokens["admin"], "admin"),
        "kubelet.yaml": kubelet_config(pki),
        "kube-proxy.yaml": kube_proxy_config(node / "kube-proxy.kubeconfig", free_port()),
    }
    for name, doc in files.items():
        (node / name).write_text(yaml.safe_dump(doc, sort_keys=False))
    (node / "Corefile").write_text(corefile(node / "admin.kubeconfig"))
    return {
        "kubelet": [f"--config={node / 'kubelet.yaml'}", f"--kubeconfig={node / 'kubelet.kubeconfig'}",
                    f"--root-dir={node / 'kubelet'}", f"--hostname-override={NODE_NAME}", f"--node-ip={GATEWAY}",
                    f"--node-labels={POOL_LABEL}={POOL},diloco.dev/real-node=true", "--v=1"],
        "kube-proxy": [f"--config={node / 'kube-proxy.yaml'}", "--v=1"],
        "coredns": [f"-conf={node / 'Corefile'}", "-dns.port=53"],
    }


def running_tasks() -> list[str]:
    """IDs of the containers containerd still runs for the kubelet (namespace k8s.io)."""
    out = _run("ctr", "-n", "k8s.io", "tasks", "ls", check=False).stdout.splitlines()[1:]
    return [line.split()[0] for line in out if "RUNNING" in line]


def drain(request: Callable[..., dict], timeout_s: float = 60.0, log: Callable[[str], None] = lambda _m: None) -> None:
    """Delete every pod bound to the real node and wait until the kubelet has stopped their containers;
    containers still running after `timeout_s` are killed through containerd. Controllers must be stopped first."""
    try:
        pods = request("GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{NODE_NAME}").get("items", [])
    except (urllib.error.URLError, OSError) as exc:
        log(f"cannot list the real node's pods ({exc}); killing its containers")
        pods = []
    for pod in pods:
        meta = pod["metadata"]
        try:
            request("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                    {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 5})
        except (urllib.error.URLError, OSError):
            pass
    deadline = time.monotonic() + timeout_s
    while pods and time.monotonic() < deadline and running_tasks():
        time.sleep(0.5)
    for task in running_tasks():
        log(f"killing leftover container {task[:12]}")
        _run("ctr", "-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL", task, check=False)
    time.sleep(0.5)
    for task in running_tasks():
        _run("ctr", "-n", "k8s.io", "tasks", "rm", "-f", task, check=False)


def remove_stopped_containers() -> None:
    """Forget the containers and sandboxes the kubelet left in containerd (it garbage-collects them only while
    it runs); images stay."""
    listed = _run("ctr", "-n", "k8s.io", "containers", "ls", "-q", check=False).stdout.split()
    running = set(running_tasks())
    for cid in listed:
        if cid not in running:
            _run("ctr", "-n", "k8s.io", "tasks", "rm", "-f", cid, check=False)
            _run("ctr", "-n", "k8s.io", "containers", "rm", cid, check=False)


def cleanup(work: Path, bin_dir: Path) -> None:
    """After the node's processes stopped: kube-proxy's iptables rules, the kubelet's mounts, the bridge."""
    _run(str(bin_dir / "kube-proxy"), "--cleanup", check=False)
    kubelet_dir = str(work / "node" / "kubelet")
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
              if line.split()[1].startswith(kubelet_dir)]
    for mount in sorted(mounts, key=len, reverse=True):
        _run("umount", "-l", mount, check=False)
    remove_stopped_containers()
    teardown_network()
    shutil.rmtree(work / "node", ignore_errors=True)
