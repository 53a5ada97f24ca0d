"""Whole-job restarts of a synchronous run (what torchrun --max-restarts gives DDP): who failed, what was lost.

Pure decisions over the supervisor's children and the workers' metrics; `baselines/train.py` does the stopping and
starting.
"""

from __future__ import annotations

from collections.abc import Iterable

from diloco_trainer.runtime.procs import Child

PEER_LOST_EXIT = 75  # a worker's exit code when its collective failed because another worker died
STOP_TIMEOUT_S = 5.0  # survivors blocked in a collective ignore SIGTERM: SIGKILL after this long


def failed_now(child: Child) -> bool:
    """The child's current incarnation ended in an error (a stop we asked for included)."""
    return not child.alive and bool(child.exits) and len(child.exits) == len(child.starts) and child.exits[-1] != 0


def failed_worker(children: Iterable[Child]) -> Child | None:
    """The worker whose failure ended this incarnation: one that did not merely lose a peer, if there is one."""
    failed = [c for c in children if c.role == "learner" and failed_now(c) and not c.stop_requested]
    culprits = [c for c in failed if c.exits[-1] != PEER_LOST_EXIT]
    return (culprits or failed or [None])[0]


def last_step_since(records: list[dict], started: float) -> int | None:
    """The step of a worker's last metrics line written by the incarnation started at `started` (None: none)."""
    steps = [int(r.get("step", 0)) for r in records if float(r.get("time", 0.0)) >= started]
    return steps[-1] if steps else None


def lost_steps(last_steps: dict[str, int | None], checkpoint_step: int) -> dict[str, int]:
    """Per worker, the steps trained past the checkpoint the job restarts from (as far as its metrics tell):
    trained once, and trained again after the restart."""
    return {name: max(0, step - checkpoint_step) if step is not None else 0 for name, step in last_steps.items()}


def restart_message(failed: str, code: int, workers: int, checkpoint_step: int | None, restart: int,
                    max_restarts: int) -> str:
    where = (f"the checkpoint at step {checkpoint_step}" if checkpoint_step is not None
             else "scratch (no checkpoint committed yet)")
    return (f"worker {failed} failed (exit {code}): restarting all {workers} workers from {where} "
            f"(restart {restart} of {max_restarts})")
