"""The pod supervisor's decisions (runtime/podsup.py): which learner exits are restarted in place, and which learner
arguments it refuses before starting anything."""

import argparse
import signal

import pytest

from diloco_trainer.runtime.podsup import _learner_args, configure, restart_verdict


def test_a_killed_or_crashed_learner_is_restarted_until_the_limit_within_the_window():
    assert restart_verdict(-signal.SIGKILL, [], 100.0, 2, 60.0) == \
        (True, "killed by SIGKILL: restart 1 of at most 2 within 60 s")
    assert restart_verdict(1, [90.0], 100.0, 2, 60.0)[0]
    yes, why = restart_verdict(1, [50.0, 90.0], 100.0, 2, 60.0)
    assert not yes and why == "2 restarts within 60 s already (--max-restarts 2)"
    # Restarts older than the window no longer count: a learner killed now and then is restarted every time.
    assert restart_verdict(-signal.SIGKILL, [10.0, 30.0], 100.0, 2, 60.0)[0]


def test_a_clean_exit_a_usage_error_or_a_refusal_is_never_restarted():
    assert restart_verdict(0, [], 0.0, 5, 60.0) == (False, "finished")
    assert restart_verdict(2, [], 0.0, 5, 60.0)[1].startswith("exit code 2: a usage or configuration error")
    assert restart_verdict(3, [], 0.0, 5, 60.0)[1].startswith("exit code 3: the syncer refused")


def test_max_restarts_zero_leaves_every_crash_to_the_operator():
    assert not restart_verdict(-signal.SIGKILL, [], 0.0, 0, 60.0)[0]


def _parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(list(argv))


def test_the_learner_arguments_after_the_separator_are_checked_and_kept():
    argv, parsed = _learner_args(_parsed("--max-restarts", "3", "--", "--syncer", "http://s:1", "--learner-id", "u-0",
                         "--drain-s", "7"))
    assert argv == ["--syncer", "http://s:1", "--learner-id", "u-0", "--drain-s", "7"]
    assert (parsed.learner_id, parsed.drain_s) == ("u-0", 7.0)


@pytest.mark.parametrize("argv, message", [
    (("--", "--syncer", "http://s:1"), "--syncer and --learner-id are required"),
    (("--", "--syncer", "http://s:1", "--learner-id", "a", "--zygote", "/d"), "are the supervisor's own"),
    (("--max-restarts", "-1", "--", "--syncer", "x", "--learner-id", "a"), "--max-restarts must be >= 0"),
    (("--restart-window-s", "0", "--", "--syncer", "x", "--learner-id", "a"), "--restart-window-s must be > 0"),
    (("--spares", "-2", "--", "--syncer", "x", "--learner-id", "a"), "--spares must be >= 0"),
])
def test_bad_supervisor_or_learner_arguments_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        _learner_args(_parsed(*argv))
