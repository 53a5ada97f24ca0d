"""The down-link benchmark's figures: received/sent ratios and the loss cost paired by seed, its targets, its plot."""

import json

import pytest

from diloco_bench import downlink, report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _row(seed, loss, up, down):
    return {"seed": seed, "val_loss": loss, "run": "", "up_per_step": up, "down_per_step": down,
            "ddp_per_step": 5e6}


def test_the_downlink_table_gives_received_over_sent_and_the_loss_cost_paired_by_seed(tmp_path):
    measured = {"fp32": [_row(0, 2.0, 27e3, 300e3), _row(1, 2.2, 27e3, 310e3)],
                "int4": [_row(1, 2.2, 27e3, 40e3), _row(0, 2.02, 27e3, 44e3)],
                "int2": [_row(0, 2.0, 27e3, 25e3), _row(1, 2.2, 27e3, 27e3)]}
    result = report.new_result(downlink.NAME, "quick")
    result["figures"]["runs"] = measured
    downlink._summarize(result, measured)
    rows = {r[0]: r for r in result["table"]["rows"]}
    assert rows["int4"][3] == "1.56×" and rows["int2"][3] == "0.96×" and rows["fp32"][5] == "-"
    assert sorted(result["figures"]["loss_cost"]["int4"]["values"]) == pytest.approx([0.0, 0.01])
    verdicts = {t["claim"]: t["met"] for t in result["targets"]}
    assert verdicts["int4 down-link bytes"] is False and verdicts["int2 down-link bytes"] is True
    assert verdicts["int2 down-link loss cost"] is True
    downlink.plot(result, tmp_path / "downlink.png")
    assert (tmp_path / "downlink.png").read_bytes()[:8] == PNG_MAGIC


def test_the_downlink_benchmark_in_tiny_mode_runs_nothing_and_says_so(tmp_path):
    path = report.finish(downlink.run(report.Context(mode="tiny", out_dir=tmp_path)), tmp_path)
    data = json.loads(path.read_text())
    assert all(t["met"] is None and t["measured"] == "not run" for t in data["targets"])
    assert (tmp_path / "downlink.png").read_bytes()[:8] == PNG_MAGIC
