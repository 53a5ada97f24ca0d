"""The harsh resilience schedule (bench/diloco_bench/harsh.py) and the restart-state comparison's step conversion."""

import json

import pytest

from diloco_bench import harsh, report, restart_state, runs
from diloco_chaos.inject.experiment import parse_experiment


def test_the_harsh_schedule_is_a_valid_experiment_killing_each_learner_every_60_s_with_three_seeds(tmp_path):
    full = report.Context(mode="full", out_dir=tmp_path)
    assert len(harsh.seeds(full)) >= 3 and len(set(harsh.seeds(full))) == len(harsh.seeds(full))
    assert len(harsh.seeds(report.Context(mode="full", out_dir=tmp_path, seeds=5))) == 5
    exp = parse_experiment(harsh.experiment(101, 60.0))
    assert exp.schedule.kind == "mtbf" and exp.schedule.mtbf_s == 60.0 and exp.schedule.seed == 101
    # Every configuration under a seed gets that seed's schedule; its failure-free twin is a run of its own.
    chaos, twin = harsh.spec(full, 101), harsh.spec(full, 101, kills=False)
    assert chaos.key != twin.key != harsh.spec(full, 102, kills=False).key
    assert twin.kill_every_s is None and chaos.kill_every_s == 60.0 and chaos.learners == 3
    assert "--restart-delay" in chaos.extra and chaos.extra[chaos.extra.index("--restart-delay") + 1] == "2"


def test_the_seeds_together_give_the_median_kept_and_the_points_per_kill_pooled_over_every_kill():
    h = {"seeds": [{"keep_goodput": 1.006, "kills": 10, "goodput_drop_per_kill": 0.001},
                   {"keep_goodput": 0.934, "kills": 20, "goodput_drop_per_kill": 0.004},
                   {"keep_goodput": 1.069, "kills": 5, "goodput_drop_per_kill": -0.003}]}
    line = harsh.overall(h)
    # Median of 100.6, 93.4, 106.9; pooled: (10 × 0.1 + 20 × 0.4 − 5 × 0.3) points over 35 kills = 0.21.
    assert "kept 100.6% median (93.4–106.9%" in line
    assert "0.10 points lost per kill median" in line and "0.21 points lost pooled over 35 kills" in line
    assert harsh.points(-0.003) == "0.30 points gained" and harsh.points(None) == "-"


def test_steps_behind_finds_where_the_reference_had_the_same_loss():
    reference = [10.0 - 0.1 * i for i in range(60)]  # one loss unit per 10 steps
    assert restart_state.steps_behind(reference, reference) == pytest.approx(0.0, abs=1e-9)
    assert restart_state.steps_behind(reference, [x + 0.5 for x in reference]) == pytest.approx(5.0)
    assert restart_state.steps_behind(reference, [x - 0.5 for x in reference]) == 0.0


def test_rates_count_tokens_per_second_of_training_from_the_learners_first_step_to_their_last_report(tmp_path):
    # Two learners: l0 began its first step at t=100 (step 1 reported at 101 after a 1 s step), l1 reported last at 120.
    for name, lines in {"l0": [(101.0, 1), (110.0, 10)], "l1": [(105.0, 2), (120.0, 12)]}.items():
        (tmp_path / "learners" / name).mkdir(parents=True)
        (tmp_path / "learners" / name / "metrics.jsonl").write_text("".join(
            json.dumps({"time": t, "step": step, "step_time_s": 1.0}) + "\n" for t, step in lines))
    summary = {"run_dir": str(tmp_path), "wall_time_s": 40.0, "tokens_trained": 2000, "merged_fraction": 0.75}
    r = runs.rates(summary)
    assert r["training_s"] == 20.0 and r["tokens_per_s"] == 100.0 and r["useful_per_s"] == 75.0
