"""Every panel of the Grafana dashboard has data: a real Prometheus scrapes a real operator, syncer and learner of one
DilocoJob on the testbed (kwok runs the unit's pod; the syncer and the learner run here, as in the job-status
test), one of the unit's pods is deleted (a fault the operator heals), and each query of the dashboard is evaluated
through Prometheus's HTTP API: one that returns nothing fails the test."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cluster_kit import PYTHONPATH, ROOT
from dashboard_kit import wait_for_data_in_every_query
from diloco_kube.labels import POOL_LABEL
from polling import stop, wait_for
from prometheus_kit import Prometheus, free_port, prometheus_binary, static
from test_operator_cluster import cpu_units, job, unit_pods, wait_job_ready

pytestmark = pytest.mark.cluster

# ~25k parameters on 200 kB of the stdlib's source: a merge every few seconds on one core.
TINY = {"model": {"seq_len": 16, "d_model": 16, "n_layers": 1, "n_heads": 2}, "data": {"max_bytes": 200_000},
        "inner": {"batch_size": 8, "warmup_steps": 5}, "outer": {"fragments": 2, "sync_every": 4}}


def _spawn(args: list[str], log, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "diloco_trainer.cli", *args], env=env, stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT)


def test_prometheus_scrapes_operator_syncer_and_learner_and_every_dashboard_query_has_data(
        kubectl, operator, ns, tmp_path):
    binary = prometheus_binary()
    kubectl.apply(job("mon", cpu_units(1), config=TINY,
                      syncer={"nodeSelector": {POOL_LABEL: "cpu"}, "tls": {"mode": "Disabled"}}), "-n", ns)
    wait_job_ready(kubectl, ns, "mon", 1)
    token = base64.b64decode(kubectl.get("secret", "mon-token", ns=ns)["data"]["token"]).decode()
    config = tmp_path / "config.yaml"
    config.write_text(kubectl.get("configmap", "mon-config", ns=ns)["data"]["config.yaml"])
    env = {**os.environ, "DILOCO_TOKEN": token, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1",
           "DILOCO_DATA_CACHE": str(Path(tempfile.gettempdir()) / "diloco-test-data-cache")}  # learner_kit's
    state, learner_port = tmp_path / "syncer", free_port()
    syncer = learner = None
    with open(tmp_path / "syncer.log", "wb") as slog, open(tmp_path / "learner.log", "wb") as llog:
        try:
            syncer = _spawn(["syncer", "--config", str(config), "--host", "127.0.0.1", "--port", "0",
                             "--state-dir", str(state), "--heartbeat-s", "0.5", "--checkpoint-every-s", "2"],
                            slog, env)
            url = wait_for(lambda: (state / "endpoint.json").exists()
                           and json.loads((state / "endpoint.json").read_text())["url"], 90, "the syncer to listen")
            # The unit's learner (its id is the unit's name, as in the pod the operator made), run here.
            learner = _spawn(["learner", "--syncer", url, "--learner-id", "mon-cpu-0", "--token-env", "DILOCO_TOKEN",
                              "--state-dir", str(tmp_path / "learner"), "--metrics-port", str(learner_port),
                              "--steps", "100000", "--log-every", "2", "--poll-s", "0.5"], llog, env)
            kubectl.run("annotate", "dj", "mon", "-n", ns, f"diloco.dev/syncer-url={url}")
            scrapes = [static("operator", f"127.0.0.1:{operator.metrics_port}"),
                       static("syncer", url.split("://", 1)[1]), static("learner", f"127.0.0.1:{learner_port}")]
            with Prometheus(binary, tmp_path / "prometheus", scrapes) as prom:
                wait_for(lambda: {t["labels"]["job"]: t["health"] for t in prom.targets()} == dict.fromkeys(
                    ("operator", "syncer", "learner"), "up"), 120,
                         "prometheus scraping the operator, the syncer and the learner", 1.0)
                # Merges happened and the operator read them into the job's goodput.
                mine = f'namespace="{ns}"'  # the operator's series of this job (its own labels namespace and job)
                wait_for(lambda: prom.query("min(diloco_syncer_fragment_version) >= 1")
                         and prom.query(f"diloco_operator_job_goodput{{{mine}}}"), 180,
                         "a merge of every fragment and the job's goodput", 1.0)
                # A fault: the unit's pod is deleted; the operator restarts the unit and times its recovery.
                (victim,) = unit_pods(kubectl, ns, "mon-cpu-0")
                kubectl.run("delete", "pod", victim["metadata"]["name"], "-n", ns, "--wait=false")
                wait_for(lambda: prom.query(f"diloco_operator_job_last_recovery_seconds{{{mine}}}"), 90,
                         "the fault's recovery time scraped", 1.0)
                wait_for_data_in_every_query(prom.query, 30)
                # The figures are the job's: goodput a fraction, recovery the status's, the learner's steps seen.
                # (The scrape job's label `job` renames the operator's own to exported_job.)
                (goodput,) = prom.query(f"diloco_operator_job_goodput{{{mine}}}")
                assert goodput["metric"]["exported_job"] == "mon" and 0 <= float(goodput["value"][1]) <= 1
                (recovery,) = prom.query(f"diloco_operator_job_last_recovery_seconds{{{mine}}}")
                status = kubectl.get("dj", "mon", ns=ns)["status"]
                assert float(recovery["value"][1]) == status["lastFault"]["recoverySeconds"]
                assert prom.query('diloco_learner_step{learner_id="mon-cpu-0"} > 0')
        except BaseException:
            print(f"learner log:\n{(tmp_path / 'learner.log').read_text(errors='replace')[-3000:]}\n"
                  f"syncer log:\n{(tmp_path / 'syncer.log').read_text(errors='replace')[-3000:]}\n"
                  f"operator log:\n{operator.log_tail()}", file=sys.stderr)
            raise
        finally:
            stop(learner, 30)
            stop(syncer, 30)
