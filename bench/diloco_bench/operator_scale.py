"""Operator scale benchmark on the local control plane (kwok): N single-pod CPU learner units (in templates of at
most 1,000) from `kubectl apply` to all Running; K learner pods deleted at once, until every one is replaced; API
requests per periodic resync.

    python -m diloco_bench.operator_scale --units 1000 --kill 20 [--resync-seconds 5] [--workers 4]

Prints one JSON line of figures. Needs the testbed binaries (hack/build-testbed.sh) and kubectl.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from diloco_devcluster import testbed
from diloco_devcluster.cli import install_crds
from diloco_devcluster.pools import DEFAULT_POOLS, NodePool
from diloco_operator.api import models as api
from diloco_operator.reconcile.workqueue import RESYNC_PASSES_PER_S

ROOT = Path(__file__).resolve().parents[2]
POOL = "bench-cpu"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _templates(units: int) -> list[dict]:
    """`units` spread over as few templates as the CRD allows (api.MAX_UNITS_PER_TEMPLATE each)."""
    cap = api.MAX_UNITS_PER_TEMPLATE
    return [{"name": f"cpu{i}", "count": min(cap, units - start),
             "nodeSelector": {"cloud.google.com/gke-nodepool": POOL}}
            for i, start in enumerate(range(0, units, cap))]


def _job(units: int) -> dict:
    return {"apiVersion": api.API_VERSION, "kind": "DilocoJob", "metadata": {"name": "scale", "namespace": "default"},
            "spec": {"image": "diloco-trainer:bench", "units": _templates(units),
                     "syncer": {"nodeSelector": {"cloud.google.com/gke-nodepool": "cpu"}},
                     "restartPolicy": {"backoffSeconds": 0, "maxRestarts": 100}}}


def _metrics(port: int) -> dict[str, float]:
    """Each metric summed over its labels, plus API requests by "VERB resource" and reconciles by kind and result."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            name = key.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
            if name in ("diloco_operator_api_requests_total", "diloco_operator_reconciles_total"):
                labels = {k: v.strip('"') for k, v in (kv.split("=", 1) for kv in key[len(name) + 1:-1].split(","))}
                what = (f"{labels['verb']} {labels['resource']}" if "verb" in labels
                        else f"reconcile {labels['kind']} {labels['result']}")
                out[what] = out.get(what, 0.0) + float(value)
    return out


def _apiserver_requests(tb: testbed.Testbed) -> dict[str, float]:
    """Requests the API server has served, from every client, by "VERB resource" (its apiserver_request_total)."""
    out: dict[str, float] = {}
    for line in tb.request("GET", "/metrics", timeout=30)["raw"].splitlines():
        if line.startswith("apiserver_request_total{"):
            key, _, value = line.rpartition(" ")
            labels = dict(kv.split("=", 1) for kv in key[len("apiserver_request_total{"):-1].split(","))
            what = f"{labels.get('verb', '').strip(chr(34))} {labels.get('resource', '').strip(chr(34))}"
            out[what] = out.get(what, 0.0) + float(value)
    return out


def _by_verb(after: dict[str, float], before: dict[str, float] | None = None) -> dict[str, int]:
    """API requests by "VERB resource" (and reconciles by kind and result) between two scrapes."""
    before = before or {}
    return {k: int(v - before.get(k, 0)) for k, v in sorted(after.items())
            if " " in k and v - before.get(k, 0) > 0}


def _cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU time (user + system) each process has used so far: a figure the other load on the machine changes less
    than wall time."""
    out = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def _units_running(tb: testbed.Testbed) -> int:
    """Units whose phase is Running, from one list served by the apiserver's watch cache (resourceVersion=0): at
    thousands of units a list read from etcd on every poll took a share of the 2 cores the run measures."""
    items = tb.request("GET", "/apis/diloco.dev/v1alpha1/namespaces/default/learnerunits?resourceVersion=0",
                       timeout=120)["items"]
    return sum(1 for u in items if (u.get("status") or {}).get("phase") == "Running")


def _units_ready(tb: testbed.Testbed) -> int:
    """The job's own count of ready units (status.unitsReady): one small object per poll."""
    job = tb.request("GET", "/apis/diloco.dev/v1alpha1/namespaces/default/dilocojobs/scale")
    return (job.get("status") or {}).get("unitsReady") or 0


