"""The inner-loop benchmarks: bf16 vs fp32 in its tiny mode writes a result whose figures come from both precisions'
own steps, a table and a PNG; the overhead benchmark's bare loop runs as its own process and reports its windows."""

import json
import subprocess
import sys

import pytest
import yaml

from diloco_bench import precision, report
from diloco_bench.runs import BENCH_CONFIG

pytestmark = pytest.mark.slow  # separate processes and real training steps: minutes on a busy 2-core machine

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_precision_tiny_times_and_trains_both_precisions_on_the_same_batches(tmp_path):
    ctx = report.Context(mode="tiny", out_dir=tmp_path)
    data = json.loads(report.finish(precision.run(ctx), tmp_path).read_text())
    rows = data["figures"]["rows"]
    assert set(rows) == {"fp32", "bf16"}
    for r in rows.values():
        assert len(r["losses"]) == data["figures"]["steps"] and r["step_s_median"] > 0 and r["val_loss"] > 0
    assert abs(rows["fp32"]["losses"][0] - rows["bf16"]["losses"][0]) < 0.05, "same weights, same first batch"
    assert rows["fp32"]["losses"] != rows["bf16"]["losses"], "bf16 must actually compute differently"
    assert data["figures"]["bf16_speedup"] == rows["fp32"]["step_s_median"] / rows["bf16"]["step_s_median"]
    assert len(data["table"]["rows"]) == 2 and (tmp_path / "precision.png").read_bytes()[:8] == PNG_MAGIC


def test_the_bare_loop_is_a_process_of_its_own_reporting_a_rate_per_window(tmp_path):
    cfg = json.loads(json.dumps(BENCH_CONFIG))
    cfg["model"] = {"seq_len": 32, "d_model": 32, "n_layers": 1, "n_heads": 2}
    config, out = tmp_path / "run.yaml", tmp_path / "bare.json"
    config.write_text(yaml.safe_dump(cfg))
    subprocess.run([sys.executable, "-m", "diloco_bench.overhead", str(config), "6", "2", str(out)], check=True,
                   timeout=300)
    windows = json.loads(out.read_text())["tokens_per_s"]
    assert len(windows) == 3 and all(w > 0 for w in windows)
