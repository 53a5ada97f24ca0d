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
import hashlib
import json
import os
import random
import signal
import socket
import time
from pathlib import Path

from diloco_trainer import checkpoint
from diloco_trainer.fsutil import atomic_write
from diloco_trainer.protocol.runfiles import EVENTS, FINAL_STATE, BaselineFinalState, RunEvent, append_event
from diloco_trainer.runtime import elastic, launch, procs
from diloco_trainer.runtime.procs import Child, StopFlag, Supervisor
from diloco_trainer.runtime.rundir import append_jsonl, make_run_dir, read_jsonl, write_config, write_json
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
    if args.rank is not None:
        return _worker(args)
    started = time.monotonic()  # --minutes counts from here, as in diloco local
    cfg = load_config(args.config, args.set)
    if args.learners < 1 or args.steps < 1 or args.minutes <= 0 or args.max_restarts < 0:
        raise SystemExit("diloco baseline: --learners and --steps must be >= 1, --minutes > 0, --max-restarts >= 0")
    checkpoint_every = checkpoint_period(args.mode, args.checkpoint_every, cfg.outer.sync_every)
    slowdown = parse_slowdown(args.slowdown, args.learners)
    try:
        prefixes = launch.parse_exec_prefixes(args.exec_prefix, [f"learner-{r}" for r in range(args.learners)])
    except ValueError as exc:
        raise SystemExit(f"diloco baseline: {exc}") from None
    try:
        run_dir = make_run_dir(args.run_dir)
    except ValueError as exc:
        raise SystemExit(f"diloco baseline: {exc}") from None
    config_path = write_config(run_dir, cfg)
    session = RunSession(run_dir, cfg, mode=args.mode, learners=args.learners, plain=args.plain,
                         eval_batches=args.eval_batches, snapshots=args.snapshots)
    session.prepare_data()
    deadline = time.time() + args.minutes * 60 - (time.monotonic() - started)  # the workers agree on it

    def worker_argv(rank: int, port: int, resume: bool) -> list[str]:
        return prefixes.get(f"learner-{rank}", []) + procs.diloco_argv(
            "baseline", args.mode, "--config", str(config_path), "--learners", str(args.learners),
            "--rank", str(rank), "--master-addr", args.master_addr, "--master-port", str(port),
            "--run-dir", str(run_dir),
            "--steps", str(args.steps), "--deadline", f"{deadline:.3f}", "--slowdown", f"{slowdown[rank]:g}",
            "--jitter", f"{args.jitter:g}", "--log-every", str(args.log_every), "--snapshots", str(args.snapshots),
            # No restarts, no use for checkpoints: the plain baseline pays nothing for them.
            "--checkpoint-every", str(checkpoint_every if args.max_restarts else 0), *(["--resume"] if resume else []))

    stop = StopFlag()
    env = procs.child_env()
    with Supervisor(run_dir / "processes.json", run_dir / EVENTS, run_dir / "holds") as sup, stop.installed():
        port = _free_port()
        for rank in range(args.learners):
            name = f"learner-{rank}"
            state_dir = run_dir / "learners" / name
            # The supervisor never restarts a worker alone: a synchronous job restarts as a whole (below).
            sup.add(Child(name, "learner", worker_argv(rank, port, resume=False), env,
                          run_dir / "logs" / f"{name}.log", restart=False,
                          meta={"state_dir": str(state_dir), "rank": rank}))
            session.add_learner(name, state_dir, args.steps, slowdown[rank])
            sup.start(name)
        restarts = 0
        while True:
            reason = session.supervise(sup, stop, started, budget_s=args.minutes * 60, steps=args.steps,
                                       fail_fast=True)
            failed = elastic.failed_worker(sup.children.values())
            if failed is None or stop or restarts >= args.max_restarts or time.time() >= deadline:
                break
            restarts += 1
            port = _free_port()  # the old rendezvous port may linger in TIME_WAIT
            _restart_job(session, sup, run_dir, failed, restarts, args.max_restarts,
                         [worker_argv(rank, port, resume=True) for rank in range(args.learners)])
        if failed is not None and args.max_restarts and restarts >= args.max_restarts:
            reason += f" (--max-restarts {args.max_restarts}: {restarts} used)"
        session.message(f"stopping: {reason}")
        train_end = time.monotonic()
        sup.stop([c.name for c in sup.children.values()], timeout=60.0)
        sup.poll()
        session.close_display()
    summary = session.finish(sup, train_end - started, stop_reason=reason)
    return 0 if summary.get("val_loss") is not None else 1


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