def _pods_of_units(tb: testbed.Testbed, units: set[str]) -> list[dict]:
    """The learner pods of these units only (a label selector: not every pod of the job on each poll)."""
    selector = urllib.parse.quote(f"diloco.dev/unit in ({','.join(sorted(units))})")
    return tb.request("GET", f"/api/v1/namespaces/default/pods?labelSelector={selector}", timeout=60)["items"]


def _learner_pods(tb: testbed.Testbed) -> list[dict]:
    path = "/api/v1/namespaces/default/pods?labelSelector=diloco.dev%2Fcomponent%3Dlearner&resourceVersion=0"
    return [p for p in tb.request("GET", path, timeout=120)["items"] if not p["metadata"].get("deletionTimestamp")]


def _wait(what: str, predicate, timeout: float, interval: float = 0.25) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if predicate():
                return time.monotonic() - start
        except urllib.error.HTTPError as exc:  # 429 while a watch cache initializes
            if exc.code != 429:
                raise
        except (http.client.IncompleteRead, TimeoutError) as exc:  # a large list cut short on a loaded machine
            print(f"[bench] {what}: poll failed ({exc!r}), retrying", file=sys.stderr, flush=True)
        time.sleep(interval)
    raise TimeoutError(f"{what}: not within {timeout:.0f}s")


