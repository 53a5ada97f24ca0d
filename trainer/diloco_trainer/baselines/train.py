"""`diloco baseline ddp|sync-diloco`: the two baselines Decoupled DiLoCo is measured against, same code path.

Same model, data shards, per-learner batch, inner AdamW, `--slowdown`, metrics.jsonl format, run directory
and final evaluation as `diloco local`; N worker processes talk over torch.distributed (gloo, loopback).
- ddp: gradients all-reduced (averaged) every step; one model.
- sync-diloco: H inner steps each, then all-reduce of Δ = Θ − θ (full model, fp32), the same `NesterovOuter`
  step everywhere, θ ← Θ; everyone waits for the slowest worker at every outer step.
With --max-restarts N a failed worker restarts the whole job from the last committed checkpoint (as torchrun does).
"""

from __future__ import annotations

import argparse
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from diloco_trainer.config import TrainConfig
from diloco_trainer.protocol.runfiles import EVENTS, RunEvent, append_event
from diloco_trainer.runtime import elastic, launch, procs
from diloco_trainer.runtime.procs import Child, StopFlag, Supervisor
from diloco_trainer.runtime.rundir import open_run, read_jsonl
from diloco_trainer.runtime.session import (DEFAULT_CONFIG, DEFAULT_MINUTES, DEFAULT_STEPS, RunSession, load_config,
                              parse_slowdown)

MODES = ("ddp", "sync-diloco")
DDP_CHECKPOINT_EVERY = 25  # steps; sync-diloco checkpoints every outer step by default


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mode", choices=MODES, help="ddp: all-reduce gradients every step; sync-diloco: "
                        "all-reduce Δ every H steps with a Nesterov outer step, everyone waits")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="run config YAML (same as diloco local)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    parser.add_argument("--learners", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"inner steps per worker (default {DEFAULT_STEPS})")
    parser.add_argument("--minutes", type=float, default=DEFAULT_MINUTES,
                        help=f"wall-clock budget from launch (default {DEFAULT_MINUTES:g})")
    parser.add_argument("--slowdown", default="1", help="per-worker slowdown factors, e.g. 1,1,1,2")
    parser.add_argument("--jitter", type=float, default=0.0,
                        help="random spread of the slowdown: factor F*(1+J*u), u uniform in [-1, 1] (as learners)")
    parser.add_argument("--run-dir", default=None, help="where to write the run (default runs/<timestamp>/)")
    parser.add_argument("--log-every", type=int, default=5, help="metrics line every N steps")
    parser.add_argument("--snapshots", type=int, default=3, help="model snapshots evaluated at the end")
    parser.add_argument("--eval-batches", type=int, default=32,
                        help="validation batches (of inner.batch_size windows) for each evaluation of the global model")
    parser.add_argument("--plain", action="store_true", help="plain progress lines instead of the live table")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart all workers from the last checkpoint after a failure, at most N times "
                             "(default 0: the run stops at the first failure)")
    parser.add_argument("--checkpoint-every", type=int, default=None, metavar="S",
                        help="inner steps between checkpoints when --max-restarts > 0 (default: the outer period H "
                             f"for sync-diloco, which S must be a multiple of; {DDP_CHECKPOINT_EVERY} for ddp)")
    parser.add_argument("--master-addr", default="127.0.0.1",
                        help="address of rank 0, where the workers meet (default loopback; the WAN benchmark gives "
                             "rank 0's network-namespace address and GLOO_SOCKET_IFNAME)")
    launch.add_arguments(parser)
    # Internal: how the supervisor starts each worker.
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--master-port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # unix time to stop
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)  # from the committed checkpoint


def run(args: argparse.Namespace) -> int:
    """A worker process trains (worker.py); the parent plans, starts N workers, supervises them (restarting the
    whole job from a checkpoint as --max-restarts allows), stops them and summarizes."""
    if args.rank is not None:
        from diloco_trainer.baselines.worker import work  # torch: only a worker process imports it

        return work(args)
    started = time.monotonic()  # --minutes counts from here, as in diloco local
    job = BaselineRun(args, plan_run(args), started)
    run_dir, stop = job.run_dir, StopFlag()
    with Supervisor(run_dir / "processes.json", run_dir / EVENTS, run_dir / "holds") as sup, stop.installed():
        job.start(sup)
        reason = job.supervise(sup, stop)
        train_end = job.stop(sup, reason)
    summary = job.session.finish(sup, train_end - started, stop_reason=reason)
    return 0 if summary.get("val_loss") is not None else 1


@dataclass
class Plan:
    """What the arguments ask for, checked before anything is written or started."""

    cfg: TrainConfig
    checkpoint_every: int
    slowdown: list[float]
    prefixes: dict[str, list[str]]  # --exec-prefix by worker name


def plan_run(args: argparse.Namespace) -> Plan:
    """The validated run; a bad argument exits with a message naming it."""
    cfg = load_config(args.config, args.set)
    if args.learners < 1 or args.steps < 1 or args.minutes <= 0 or args.max_restarts < 0:
        raise SystemExit("diloco baseline: --learners and --steps must be >= 1, --minutes > 0, --max-restarts >= 0")
    checkpoint_every = checkpoint_period(args.mode, args.checkpoint_every, cfg.outer.sync_every)
    slowdown = parse_slowdown(args.slowdown, args.learners)
    try:
        prefixes = launch.parse_exec_prefixes(args.exec_prefix, [f"learner-{r}" for r in range(args.learners)])
    except ValueError as exc:
        raise SystemExit(f"diloco baseline: {exc}") from None
    return Plan(cfg, checkpoint_every, slowdown, prefixes)