# ---------------------------------------------------------------------- worker


COUNTERS = ("step", "syncs", "bytes_up", "synced_steps", "snapshots")  # what a checkpoint carries besides tensors


class PeerLost(Exception):
    """A collective failed because another worker is gone; the parent restarts the job or stops it."""


def _collective(fn, *args) -> None:
    try:
        fn(*args)
    except RuntimeError as exc:  # gloo: "Connection closed by peer" and the like
        raise PeerLost(str(exc).splitlines()[0]) from exc


def _worker(args: argparse.Namespace) -> int:
    """One rank: train, synchronize as the mode says, checkpoint, log metrics.jsonl; rank 0 writes snapshots and Θ."""
    import torch
    import torch.distributed as dist

    from diloco_trainer.config import TrainConfig
    from diloco_trainer.data.source import config_vocab, open_tokens
    from diloco_trainer.model.optimizer import inner_optimizer, set_lr
    from diloco_trainer.protocol.messages import MetricsRecord
    from diloco_trainer.learner.loop import step_sleep
    from diloco_trainer.syncer.merge import NesterovOuter
    from diloco_trainer.model.build import build_model, count_parameters
    from diloco_trainer.runtime.report import ring_allreduce_bytes

    torch.set_num_threads(1)
    cfg = TrainConfig.from_yaml(args.config)
    rank, world, run_dir = args.rank, args.learners, Path(args.run_dir)
    name = f"learner-{rank}"
    state_dir = run_dir / "learners" / name
    state_dir.mkdir(parents=True, exist_ok=True)
    stopping = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stopping.update(flag=True))
    signal.signal(signal.SIGINT, lambda *_: stopping.update(flag=True))

    dist.init_process_group("gloo", init_method=f"tcp://{args.master_addr}:{args.master_port}", rank=rank,
                            world_size=world)
    tokens = open_tokens(cfg.data, config_vocab(cfg.model))
    sampler = tokens.sampler(rank, world, cfg.inner.batch_size, cfg.model.seq_len, cfg.seed)
    model = build_model(cfg.model, cfg.seed)
    params = [p for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    n_params = count_parameters(model)
    opt, schedule = inner_optimizer(model, cfg)
    sync_every = cfg.outer.sync_every if args.mode == "sync-diloco" else 1
    outer = NesterovOuter(cfg.outer.lr, cfg.outer.momentum) if args.mode == "sync-diloco" else None
    theta = {n: p.detach().clone() for n, p in model.named_parameters()} if outer else None
    per_sync_bytes = ring_allreduce_bytes(n_params, world)  # fp32 ring all-reduce of the full vector
    rng = random.Random(rank)
    tokens_per_step = cfg.inner.batch_size * cfg.model.seq_len
    deadline = args.deadline if args.deadline is not None else time.time() + args.minutes * 60
    t0 = time.time()
    step = syncs = bytes_up = synced_steps = snaps = 0  # snaps: the next snapshot's index (0 is Θ₀)
    committed = checkpoint.committed(run_dir) if args.resume else None
    if committed is not None:
        tensors, saved = checkpoint.load(state_dir, committed["step"])
        if (saved["mode"], saved["world"], saved["rank"]) != (args.mode, world, rank):
            raise SystemExit(f"{name}: checkpoint of step {committed['step']} is for {saved['mode']} rank "
                             f"{saved['rank']} of {saved['world']}, not {args.mode} rank {rank} of {world}")
        _restore_tensors(tensors, model, opt, theta, outer)
        sampler.load_state_dict(saved["sampler"])
        checkpoint.rng_from_json(rng, saved["rng"])
        step, syncs, bytes_up, synced_steps, snaps = (int(saved["counters"][k]) for k in COUNTERS)
        print(f"{name}: resumed from the checkpoint of step {step}", flush=True)
    # metrics.jsonl counts this incarnation's work (tokens, syncs, bytes) from here; `step` is the position.
    start_step, start_syncs, start_bytes = step, syncs, bytes_up
    if rank == 0:
        _keep_snapshots(run_dir, snaps)  # ones a rolled-back incarnation took after the checkpoint are re-taken
        if snaps == 0:
            _save_snapshot(run_dir, 0, model, 0)
            snaps = 1
    metrics = open(state_dir / "metrics.jsonl", "a")
    win_loss, win_steps, win_busy, win_start = 0.0, 0, 0.0, time.time()  # one log window, as the learner logs
    try:
        while step < args.steps:
            t_step = time.time()
            x, y = sampler.next_batch()
            set_lr(opt, schedule(step + 1))
            _, loss = model(x, y)
            loss.backward()
            step += 1
            win_loss, win_steps = win_loss + loss.item(), win_steps + 1
            time.sleep(step_sleep(time.time() - t_step, float(args.slowdown), args.jitter, rng))
            last = step >= args.steps
            want_stop = stopping["flag"] or time.time() >= deadline
            if outer is None:  # DDP: average gradients (the stop flag rides along) and step everyone together
                flat = torch.cat([p.grad.reshape(-1) for p in params] + [torch.tensor([float(want_stop)])])
                _collective(dist.all_reduce, flat)
                stop_all = flat[-1].item() > 0
                offset = 0
                for p in params:
                    p.grad.copy_(flat[offset: offset + p.numel()].view_as(p).div_(world))
                    offset += p.numel()
                torch.nn.utils.clip_grad_norm_(params, cfg.inner.grad_clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
                syncs, bytes_up, synced_steps = syncs + 1, bytes_up + per_sync_bytes, step
            else:
                torch.nn.utils.clip_grad_norm_(params, cfg.inner.grad_clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
                stop_all = False
                # A worker told to stop syncs at once instead of at the next H boundary: its all-reduce meets the
                # others' next one (collectives pair by call order), and the flag it carries stops them all there.
                if step % sync_every == 0 or last or want_stop:
                    # Outer step: Δ = Θ − θ averaged over all workers (everyone waits here), Nesterov, θ ← Θ.
                    flat = torch.cat([(theta[n] - p.detach()).reshape(-1) for n, p in zip(names, params)]
                                     + [torch.tensor([float(want_stop)])])
                    _collective(dist.all_reduce, flat)
                    stop_all = flat[-1].item() > 0
                    flat.div_(world)
                    delta, offset = {}, 0
                    for n, p in zip(names, params):
                        delta[n] = flat[offset: offset + p.numel()].view_as(p)
                        offset += p.numel()
                    outer.step(theta, delta)
                    with torch.no_grad():
                        for n, p in zip(names, params):
                            p.copy_(theta[n])
                    syncs, bytes_up, synced_steps = syncs + 1, bytes_up + per_sync_bytes, step
            win_busy += time.time() - t_step
            done = last or stop_all
            # A checkpoint step (a multiple of H for sync-diloco: right after the outer step) is always logged, so
            # every worker's metrics reach the committed step and the work a restart loses can be counted.
            save_now = bool(args.checkpoint_every) and step % args.checkpoint_every == 0 and not done
            if step % args.log_every == 0 or done or save_now:
                now = time.time()
                synced_here = synced_steps - start_step
                rec = MetricsRecord(
                    time=now, learner_id=name, step=step, resumed_from_step=start_step,
                    loss=win_loss / win_steps, tokens=(step - start_step) * tokens_per_step,
                    tokens_per_s=win_steps * tokens_per_step / max(now - win_start, 1e-9),
                    step_time_s=win_busy / win_steps, versions={"all": syncs}, sent=syncs - start_syncs,
                    acked=syncs - start_syncs, acked_tokens=synced_here * tokens_per_step, acked_steps=synced_here,
                    adoptions=syncs - start_syncs, syncer_up=True, bytes_up=bytes_up - start_bytes,
                    bytes_down=bytes_up - start_bytes, lr=opt.param_groups[0]["lr"],
                    param_sha256=_param_digest(model if outer is None else theta) if done else None)
                metrics.write(rec.model_dump_json(exclude_none=True) + "\n")
                metrics.flush()
                win_loss, win_steps, win_busy, win_start = 0.0, 0, 0.0, now
            progress = max(step / args.steps, (time.time() - t0) / max(1e-9, deadline - t0))
            if rank == 0 and not done and snaps <= args.snapshots and progress >= snaps / (args.snapshots + 1):
                _save_snapshot(run_dir, snaps, model if outer is None else theta, step * tokens_per_step * world)
                snaps += 1
            if save_now:
                counters = dict(zip(COUNTERS, (step, syncs, bytes_up, synced_steps, snaps)))
                state = {"mode": args.mode, "world": world, "rank": rank, "counters": counters,
                         "sampler": sampler.state_dict(), "rng": checkpoint.rng_to_json(rng)}
                _save_checkpoint(run_dir, state_dir, step, rank, _checkpoint_tensors(model, opt, theta, outer), state)
            if done:
                break
        if rank == 0:
            from safetensors.torch import save_file

            final = theta if outer is not None else {n: p.detach() for n, p in model.named_parameters()}
            save_file({n: t.contiguous() for n, t in final.items()}, str(run_dir / "final" / "theta.safetensors"))
            end = BaselineFinalState(mode=args.mode, steps=step, outer_steps=syncs, learners=world,
                                     wall_s=time.time() - t0)
            write_json(run_dir / FINAL_STATE, end.model_dump(mode="json"))
        metrics.close()
        _collective(dist.barrier)
    except PeerLost as exc:
        print(f"{name}: a collective failed at step {step} ({exc}): another worker is gone", flush=True)
        metrics.close()
        os._exit(elastic.PEER_LOST_EXIT)  # a normal exit hangs in gloo's teardown after a peer died
    dist.destroy_process_group()
    return 0


def _save_checkpoint(run_dir: Path, state_dir: Path, step: int, rank: int, tensors: dict, state: dict) -> None:
    """Write this rank's checkpoint; rank 0 commits it once every rank has, then each drops its older one."""
    import torch.distributed as dist

    checkpoint.save(state_dir, step, tensors, state)
    _collective(dist.barrier)  # every rank holds step S on disk ...
    if rank == 0:
        checkpoint.commit(run_dir, step, mode=state["mode"], world=state["world"])
    _collective(dist.barrier)  # ... and S is committed: the previous step's files can go
    checkpoint.prune(state_dir, keep=step)


def _checkpoint_tensors(model, opt, theta, outer) -> dict:
    """Everything a rank resumes from that is a tensor: θ, AdamW moments and steps, Θ and the outer momentum."""
    import torch

    out = {f"model.{n}": p for n, p in model.named_parameters()}
    out.update(checkpoint.optimizer_tensors(opt))
    if theta is not None:
        out.update({f"theta.{n}": t for n, t in theta.items()})
        out.update({f"outer_momentum.{n}": t for n, t in outer.state_dict().items()})
    out["torch_rng"] = torch.get_rng_state()
    return out


def _restore_tensors(tensors: dict, model, opt, theta, outer) -> None:
    import torch

    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(tensors[f"model.{n}"])
        for n, t in (theta or {}).items():
            t.copy_(tensors[f"theta.{n}"])
    checkpoint.load_optimizer_tensors(opt, tensors)
    if outer is not None:
        prefix = "outer_momentum."
        outer.load_state_dict({k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)})
    torch.set_rng_state(tensors["torch_rng"])


def _param_digest(params) -> str:
    """SHA-256 over the parameters' bytes: equal digests mean bit-identical replicas."""
    items = params.items() if isinstance(params, dict) else params.named_parameters()
    h = hashlib.sha256()
    for n, t in sorted(items, key=lambda kv: kv[0]):
        h.update(n.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _keep_snapshots(run_dir: Path, n: int) -> None:
    """Keep the first `n` snapshots of the index (the checkpoint's); later ones belong to a rolled-back run."""
    index = run_dir / "snapshots" / "index.jsonl"
    entries = read_jsonl(index)
    if len(entries) <= n:
        return
    for entry in entries[n:]:
        (run_dir / "snapshots" / entry["file"]).unlink(missing_ok=True)
    atomic_write(index, "".join(json.dumps(e) + "\n" for e in entries[:n]).encode())


def _save_snapshot(run_dir: Path, k: int, params, tokens: int) -> None:
    from safetensors.torch import save_file

    items = params.items() if isinstance(params, dict) else params.named_parameters()
    name = f"snapshot-{k:02d}.safetensors"
    save_file({n: t.detach().contiguous().clone() for n, t in items}, str(run_dir / "snapshots" / name))
    append_jsonl(run_dir / "snapshots" / "index.jsonl", {"file": name, "time": time.time(), "tokens": tokens})
