"""The learner's stop flag: raised from a signal handler while the main thread waits on it, it never hangs.

The harness runs in a child process (a hang must not take pytest with it): a timer signal sets the flag while the
main thread spins on `wait`, round after round. `threading.Event` hangs in it within its first hundred rounds (the
handler waits for the lock its own thread holds), which the last test checks, so the harness can fail."""

import subprocess
import sys
import textwrap
import threading
import time

from learner_kit import child_env

from diloco_trainer.learner.stop_flag import StopFlag

ROUNDS = 2000
HARNESS = textwrap.dedent("""
    import signal, sys, threading
    from diloco_trainer.learner.stop_flag import StopFlag
    kind, rounds = sys.argv[1], int(sys.argv[2])
    for i in range(rounds):
        flag = StopFlag() if kind == "stop_flag" else threading.Event()
        signal.signal(signal.SIGALRM, lambda *_: flag.set())
        signal.setitimer(signal.ITIMER_REAL, 0.0005)
        while not flag.wait(0.001 * (i % 2)):  # spins through wait(0) and sleeps in wait(0.001), alternately
            pass
        if kind == "stop_flag":
            flag.close()
    print("rounds", rounds, flush=True)
""")


def run_harness(kind: str, rounds: int, timeout: float) -> subprocess.CompletedProcess | None:
    """The harness's result, or None when it hung past `timeout`."""
    try:
        return subprocess.run([sys.executable, "-c", HARNESS, kind, str(rounds)], env=child_env(),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def test_a_signal_handler_setting_the_flag_while_the_main_thread_waits_on_it_never_hangs():
    done = run_harness("stop_flag", ROUNDS, timeout=60)
    assert done is not None, f"the stop flag hung within {ROUNDS} signal rounds"
    assert done.returncode == 0 and f"rounds {ROUNDS}" in done.stdout, done.stderr


def test_wait_returns_at_its_timeout_unset_and_at_once_when_set_from_another_thread():
    flag = StopFlag()
    try:
        t0 = time.monotonic()
        assert flag.wait(0.2) is False and 0.15 <= time.monotonic() - t0 < 5
        assert flag.wait(0) is False and not flag.is_set()
        threading.Timer(0.1, flag.set, args=("SIGTERM",)).start()
        t0 = time.monotonic()
        assert flag.wait(30) is True and time.monotonic() - t0 < 5, "a set from another thread must wake the waiter"
        assert flag.is_set() and flag.reason == "SIGTERM"
        flag.set("SIGINT")
        assert flag.reason == "SIGTERM", "the first reason is the one that stopped the learner"
        assert all(flag.wait(None) for _ in range(3)), "once set, every wait returns at once"
    finally:
        flag.close()
    flag.set()  # a handler still installed after close: no write to a descriptor that may be another file's now
    assert flag.is_set()


def test_the_harness_catches_a_flag_that_takes_a_lock_threading_event_hangs_in_it():
    assert run_harness("threading_event", ROUNDS, timeout=15) is None, \
        "threading.Event survived the harness: it no longer shows the hang the stop flag exists for"
