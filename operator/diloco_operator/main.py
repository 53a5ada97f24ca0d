"""`diloco operator`: run the operator, which is `kopf run -m diloco_operator.handlers` underneath."""

from __future__ import annotations

import argparse
import os
import sys


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--namespace", action="append", default=[],
                        help="watch this namespace (repeatable; default: all namespaces)")
    parser.add_argument("--watch-nodes", action=argparse.BooleanOptionalAction, default=True,
                        help="watch Nodes (cluster-scoped: needs list/watch on nodes) for unit pools and the "
                             "autoscaler's accelerator capacity; --no-watch-nodes runs with namespaced rights only")
    parser.add_argument("--trust-syncer-url-annotation", action="store_true",
                        help="follow a job's diloco.dev/syncer-url annotation (an operator outside the cluster, "
                             "e.g. against `diloco devcluster`); off: a job's author could send its token anywhere")
    parser.add_argument("--kueue", action="store_true",
                        help="admit the units of jobs labelled kueue.x-k8s.io/queue-name through Kueue, one Workload "
                             "per unit (needs Kueue's CRDs; docs/operator.md \"Kueue\")")
    parser.add_argument("--workers", type=int, default=16, help="reconciles running at once")
    parser.add_argument("--resync-seconds", type=float, default=30.0,
                        help="look at every known object this often, events or not (a safety net: watch events "
                             "drive the work); N units are fed at 20 a second, so each is looked at every max(this, N/20) s")
    parser.add_argument("--metrics-port", type=int, default=8080, help="Prometheus /metrics port (0: off)")
    parser.add_argument("--liveness-port", type=int, default=0, help="kopf liveness /healthz port (0: off)")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--dry-print", action="store_true", help="print the kopf command instead of running it")


def kopf_command(args: argparse.Namespace) -> list[str]:
    """The exact kopf command line `diloco operator` runs."""
    cmd = [sys.executable, "-m", "kopf", "run", "-m", "diloco_operator.handlers", "--standalone"]
    cmd += [f"--namespace={ns}" for ns in args.namespace] or ["--all-namespaces"]
    if args.liveness_port:
        cmd.append(f"--liveness=http://0.0.0.0:{args.liveness_port}/healthz")
    if args.verbose:
        cmd.append("--verbose")
    return cmd


def run(args: argparse.Namespace) -> int:
    if args.workers < 1 or args.resync_seconds <= 0:
        raise ValueError("--workers must be >= 1 and --resync-seconds > 0")
    cmd = kopf_command(args)
    if args.dry_print:
        print(" ".join(cmd))
        return 0
    env = {**os.environ, "DILOCO_OPERATOR_WORKERS": str(args.workers),
           "DILOCO_OPERATOR_RESYNC_SECONDS": str(args.resync_seconds),
           "DILOCO_OPERATOR_METRICS_PORT": str(args.metrics_port),
           "DILOCO_OPERATOR_WATCH_NODES": "1" if args.watch_nodes else "0",
           "DILOCO_OPERATOR_KUEUE": "1" if args.kueue else "0",
           "DILOCO_OPERATOR_TRUST_SYNCER_URL": "1" if args.trust_syncer_url_annotation else "0"}
    os.execve(sys.executable, cmd, env)  # replaces this process: signals reach kopf directly
    return 0  # not reached
