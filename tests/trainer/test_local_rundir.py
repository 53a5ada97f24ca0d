"""Run directory readers, config overrides and the communication figures the local runtime reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco_trainer.protocol.messages import MetricsRecord, SyncerStatus
from diloco_trainer.protocol.runfiles import RunEvent
from diloco_trainer.runtime import report
from diloco_trainer.runtime.rundir import last_jsonl, learner_totals, make_run_dir, read_jsonl, split_incarnations
from diloco_trainer.runtime.session import load_config, parse_slowdown
from diloco_trainer.runtime.summary import learner_curve, sync_job_figures

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _rec(t, step, tokens, acked_tokens, loss=3.0):
    return {"time": t, "step": step, "tokens": tokens, "acked_tokens": acked_tokens, "loss": loss}


def test_totals_sum_each_incarnations_last_line_because_counters_restart_at_zero():
    records = [_rec(10, 5, 500, 0), _rec(11, 10, 1000, 400),  # first life, killed after step 10
               _rec(21, 5, 500, 200), _rec(22, 8, 800, 800)]  # restarted at t=20
    totals = learner_totals(records, starts=[9.0, 20.0])
    assert totals["step"] == 18 and totals["tokens"] == 1800 and totals["acked_tokens"] == 1200
    assert totals["incarnations"] == 2
    groups = split_incarnations(records, [9.0, 20.0])
    assert [len(g) for g in groups] == [2, 2]


def test_an_incarnation_killed_before_its_first_log_line_counts_nothing():
    records = [_rec(10, 5, 500, 100), _rec(31, 3, 300, 0)]
    groups = split_incarnations(records, [9.0, 20.0, 30.0])
    assert [len(g) for g in groups] == [1, 0, 1]
    assert learner_totals(records, [9.0, 20.0, 30.0])["step"] == 8


def test_an_incarnation_resumed_from_a_checkpoint_counts_only_the_steps_past_it():
    resumed = {"resumed_from_step": 20}
    records = [_rec(10, 24, 2400, 2400),  # first life, killed after step 24 (checkpoint at 20)
               {**_rec(21, 22, 200, 200), **resumed}, {**_rec(22, 30, 1000, 1000), **resumed}]
    assert learner_totals(records, starts=[9.0, 20.0])["step"] == 24 + 10  # steps 21..24 trained twice


def test_a_restarted_sync_job_counts_lost_steps_as_trained_but_not_kept():
    events = [RunEvent(time=1.0, event="start", name="learner-0", role="learner"),
              RunEvent(time=2.0, event="job_restart", name="job", role="job", lost_steps=8)]
    final = {n: MetricsRecord(time=1.0, learner_id=n, step=30, resumed_from_step=20, acked_steps=10)
             for n in ("learner-0", "learner-1")}
    figures = sync_job_figures(events, final, tokens_per_step=512)
    assert figures["restarts"] == 1 and figures["lost_steps"] == 8 and figures["lost_tokens"] == 8 * 512
    assert figures["tokens_merged"] == 60 * 512


def test_learner_curve_accumulates_tokens_across_restarts_and_marks_them():
    records = [_rec(10, 5, 500, 0), _rec(21, 5, 500, 0)]
    curve = learner_curve("learner-0", records, [9.0, 20.0], t0=9.0, deaths=[15.0])
    assert curve.tokens == [500.0, 1000.0]
    assert curve.restarts_s == [12.0] and curve.deaths_s == [6.0]
    assert [(s.start, s.stop) for s in curve.segments()] == [(0, 1), (1, 2)]  # no line across the outage


def test_a_torn_last_line_from_a_killed_writer_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2}) + "\n" + '{"step": 3, "lo')
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    assert last_jsonl(path)["step"] == 2
    assert last_jsonl(tmp_path / "missing.jsonl") is None


def test_run_dir_refuses_a_non_empty_directory(tmp_path):
    run = make_run_dir(tmp_path / "run")
    assert (run / "learners").is_dir() and (run / "final").is_dir()
    (run / "something").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        make_run_dir(run)


def test_default_run_dirs_are_unique_per_start(tmp_path):
    a = make_run_dir(None, root=tmp_path)
    b = make_run_dir(None, root=tmp_path)
    assert a != b and a.parent == b.parent == tmp_path.resolve()


def test_config_overrides_set_nested_fields_and_bad_ones_name_the_field(tmp_path):
    cfg = load_config(CONFIGS / "tiny.yaml", ["outer.compression=int8", "inner.batch_size=4"])
    assert cfg.outer.compression == "int8" and cfg.inner.batch_size == 4
    with pytest.raises(SystemExit, match="compression"):
        load_config(CONFIGS / "tiny.yaml", ["outer.compression=int3"])
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        load_config(CONFIGS / "tiny.yaml", ["outer.compression"])
    with pytest.raises(SystemExit, match="not found"):
        load_config(tmp_path / "nope.yaml", [])


@pytest.mark.parametrize("name", ["local", "tiny", "100m"])
def test_shipped_configs_are_valid_and_their_model_splits_into_p_fragments(name):
    import torch

    from diloco_trainer.protocol.fragments import plan_fragments
    from diloco_trainer.model.gpt import GPT

    cfg = load_config(CONFIGS / f"{name}.yaml", [])
    with torch.device("meta"):  # shapes only: no 100M-parameter init in a unit test
        model = GPT(cfg.model)
    plan = plan_fragments([(n, p.numel()) for n, p in model.named_parameters()], cfg.outer.fragments)
    assert len(plan) == cfg.outer.fragments


def test_slowdown_takes_one_factor_per_learner_or_one_for_all():
    assert parse_slowdown("1,1,1,2", 4) == [1, 1, 1, 2]
    assert parse_slowdown("1.5", 3) == [1.5, 1.5, 1.5]
    for bad in ("1,2", "0.5", "fast"):
        with pytest.raises(SystemExit):
            parse_slowdown(bad, 4)


def test_ddp_bytes_follow_the_ring_all_reduce_formula():
    # 2·(N−1)/N · 4 B per parameter per step; tends to 8 B per parameter for large N.
    assert report.ddp_bytes_per_step(1000, 4) == pytest.approx(2 * 3 / 4 * 4 * 1000)
    assert report.ddp_bytes_per_step(1000, 2) == pytest.approx(4000)
    assert report.ring_allreduce_bytes(1000, 4, every=10) == pytest.approx(600)


def test_int4_wire_estimate_is_an_eighth_of_fp32_plus_scales():
    est = report.wire_bytes_estimate(params=6400, compression="int4", block_size=64, sync_every=16)
    assert est == pytest.approx((6400 * 0.5 + 100 * 4) / 16)
    with pytest.raises(ValueError):
        report.wire_bytes_estimate(10, "int2", 64, 1)


def test_prometheus_sum_reads_a_labelled_counter():
    text = ('# TYPE diloco_syncer_bytes_received counter\n'
            'diloco_syncer_bytes_received_total{endpoint="outer-gradient"} 1234.0\n'
            'diloco_syncer_bytes_received_total{endpoint="register"} 10.0\n')
    assert report.prometheus_sum(text, "diloco_syncer_bytes_received", endpoint="outer-gradient") == 1234.0
    assert report.prometheus_sum(text, "diloco_syncer_bytes_received") == 1244.0
    assert report.prometheus_sum(text, "nope") is None


def test_quick_error_exits_count_as_a_crash_loop_but_chaos_kills_do_not():
    from diloco_trainer.runtime.procs import Supervisor
    from diloco_trainer.runtime.session import RunSession

    def events(codes):
        out, t = [], 0.0
        for code in codes:
            out += [RunEvent(name="learner-0", role="learner", event="start", time=t),
                    RunEvent(name="learner-0", role="learner", event="exit", code=code, time=t + 2.0)]
            t += 5.0
        return out

    sup = Supervisor()
    sup.events = events([1, 1, 1])
    assert RunSession._crash_looping(sup, "learner-0")
    sup.events = events([-9, -9, -9])  # SIGKILLed three times by a chaos tool: keep going
    assert not RunSession._crash_looping(sup, "learner-0")
    sup.events = events([1, -9, 1])
    assert not RunSession._crash_looping(sup, "learner-0")


def test_progress_table_shows_each_learner_and_the_syncer():
    from rich.console import Console

    from diloco_trainer.runtime import progress

    running = MetricsRecord(time=1.0, learner_id="learner-0", loss=2.91, versions={"0": 13, "1": 15}, sent=38, acked=37,
                            bytes_up=683920, bytes_down=1204000, syncer_up=False)
    view = progress.View("diloco decoupled", 83.0, 240.0, [
        progress.LearnerView("learner-0", "running", 0, running, 120, 300, 1.0, 5120.0),
        progress.LearnerView("learner-3", "restarting", 1, None, 80, 300, 2.0, None)],
        syncer=SyncerStatus.model_validate({"outer_steps": 80, "merges": 80, "tokens_merged": 113152, "fragments": 4,
                                            "learners": {"learner-0": {"live": True}}, "pending": {"0": 1},
                                            "grace_s": 0.2}),
        goodput=0.46, tokens_trained=61440, messages=["learner-3 exited with code -9"])
    console = Console(width=120, record=True)
    console.print(progress.render(view))
    text = console.export_text()
    assert "120/300" in text and "v13..15" in text and "37" in text and "684k/1.20M" in text and "away" in text
    assert "learner-3 ×2" in text and "restarting ↻1" in text
    assert "outer steps 80" in text and "goodput 46.0%" in text and "exited with code -9" in text
    # The syncer's count sums the 4 fragments' merges: shown per fragment, beside the tokens trained.
    assert "tokens merged 28.3k per fragment of 61.4k trained" in text
    assert "syncer away" in progress.plain_line(progress.View("x", 1.0, None, []))


def test_the_final_report_gives_merged_tokens_a_reader_can_hold_against_tokens_trained():
    from diloco_trainer.runtime.report import summary_lines

    base = {"run_dir": "r", "mode": "decoupled", "learners": 2, "params": 1000, "wall_time_s": 60.0,
            "tokens_trained": 3_276_800, "steps_trained": 6400, "goodput": 0.9, "merged_fraction": 0.82}
    decoupled = "\n".join(summary_lines(base | {"tokens_merged": 10_813_440, "fragments": 4,
                                                 "tokens_merged_per_fragment": 2_703_360.0}))
    assert ("tokens merged 2,703,360 per fragment of 3,276,800 trained; 10,813,440 summed over the 4 fragments"
            in decoupled)
    ddp = "\n".join(summary_lines(base | {"mode": "ddp", "tokens_merged": 2_686_976}))
    assert "tokens merged 2,686,976 of 3,276,800 trained" in ddp


def test_a_crashed_learner_restarts_for_the_missing_steps_only_and_not_at_all_when_it_was_done(tmp_path):
    from diloco_trainer.config import TrainConfig
    from diloco_trainer.runtime.procs import Child
    from diloco_trainer.runtime.session import RunSession

    session = RunSession(tmp_path, TrainConfig(), mode="decoupled", learners=1, plain=True)
    state = tmp_path / "learner-0"
    state.mkdir()
    session.add_learner("learner-0", state, steps=80, slowdown=1.0)
    child = Child("learner-0", "learner", ["diloco", "learner", "--steps", "80"], {}, tmp_path / "l.log",
                  starts=[100.0])
    (state / "metrics.jsonl").write_text(json.dumps(_rec(110, 50, 5000, 0)) + "\n")
    assert session._before_restart(child, steps=80) and child.argv[-1] == "30"
    (state / "metrics.jsonl").write_text(json.dumps(_rec(120, 80, 8000, 0)) + "\n")  # crashed while exiting
    assert not session._before_restart(child, steps=80)