class BaselineRun:
    """One run: its directory, session and shared deadline, and the workers it starts under the caller's Supervisor."""

    def __init__(self, args: argparse.Namespace, plan: Plan, started: float):
        self.args, self.plan = args, plan
        self.run_dir, self.config_path = open_run(args.run_dir, plan.cfg, "diloco baseline")
        self.session = RunSession(self.run_dir, plan.cfg, mode=args.mode, learners=args.learners, plain=args.plain,
                                  eval_batches=args.eval_batches, snapshots=args.snapshots)
        self.session.prepare_data()
        self.deadline = time.time() + args.minutes * 60 - (time.monotonic() - started)  # the workers agree on it
        self.started = started
        self.env = procs.child_env()

    def worker_argv(self, rank: int, port: int, resume: bool) -> list[str]:
        args = self.args
        return self.plan.prefixes.get(f"learner-{rank}", []) + procs.diloco_argv(
            "baseline", args.mode, "--config", str(self.config_path), "--learners", str(args.learners),
            "--rank", str(rank), "--master-addr", args.master_addr, "--master-port", str(port),
            "--run-dir", str(self.run_dir),
            "--steps", str(args.steps), "--deadline", f"{self.deadline:.3f}",
            "--slowdown", f"{self.plan.slowdown[rank]:g}",
            "--jitter", f"{args.jitter:g}", "--log-every", str(args.log_every), "--snapshots", str(args.snapshots),
            # No restarts, no use for checkpoints: the plain baseline pays nothing for them.
            "--checkpoint-every", str(self.plan.checkpoint_every if args.max_restarts else 0),
            *(["--resume"] if resume else []))

    def start(self, sup: Supervisor) -> None:
        port = _free_port()
        for rank in range(self.args.learners):
            name = f"learner-{rank}"
            state_dir = self.run_dir / "learners" / name
            # The supervisor never restarts a worker alone: a synchronous job restarts as a whole (supervise).
            sup.add(Child(name, "learner", self.worker_argv(rank, port, resume=False), self.env,
                          self.run_dir / "logs" / f"{name}.log", restart=False,
                          meta={"state_dir": str(state_dir), "rank": rank}))
            self.session.add_learner(name, state_dir, self.args.steps, self.plan.slowdown[rank])
            sup.start(name)

    def supervise(self, sup: Supervisor, stop: StopFlag) -> str:
        """Until the run ends; after a worker failed, every worker again from the checkpoint, at most --max-restarts
        times. Returns why it ended."""
        args, restarts = self.args, 0
        while True:
            reason = self.session.supervise(sup, stop, self.started, budget_s=args.minutes * 60, steps=args.steps,
                                            fail_fast=True)
            failed = elastic.failed_worker(sup.children.values())
            if failed is None or stop or restarts >= args.max_restarts or time.time() >= self.deadline:
                break
            restarts += 1
            port = _free_port()  # the old rendezvous port may linger in TIME_WAIT
            _restart_job(self.session, sup, self.run_dir, failed, restarts, args.max_restarts,
                         [self.worker_argv(rank, port, resume=True) for rank in range(args.learners)])
        if failed is not None and args.max_restarts and restarts >= args.max_restarts:
            reason += f" (--max-restarts {args.max_restarts}: {restarts} used)"
        return reason

    def stop(self, sup: Supervisor, reason: str) -> float:
        """Stop every worker; returns when training ended."""
        self.session.message(f"stopping: {reason}")
        train_end = time.monotonic()
        sup.stop([c.name for c in sup.children.values()], timeout=60.0)
        sup.poll()
        self.session.close_display()
        return train_end


def checkpoint_period(mode: str, every: int | None, sync_every: int) -> int:
    """Steps between checkpoints: --checkpoint-every, else H (sync-diloco) or DDP_CHECKPOINT_EVERY; for sync-diloco
    only a multiple of H, so that a checkpoint falls right after an outer step (θ = Θ, nothing unsynced)."""
    if every is None:
        return sync_every if mode == "sync-diloco" else DDP_CHECKPOINT_EVERY
    if every < 1:
        raise SystemExit(f"diloco baseline: --checkpoint-every must be >= 1, got {every}")
    if mode == "sync-diloco" and every % sync_every:
        raise SystemExit(f"diloco baseline: --checkpoint-every {every} is not a multiple of the outer period "
                         f"H = {sync_every} (outer.sync_every); sync-diloco checkpoints right after an outer step")
    return every


def _restart_job(session: RunSession, sup: Supervisor, run_dir: Path, failed: Child, restart: int,
                 max_restarts: int, argv_by_rank: list[list[str]]) -> None:
    """Stop every worker, record what the failure cost, start them all again from the committed checkpoint."""
    from diloco_trainer import checkpoint  # imports torch, which a run that never restarts leaves to its workers

    code = failed.exits[-1]
    workers = [c for c in sup.children.values() if c.role == "learner"]
    sup.stop([c.name for c in workers if c.alive], timeout=elastic.STOP_TIMEOUT_S)  # blocked in a collective
    record = checkpoint.committed(run_dir)
    resume_step = record["step"] if record else None
    last = {c.name: elastic.last_step_since(read_jsonl(Path(c.meta["state_dir"]) / "metrics.jsonl"), c.starts[-1])
            for c in workers}
    lost = elastic.lost_steps(last, resume_step or 0)
    session.message(elastic.restart_message(failed.name, code, len(workers), resume_step, restart, max_restarts))
    append_event(run_dir / EVENTS, RunEvent(
        time=time.time(), name="job", role="job", event="job_restart", restart=restart, max_restarts=max_restarts,
        failed=failed.name, code=code, checkpoint_step=resume_step or 0, failed_step=last[failed.name],
        lost_steps=sum(lost.values()), lost_steps_by_worker=lost))
    for child in workers:
        child.argv, child.finished = argv_by_rank[child.meta["rank"]], False
        sup.start(child.name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
