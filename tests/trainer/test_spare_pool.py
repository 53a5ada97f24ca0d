"""Warm spares forked from one zygote (runtime/zygote.py, runtime/spares.py): real `diloco learner` processes.

The test process is the supervisor here, so it becomes a child subreaper for the rest of the session: orphaned
descendants of other tests would be re-parented to it (none are expected)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from diloco_trainer.runtime import procs
from diloco_trainer.runtime.procs import Supervisor
from diloco_trainer.runtime.spares import SparePool

from polling import alive, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def pool(tmp_path):
    env = procs.child_env({"DILOCO_TOKEN": "t"})
    sup = Supervisor()
    p = SparePool(tmp_path / "spares", 2, procs.diloco_argv("learner"), env, sup.spawn)
    assert p.fork, "forking spares needs Linux's child subreaper"
    p.refill()
    yield p, env
    p.close()


def _learner_argv(tmp_path: Path, name: str) -> list[str]:
    # No syncer listens on port 9: the learner waits for it (bootstrap retries) until told to stop.
    return procs.diloco_argv("learner", "--syncer", "http://127.0.0.1:9", "--learner-id", name,
                             "--state-dir", str(tmp_path / name))


def test_a_forked_spare_becomes_the_learner_it_is_given_and_its_exit_code_reaches_the_supervisor(pool, tmp_path):
    pool, env = pool
    wait_for(lambda: pool.ready() == 2, 120, "two forked spares", 0.05)
    zygote = int((pool.zygote_dir / "ready").read_text())
    spare_pid = int((pool.root / "spare-1" / "ready").read_text())
    assert Path(f"/proc/{spare_pid}/stat").read_text().split()[3] == str(os.getpid()), "re-parented to us"

    log = tmp_path / "learner-0.log"
    proc, tag = pool.take(_learner_argv(tmp_path, "learner-0"), env, log)
    assert proc.pid == spare_pid and tag == f"--zygote {pool.zygote_dir}"
    assert tag.encode() in Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ")
    wait_for(lambda: "waiting for the syncer" in (log.read_text() if log.exists() else ""), 120, "the learner to start", 0.05)
    assert "warm spare took over" in log.read_text()
    # The pool asked the zygote for a replacement at once; forking costs no warm-up.
    wait_for(lambda: pool.ready() == 2, 10, "the pool to be refilled", 0.05)

    os.killpg(proc.pid, signal.SIGTERM)  # its own process group, as every supervised child
    assert proc.wait(30) == 0  # stopped before the syncer answered: a clean exit, seen through waitpid
    spares = [int((d / "ready").read_text()) for d in pool.root.glob("spare-*") if (d / "ready").exists()]
    pool.close()
    assert not [p for p in [zygote, *spares] if alive(p)]


def test_a_dead_zygote_is_replaced_and_the_new_one_serves_the_requests_it_left(pool, tmp_path):
    pool, env = pool
    wait_for(lambda: pool.ready() == 2, 120, "two forked spares", 0.05)
    first = pool.zygote
    first.kill()
    first.wait(10)
    taken, _ = pool.take(_learner_argv(tmp_path, "learner-1"), env, tmp_path / "learner-1.log")
    taken.kill()
    assert taken.wait(10) == -signal.SIGKILL
    wait_for(lambda: pool.refill() or (pool.zygote is not first and pool.ready() == 2), 120,
          "a new zygote and a spare forked by it", 0.05)
    assert (pool.root / "spare-3" / "ready").exists()
