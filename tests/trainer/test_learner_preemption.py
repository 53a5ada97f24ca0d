"""Preemption: a learner sent SIGTERM mid-window (a pod deleted with a grace period: spot reclaim, drain) hands over
every step it trained before it exits 0 (a real `diloco syncer` and a real learner on loopback, tiny model, CPU)."""

import signal
import time

import pytest

from learner_kit import SyncerProcess, finish, metrics, start_learner, write_config
from polling import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

FRAGMENTS = 4  # write_config's P
DRAIN_S = 10.0


@pytest.mark.parametrize("adopt", ["keep", "overwrite"])
def test_a_learner_sent_sigterm_mid_window_gets_every_trained_step_merged_and_exits_0_within_its_drain(
        tmp_path, adopt):
    syncer = SyncerProcess(write_config(tmp_path / "run.yaml", adopt=adopt), tmp_path / "syncer",
                           tmp_path / "syncer.log")
    state, log = tmp_path / "l0", tmp_path / "l0.log"
    try:
        syncer.start()
        learner = start_learner(syncer.url, "l0", state, 1_000_000, "--drain-s", str(DRAIN_S), log_path=log)
        try:
            # Past the first sends of every fragment (H=8, staggered: one fragment falls due every 2 steps), so
            # whenever the signal lands some fragments have steps unsent, some a Δ in flight or just acknowledged.
            # The syncer must have booked some of it too: on a fast machine 23 steps can pass before its first answer.
            def reported_step() -> int:
                return int(((syncer.status().get("learners") or {}).get("l0") or {}).get("step") or 0)
            wait_for(lambda: metrics(state) and metrics(state)[-1]["step"] >= 23 and reported_step() > 0, 180,
                     "23 steps trained and some booked by the syncer")
            reported = reported_step()
            signalled = time.monotonic()
            learner.send_signal(signal.SIGTERM)
            finish(learner, log, timeout=60)
            exit_s = time.monotonic() - signalled
        finally:
            if learner.poll() is None:
                learner.kill()
        final = metrics(state)[-1]
        assert final["final"] and final["step"] >= reported > 0
        # Bounded by the drain and one step (a tiny model's steps take milliseconds).
        assert exit_s < DRAIN_S + 5, f"{exit_s:.2f} s from SIGTERM to exit"
        print(f"\nadopt={adopt}: SIGTERM to exit {exit_s:.2f} s, {final['step']} steps, "
              f"{final['steps_discarded']} fragment-steps discarded by adoptions")

        wait_for(lambda: not any(syncer.status()["pending"].values()), 30, "the syncer to merge everything pending")
        mine = syncer.status()["learners"]["l0"]
        # Every fragment of every step trained up to the signal (and the step finishing when it came) is merged,
        # but for what adoptions discard by design while training (adopt=overwrite; none with keep).
        if adopt == "keep":
            assert final["steps_discarded"] == 0
        expected_steps = FRAGMENTS * final["step"] - final["steps_discarded"]
        assert mine["steps_merged"] == expected_steps, (mine, final)
        tokens_per_step = final["tokens"] // final["step"]
        assert mine["tokens_merged"] == expected_steps * tokens_per_step, (mine, final)
        # The syncer's ledger of this learner life (what the operator's work lost per fault reads) says the same:
        # its last heartbeat, sent as it left, has its final figures, so it shows no work lost.
        (life,) = mine["incarnations"]
        assert (life["steps"], life["tokens"], life["steps_discarded"]) == \
            (final["step"], final["tokens"], final["steps_discarded"])
        assert life["steps_merged"] == mine["steps_merged"] == FRAGMENTS * life["steps"] - life["steps_discarded"]
        text = log.read_text()
        assert "received SIGTERM" in text and "handed over in" in text, text[-3000:]
    finally:
        syncer.stop()