def run(units: int, kill: int, resync_s: float, workers: int, timeout: float) -> dict:
    nodes = max(2, -(-units // 100))  # 110 pods per node, some room left
    pools = tuple(p for p in DEFAULT_POOLS if p.name == "cpu") + (
        NodePool(POOL, nodes, {"cpu": "1000", "memory": "4000Gi", "pods": "110"}),)
    tb = testbed.start(pools=pools, log=lambda m: print(f"[testbed] {m}", file=sys.stderr))
    op = None
    try:
        install_crds(tb)
        env = {**os.environ, "KUBECONFIG": tb.kubeconfig}
        subprocess.run(["kubectl", "wait", "--for=condition=Established", "crd", "--all", "--timeout=60s"],
                       env=env, check=True, capture_output=True)
        port = _free_port()
        log = open(Path(tempfile.gettempdir()) / f"operator-bench-{port}.log", "wb")
        op = subprocess.Popen([sys.executable, "-m", "diloco_trainer.cli", "operator", "--resync-seconds",
                               str(resync_s), "--workers", str(workers), "--metrics-port", str(port)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        _wait("operator metrics", lambda: _metrics(port), 60)
        pids = {**tb.pids, "operator": op.pid}
        cpu0 = _cpu_seconds(pids)
        served0 = _apiserver_requests(tb)
        applied = time.monotonic()
        subprocess.run(["kubectl", "apply", "-f", "-"], input=yaml.safe_dump(_job(units)).encode(), env=env,
                       check=True, capture_output=True)
        milestones: dict[str, float] = {}  # when the operator had sent N unit creates, N pod creates, ...

        shown, listed = [0.0], [time.monotonic()]

        def all_up() -> bool:
            m = _metrics(port)
            for what in ("POST learnerunits", "POST pods", "POST secrets"):
                if what not in milestones and m.get(what, 0) >= units:
                    milestones[what] = round(time.monotonic() - applied, 1)
            ready = _units_ready(tb)
            if time.monotonic() - shown[0] >= 10:  # progress, on stderr: the figures are the one JSON line
                shown[0] = time.monotonic()
                print(f"[bench] {time.monotonic() - applied:6.1f} s: {ready}/{units} units ready; sent "
                      + ", ".join(f"{int(m.get(w, 0))} {w}" for w in ("POST learnerunits", "POST secrets", "POST pods")),
                      file=sys.stderr, flush=True)
            # The job's count lags the units' own phases while the queue is full (it is written once per job
            # reconcile): every unit's phase is read when the count says all, and at least every 10 s regardless.
            if ready < units and time.monotonic() - listed[0] < 10:
                return False
            listed[0] = time.monotonic()
            return _units_running(tb) == units
        all_running = _wait(f"{units} units Running", all_up, timeout, 1.0)
        print(f"[bench] all {units} units Running {all_running:.1f} s after the apply", file=sys.stderr, flush=True)
        up = _metrics(port)
        cpu_up = _cpu_seconds(pids)
        served = _by_verb(_apiserver_requests(tb), served0)
        requests_after_up = up.get("diloco_operator_api_requests_total", 0)

        time.sleep(max(2.0, resync_s))
        m0 = _metrics(port)
        idle_cpu0, idle_t0 = _cpu_seconds({"operator": op.pid})["operator"], time.monotonic()
        # A resync feeds every unit at RESYNC_PASSES_PER_S: at thousands of units one takes minutes, so one is enough.
        feed_s = max(resync_s, (units + 1) / RESYNC_PASSES_PER_S)
        n_resyncs = 3 if feed_s < 60 else 1
        _wait(f"{n_resyncs} resync(s)", lambda: _metrics(port).get("diloco_operator_resyncs_total", 0)
              >= m0.get("diloco_operator_resyncs_total", 0) + n_resyncs, (n_resyncs + 1) * feed_s * 2 + 30, 0.2)
        m1 = _metrics(port)
        # The operator's CPU while nothing happens but resyncs (all Running): what the safety net costs at this size.
        idle_cpu = (_cpu_seconds({"operator": op.pid})["operator"] - idle_cpu0) / (time.monotonic() - idle_t0)
        per_resync = ((m1["diloco_operator_api_requests_total"] - m0["diloco_operator_api_requests_total"])
                      / (m1["diloco_operator_resyncs_total"] - m0["diloco_operator_resyncs_total"]))

        pods = _learner_pods(tb)
        victims = random.Random(0).sample(pods, min(kill, len(pods)))
        gone = {p["metadata"]["uid"] for p in victims}
        before_kill = _metrics(port)
        killed = time.monotonic()
        for p in victims:  # one DELETE each, back to back (~10 ms apart)
            tb.request("DELETE", f"/api/v1/namespaces/default/pods/{p['metadata']['name']}", {"gracePeriodSeconds": 0})
        victim_units = {p["metadata"]["labels"]["diloco.dev/unit"] for p in victims}

        def replaced() -> bool:
            now = {p["metadata"]["labels"]["diloco.dev/unit"]: p for p in _pods_of_units(tb, victim_units)
                   if not p["metadata"].get("deletionTimestamp")}
            return len(now) == len(victim_units) and all(
                p["metadata"]["uid"] not in gone and p["status"].get("phase") == "Running" for p in now.values())
        _wait(f"{kill} pods replaced", replaced, timeout, 0.2)
        replace_s = time.monotonic() - killed
        print(f"[bench] {kill} deleted pods replaced (Running) in {replace_s:.1f} s", file=sys.stderr, flush=True)
        return {"units": units, "nodes": nodes, "workers": workers, "all_running_s": round(all_running, 1),
                "api_requests_to_all_running": int(requests_after_up), "killed": len(victims),
                "replaced_s": round(replace_s, 1), "api_requests_per_resync": round(per_resync, 2),
                "resync_seconds": resync_s, "operator_cores_while_resyncing": round(idle_cpu, 3),
                "since_apply_s": round(time.monotonic() - applied, 1),
                "s_until_all_sent": milestones, "cpu_s_to_all_running": {k: round(v - cpu0.get(k, 0), 1) for k, v in cpu_up.items()},
                "requests_to_all_running": _by_verb(up),
                "apiserver_served_to_all_running": dict(sorted(served.items(), key=lambda kv: -kv[1])[:15]), "requests_during_resyncs": _by_verb(m1, m0),
                "requests_to_replace": _by_verb(_metrics(port), before_kill)}
    finally:
        if op is not None:
            op.terminate()
            try:
                op.wait(timeout=20)
            except subprocess.TimeoutExpired:
                op.kill()
        tb.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--units", type=int, default=300)
    parser.add_argument("--kill", type=int, default=20)
    parser.add_argument("--resync-seconds", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.units, args.kill, args.resync_seconds, args.workers, args.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
