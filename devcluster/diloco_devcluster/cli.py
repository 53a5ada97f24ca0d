"""`diloco devcluster up|down|status`: the test control plane as a local dev cluster (no Docker needed), and
with `--real-node` a real kubelet node whose pods run as containers (root, containerd).

The processes keep running after `up` returns; `down` stops them by the PIDs recorded in DIR/testbed.json
(a real node is drained first, and a container engine that `up` started is stopped too).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import yaml

from diloco_devcluster import testbed
from diloco_operator.api.schema import CRD_DIR

DEFAULT_DIR = Path.home() / ".cache" / "diloco-testbed" / "devcluster"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--dir", default=str(DEFAULT_DIR), help="working directory (kubeconfig, logs, PIDs)")
    parser.add_argument("--testbed-dir", default=None,
                        help="binaries built by hack/build-testbed.sh (default: $DILOCO_TESTBED_DIR or the cache)")
    parser.add_argument("--build", action="store_true", help="run hack/build-testbed.sh first if binaries are missing")
    parser.add_argument("--no-crds", action="store_true", help="do not install the diloco.dev CRDs")
    parser.add_argument("--real-node", action="store_true",
                        help="also run a real node (kubelet on containerd, kube-proxy, CoreDNS; needs root) in pool "
                             "real-cpu, in place of the fake cpu pool: pods there run as real containers")


def _running(workdir: Path) -> testbed.Testbed | None:
    if not (workdir / "testbed.json").exists():
        return None
    tb = testbed.Testbed.load(workdir)
    return tb if tb.pids and all(tb.alive().values()) else None


def install_crds(tb: testbed.Testbed, crd_dir: Path = CRD_DIR) -> list[str]:
    """Create (or keep) every CRD in crd_dir; returns their names."""
    names = []
    for path in sorted(crd_dir.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        tb.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        names.append(crd["metadata"]["name"])
    return names


def _up(args: argparse.Namespace, workdir: Path) -> int:
    tb = _running(workdir)
    if tb is not None and args.real_node and not tb.real_node:
        raise testbed.TestbedUnavailable(f"the dev cluster in {workdir} runs without a real node; "
                                         "`diloco devcluster down` it first")
    if tb is None:
        if (workdir / "testbed.json").exists():  # a half-dead previous cluster: clear it first
            testbed.stop_pids(testbed.Testbed.load(workdir).pids)
        tb_dir = Path(args.testbed_dir) if args.testbed_dir else testbed.default_dir()
        try:
            testbed.check_binaries(tb_dir)
        except testbed.TestbedUnavailable:
            if not args.build:
                raise
            out = subprocess.run(["bash", str(testbed.BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, check=True)
            tb_dir = Path(out.stdout.strip().splitlines()[-1])
        tb = testbed.start(tb_dir, workdir, real_node=args.real_node,
                           log=lambda m: print(f"[devcluster] {m}", file=sys.stderr),
                           timeout_s=240.0 if args.real_node else 120.0)
        if not args.no_crds:
            print(f"[devcluster] installed CRDs: {', '.join(install_crds(tb))}", file=sys.stderr)
    print(f"export KUBECONFIG={tb.kubeconfig}")
    print(f"# kubectl get nodes -L cloud.google.com/gke-nodepool   (logs: {tb.workdir}/logs)", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    workdir = Path(args.dir).expanduser().resolve()
    if args.action == "up":
        try:
            return _up(args, workdir)
        except testbed.TestbedUnavailable as exc:
            print(f"diloco devcluster: {exc}", file=sys.stderr)
            return 1
    if not (workdir / "testbed.json").exists():
        print(f"no dev cluster in {workdir}", file=sys.stderr)
        return 0 if args.action == "down" else 1
    tb = testbed.Testbed.load(workdir)
    if args.action == "status":
        for name, alive in tb.alive().items():
            print(f"{name:<24} pid {tb.pids[name]:<8} {'running' if alive else 'exited'}")
        print(f"export KUBECONFIG={tb.kubeconfig}")
        return 0 if all(tb.alive().values()) else 1
    tb.stop()
    print(f"stopped the dev cluster in {workdir}", file=sys.stderr)
    return 0
