"""Real processes on loopback: `diloco local` (tiny model, 3 learners) and its ledger of every trained step, in a
failure-free run and in a run whose learner is SIGKILLed: the buckets sum exactly to the fragment-steps trained."""

from __future__ import annotations

import json
import os
import signal

import pytest

from diloco_trainer.runtime.ledger import BUCKETS
from test_resilience_local import LEARNERS, LocalRun, _replaced, local_run  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]
P = 4  # configs/tiny.yaml's outer.fragments


def _lives(run: LocalRun, name: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in (run.dir / "learners" / name / "ledger").glob("*.json")]


def _check_exact(ledger: dict) -> None:
    assert ledger["unaccounted"] == 0, ledger
    assert ledger["trained"] == sum(ledger[k] for k in BUCKETS), ledger
    assert min(ledger[k] for k in BUCKETS) >= 0, ledger
    for name, per in ledger["per_learner"].items():
        assert per["unaccounted"] == 0 and per["trained"] == sum(per[k] for k in BUCKETS), (name, per)


def test_a_failure_free_runs_ledger_sums_exactly_to_the_steps_trained(local_run):
    run = local_run("--steps", "40", "--minutes", "3")
    assert run.proc.wait(timeout=200) == 0, run.log_tail()
    s = run.summary()
    ledger = s["ledger"]
    _check_exact(ledger)
    assert ledger["trained"] == P * s["steps_trained"] == P * 40 * len(LEARNERS)
    assert ledger["lost"] == 0 and ledger["merged"] > 0
    assert ledger["merged"] == sum(m["steps_merged"] for m in s["merged"].values())
    for name in LEARNERS:
        (only,) = _lives(run, name)
        assert only["final"] and only["steps"] == 40
    assert "ledger (fragment-steps): trained" in run.log_tail()


def test_a_run_with_a_killed_learner_books_its_work_and_the_buckets_still_sum_exactly(local_run):
    run = local_run("--steps", "60", "--minutes", "4", "--restart-delay", "0.5")
    victim = "learner-1"
    run.wait(lambda: run.step(victim) >= 12, "the victim to train")
    killed_pid = run.processes()[victim]["pid"]
    os.kill(killed_pid, signal.SIGKILL)
    run.wait(lambda: _replaced(run, victim, killed_pid), "the supervisor to restart it")
    assert run.proc.wait(timeout=300) == 0, run.log_tail()
    s = run.summary()
    ledger = s["ledger"]
    _check_exact(ledger)
    lives = _lives(run, victim)
    assert len(lives) == 2 and sorted(lv["final"] for lv in lives) == [False, True], lives
    per = ledger["per_learner"][victim]
    assert per["trained"] == P * sum(lv["steps"] for lv in lives)
    # The killed life's books stop at its last step: what it trained and is neither merged, discarded nor refused
    # is lost (its resent unsent work, when merged, is merged).
    killed = next(lv for lv in lives if not lv["final"])
    assert per["lost"] <= P * killed["steps"]
    for name in set(LEARNERS) - {victim}:
        assert ledger["per_learner"][name]["lost"] == 0
