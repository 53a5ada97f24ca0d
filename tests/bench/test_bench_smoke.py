"""Smoke tests of the benchmark suite: the fastest benchmark in its tiny mode writes a well-formed result and plot;
the small pure helpers the other benchmarks rely on behave."""

import json
import time

import pytest

from diloco_bench import cli, heterogeneity, quality, report, runs, syncer_speed

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_syncer_speed_tiny_writes_ratios_to_a_same_run_baseline_a_table_and_a_png(tmp_path):
    ctx = report.Context(mode="tiny", out_dir=tmp_path)
    path = report.finish(syncer_speed.run(ctx), tmp_path)

    data = json.loads(path.read_text())
    assert (data["benchmark"], data["mode"]) == ("syncer_speed", "tiny")
    fig = data["figures"]
    assert fig["model"]["preset"] == "tiny" and fig["model"]["fragments"] == 4
    assert [f["fragment"] for f in fig["per_fragment"]] == [0, 1, 2, 3]
    for f in fig["per_fragment"]:
        for part in ("merge", "decode", "spool"):
            timing = f[part]
            assert timing["time_s"] > 0 and timing["reference_s"] > 0
            assert timing["ratio"] == pytest.approx(timing["time_s"] / timing["reference_s"])
            assert timing["time_s"] <= timing["time_median_s"] and timing["ratio_min"] <= timing["ratio_max"]
    assert [r["learners"] for r in fig["by_learners"]] == [2, 4]
    assert [r["preset"] for r in fig["by_size"]] == ["tiny"]
    assert data["targets"] and all({"claim", "target", "measured", "met", "why"} <= set(t) for t in data["targets"])
    assert data["table"]["rows"] and all(len(r) == len(data["table"]["columns"]) for r in data["table"]["rows"])
    assert data["duration_s"] > 0 and len(data["env"]["loadavg_end"]) == 3
    assert (tmp_path / "syncer_speed.png").read_bytes()[:8] == PNG_MAGIC


def test_only_selects_benchmarks_in_suite_order_and_names_an_unknown_one():
    assert cli.selected("resilience, syncer-speed") == ["syncer_speed", "resilience"]
    assert cli.selected("") == list(cli.BENCHMARKS)
    with pytest.raises(ValueError, match="nope"):
        cli.selected("quality,nope")


def test_paired_timing_puts_the_slower_function_above_its_reference():
    r = report.paired(lambda: time.sleep(0.02), lambda: time.sleep(0.004), repeats=3)
    assert r["time_s"] >= 0.02 and r["reference_s"] >= 0.004
    assert r["ratio"] > 1.5


def test_time_to_target_interpolates_between_evaluations_and_is_none_when_never_reached():
    curve = ([0.0, 10.0, 20.0], [0, 1, 2], [3.0, 2.0, 1.0])
    assert heterogeneity.time_to(curve, 1.5) == pytest.approx(15.0)
    assert heterogeneity.time_to(curve, 3.0) == 0.0
    assert heterogeneity.time_to(curve, 0.5) is None


def test_relative_loss_is_paired_by_seed():
    per = {"ddp": [{"seed": 0, "val_loss": 2.0}, {"seed": 1, "val_loss": 4.0}],
           "decoupled": [{"seed": 1, "val_loss": 4.4}, {"seed": 0, "val_loss": 2.0}]}
    rel = quality.relative(per, "decoupled", "ddp")
    assert sorted(rel["values"]) == pytest.approx([0.0, 0.1])
    assert quality.relative(per, "decoupled", "sync-diloco") is None


def test_run_spec_keys_differ_by_settings_but_not_by_label_and_overrides_reach_the_config():
    a = runs.RunSpec("decoupled", 10, sets=("outer.merge=mean",), label="x")
    assert a.key == runs.RunSpec("decoupled", 10, sets=("outer.merge=mean",), label="y").key
    assert a.key != runs.RunSpec("decoupled", 10).key
    assert a.config()["outer"]["merge"] == "mean" and runs.BENCH_CONFIG["outer"]["merge"] == "rda"
    with pytest.raises(ValueError, match="method"):
        runs.RunSpec("allreduce", 10)


def test_a_verdict_is_undecided_when_the_seed_spread_is_wider_than_the_margin():
    assert report.decide(report.spread([0.06, -0.04]), 0.005) is None
    assert report.decide(report.spread([0.09, 0.10]), 0.02) is False
    assert report.decide(report.spread([0.001, 0.002]), 0.005) is True
    assert report.decide(report.spread([0.001]), 0.005) is True


def test_steps_done_counts_each_incarnation_once_whether_it_restarts_at_zero_or_at_a_checkpoint(tmp_path):
    def write(name, recs):
        d = tmp_path / "learners" / name
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))

    write("learner-0", [{"step": 5}, {"step": 10}, {"step": 3}, {"step": 6}])  # killed at 10, restarted at 0
    # A synchronous worker killed at step 14, resumed from the checkpoint at step 10, then trained to 20.
    write("learner-1", [{"step": 7}, {"step": 14}, {"step": 12, "resumed_from_step": 10},
                        {"step": 20, "resumed_from_step": 10}])
    assert runs.steps_done(tmp_path) == (10 + 6) + (14 + 10)


def test_the_llama_quality_runs_differ_from_the_byte_gpt_runs_only_in_model_data_and_period(tmp_path):
    from diloco_bench import quality_llama
    from diloco_trainer.config import TrainConfig

    ctx = report.Context(mode="full", out_dir=tmp_path)
    specs = [quality_llama.spec(ctx, m, 0, tmp_path / "data") for m in quality_llama.METHODS]
    assert [s.method for s in specs] == ["ddp", "sync-diloco", "decoupled"]
    assert len({s.steps for s in specs}) == 1 and len({s.sets for s in specs}) == 1  # the same tokens and settings
    cfg = TrainConfig.model_validate(specs[2].config())
    assert cfg.model.kind == "hf" and cfg.model.hf.model_type == "llama" and cfg.model.hf.vocab_size == 1024
    assert cfg.data.source == "shards" and cfg.data.tokenizer == str(tmp_path / "data" / "tokenizer.json")
    assert cfg.data.token_unit == "token"
    gpt = TrainConfig.model_validate(runs.RunSpec("decoupled", 1).config())
    assert cfg.outer == gpt.outer and cfg.inner == gpt.inner and gpt.data.token_unit == "byte"
