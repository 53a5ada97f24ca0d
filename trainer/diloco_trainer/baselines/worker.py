"""One rank of `diloco baseline`: the training loop both baselines share (data, model, resume, metrics, snapshots,
checkpoints) and what each adds after the backward pass: `DdpSync` (all-reduce gradients every step) or
`SyncDiLoCo` (all-reduce Δ = Θ − θ every H steps, one Nesterov outer step everywhere)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from diloco_trainer import checkpoint
from diloco_trainer.config import TrainConfig
from diloco_trainer.data.source import config_vocab, open_tokens
from diloco_trainer.fsutil import atomic_write
from diloco_trainer.learner.loop import step_sleep
from diloco_trainer.model.build import build_model, count_parameters
from diloco_trainer.model.optimizer import inner_optimizer, set_lr
from diloco_trainer.protocol.messages import MetricsRecord
from diloco_trainer.protocol.runfiles import FINAL_STATE, BaselineFinalState
from diloco_trainer.runtime import elastic
from diloco_trainer.runtime.report import ring_allreduce_bytes
from diloco_trainer.runtime.rundir import append_jsonl, read_jsonl, write_json
from diloco_trainer.syncer.merge import NesterovOuter

COUNTERS = ("step", "syncs", "bytes_up", "synced_steps", "snapshots")  # what a checkpoint carries besides tensors


class PeerLost(Exception):
    """A collective failed because another worker is gone; the parent restarts the job or stops it."""


def _collective(fn, *args) -> None:
    try:
        fn(*args)
    except RuntimeError as exc:  # gloo: "Connection closed by peer" and the like
        raise PeerLost(str(exc).splitlines()[0]) from exc


def work(args: argparse.Namespace) -> int:
    """One rank: train, synchronize as the mode says, checkpoint, log metrics.jsonl; rank 0 writes snapshots and Θ."""
    torch.set_num_threads(1)
    worker = Worker(args)
    try:
        worker.run()
    except PeerLost as exc:
        print(f"{worker.name}: a collective failed at step {worker.step} ({exc}): another worker is gone", flush=True)
        worker.metrics.close()
        os._exit(elastic.PEER_LOST_EXIT)  # a normal exit hangs in gloo's teardown after a peer died
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------- what each baseline adds


class DdpSync:
    """DDP: gradients averaged over all workers every step (the stop flag rides along), then one AdamW step."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: TrainConfig, world: int):
        self.model, self.opt, self.grad_clip, self.world = model, opt, cfg.inner.grad_clip, world
        self.params = list(model.parameters())

    def step(self, step: int, last: bool, want_stop: bool) -> tuple[bool, bool]:
        """(synced, stop_all): DDP synchronizes at every step."""
        flat = torch.cat([p.grad.reshape(-1) for p in self.params] + [torch.tensor([float(want_stop)])])
        _collective(dist.all_reduce, flat)
        stop_all = flat[-1].item() > 0
        offset = 0
        for p in self.params:
            p.grad.copy_(flat[offset: offset + p.numel()].view_as(p).div_(self.world))
            offset += p.numel()
        torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return True, stop_all

    def global_params(self) -> dict[str, torch.Tensor]:
        """The model every replica holds (they are identical)."""
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        pass


class SyncDiLoCo:
    """Synchronous DiLoCo: an AdamW step each, and every H steps Δ = Θ − θ averaged over all workers (everyone
    waits there), the same Nesterov outer step everywhere, θ ← Θ."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: TrainConfig, world: int):
        self.model, self.opt, self.grad_clip, self.world = model, opt, cfg.inner.grad_clip, world
        self.params = list(model.parameters())
        self.names = [n for n, _ in model.named_parameters()]
        self.sync_every = cfg.outer.sync_every
        self.outer = NesterovOuter(cfg.outer.lr, cfg.outer.momentum)
        self.theta = {n: p.detach().clone() for n, p in model.named_parameters()}

    def step(self, step: int, last: bool, want_stop: bool) -> tuple[bool, bool]:
        """(synced, stop_all): an outer step at every H, at the last step, and when this worker was told to stop."""
        torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        # A worker told to stop syncs at once instead of at the next H boundary: its all-reduce meets the
        # others' next one (collectives pair by call order), and the flag it carries stops them all there.
        if not (step % self.sync_every == 0 or last or want_stop):
            return False, False
        flat = torch.cat([(self.theta[n] - p.detach()).reshape(-1) for n, p in zip(self.names, self.params)]
                         + [torch.tensor([float(want_stop)])])
        _collective(dist.all_reduce, flat)
        stop_all = flat[-1].item() > 0
        flat.div_(self.world)
        delta, offset = {}, 0
        for n, p in zip(self.names, self.params):
            delta[n] = flat[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
        self.outer.step(self.theta, delta)
        with torch.no_grad():
            for n, p in zip(self.names, self.params):
                p.copy_(self.theta[n])
        return True, stop_all

    def global_params(self) -> dict[str, torch.Tensor]:
        """Θ, the model of the last outer step."""
        return self.theta

    def tensors(self) -> dict[str, torch.Tensor]:
        """Θ and the outer momentum, for a checkpoint."""
        out = {f"theta.{n}": t for n, t in self.theta.items()}
        out.update({f"outer_momentum.{n}": t for n, t in self.outer.state_dict().items()})
        return out

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, t in self.theta.items():
                t.copy_(tensors[f"theta.{n}"])
        prefix = "outer_momentum."
        self.outer.load_state_dict({k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)})


# ---------------------------------------------------------------------- the shared worker


@dataclass
class Window:
    """Figures accumulated between two metrics lines, as the learner logs them."""

    started: float = field(default_factory=time.time)
    steps: int = 0
    loss: float = 0.0
    busy_s: float = 0.0


class Worker:
    """One rank's process group, data, model, counters and files; `sync` (the mode's) does the synchronization."""

    def __init__(self, args: argparse.Namespace):
        cfg = TrainConfig.from_yaml(args.config)
        self.args, self.cfg = args, cfg
        self.rank, self.world, self.run_dir = args.rank, args.learners, Path(args.run_dir)
        self.name = f"learner-{self.rank}"
        self.state_dir = self.run_dir / "learners" / self.name
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.stopping = False
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)

        dist.init_process_group("gloo", init_method=f"tcp://{args.master_addr}:{args.master_port}", rank=self.rank,
                                world_size=self.world)
        tokens = open_tokens(cfg.data, config_vocab(cfg.model))
        self.sampler = tokens.sampler(self.rank, self.world, cfg.inner.batch_size, cfg.model.seq_len, cfg.seed)
        self.model = build_model(cfg.model, cfg.seed)
        self.opt, self.schedule = inner_optimizer(self.model, cfg)
        mode = DdpSync if args.mode == "ddp" else SyncDiLoCo
        self.sync = mode(self.model, self.opt, cfg, self.world)
        self.per_sync_bytes = ring_allreduce_bytes(count_parameters(self.model), self.world)  # fp32 ring, full vector
        self.rng = random.Random(self.rank)
        self.tokens_per_step = cfg.inner.batch_size * cfg.model.seq_len
        self.deadline = args.deadline if args.deadline is not None else time.time() + args.minutes * 60
        self.t0 = time.time()
        self.step = self.syncs = self.bytes_up = self.synced_steps = 0
        self.snaps = 0  # the next snapshot's index (0 is Θ₀)
        if args.resume:
            self._resume()
        # metrics.jsonl counts this incarnation's work (tokens, syncs, bytes) from here; `step` is the position.
        self.start_step, self.start_syncs, self.start_bytes = self.step, self.syncs, self.bytes_up
        if self.rank == 0:
            self._first_snapshots()
        self.metrics = open(self.state_dir / "metrics.jsonl", "a")

    def _first_snapshots(self) -> None:
        """Θ₀ on a fresh start; after a resume, drop the snapshots a rolled-back incarnation took past the checkpoint
        (they are taken again)."""
        _keep_snapshots(self.run_dir, self.snaps)
        if self.snaps == 0:
            _save_snapshot(self.run_dir, 0, self.sync.global_params(), 0)
            self.snaps = 1

    def _request_stop(self, *_) -> None:
        self.stopping = True

    def run(self) -> None:
        """Train until --steps, the deadline or a stop any worker asked for; rank 0 then writes Θ and the end state."""
        window = Window()
        while self.step < self.args.steps:
            started = time.time()
            loss = self._inner_step()
            time.sleep(step_sleep(time.time() - started, float(self.args.slowdown), self.args.jitter, self.rng))
            window.steps, window.loss = window.steps + 1, window.loss + loss
            last = self.step >= self.args.steps
            synced, stop_all = self.sync.step(self.step, last, self.stopping or time.time() >= self.deadline)
            if synced:
                self._count_sync()
            window.busy_s += time.time() - started
            done = last or stop_all
            # A checkpoint step (a multiple of H for sync-diloco: right after the outer step) is always logged, so
            # every worker's metrics reach the committed step and the work a restart loses can be counted.
            save_now = bool(self.args.checkpoint_every) and self.step % self.args.checkpoint_every == 0 and not done
            if self.step % self.args.log_every == 0 or done or save_now:
                window = self._log(window, done)
            self._snapshot_if_due(done)
            if save_now:
                self._save_checkpoint()
            if done:
                break
        self._finish()

    def _count_sync(self) -> None:
        self.syncs, self.bytes_up, self.synced_steps = self.syncs + 1, self.bytes_up + self.per_sync_bytes, self.step

    def _inner_step(self) -> float:
        """Forward and backward on the next batch; the mode's `sync.step` applies the gradients."""
        x, y = self.sampler.next_batch()
        set_lr(self.opt, self.schedule(self.step + 1))
        _, loss = self.model(x, y)
        loss.backward()
        self.step += 1
        return loss.item()

    def _log(self, window: Window, done: bool) -> Window:
        """Append one metrics.jsonl line for the window (the replica digest on the last one); a new window."""
        now = time.time()
        synced_here = self.synced_steps - self.start_step
        sent = self.syncs - self.start_syncs
        rec = MetricsRecord(
            time=now, learner_id=self.name, step=self.step, resumed_from_step=self.start_step,
            loss=window.loss / window.steps, tokens=(self.step - self.start_step) * self.tokens_per_step,
            tokens_per_s=window.steps * self.tokens_per_step / max(now - window.started, 1e-9),
            step_time_s=window.busy_s / window.steps, versions={"all": self.syncs}, sent=sent, acked=sent,
            acked_tokens=synced_here * self.tokens_per_step, acked_steps=synced_here, adoptions=sent, syncer_up=True,
            bytes_up=self.bytes_up - self.start_bytes, bytes_down=self.bytes_up - self.start_bytes,
            lr=self.opt.param_groups[0]["lr"], param_sha256=_param_digest(self.sync.global_params()) if done else None)
        self.metrics.write(rec.model_dump_json(exclude_none=True) + "\n")
        self.metrics.flush()
        return Window(started=now)

    def _snapshot_if_due(self, done: bool) -> None:
        """Rank 0 saves the global model at evenly spaced points of the run (by steps or time, whichever is ahead)."""
        n = self.args.snapshots
        progress = max(self.step / self.args.steps, (time.time() - self.t0) / max(1e-9, self.deadline - self.t0))
        if self.rank == 0 and not done and self.snaps <= n and progress >= self.snaps / (n + 1):
            tokens = self.step * self.tokens_per_step * self.world
            _save_snapshot(self.run_dir, self.snaps, self.sync.global_params(), tokens)
            self.snaps += 1

    def _save_checkpoint(self) -> None:
        """Write this rank's checkpoint; rank 0 commits it once every rank has, then each drops its older one."""
        counters = dict(zip(COUNTERS, (self.step, self.syncs, self.bytes_up, self.synced_steps, self.snaps)))
        state = {"mode": self.args.mode, "world": self.world, "rank": self.rank, "counters": counters,
                 "sampler": self.sampler.state_dict(), "rng": checkpoint.rng_to_json(self.rng)}
        tensors = {f"model.{n}": p for n, p in self.model.named_parameters()}
        tensors.update(checkpoint.optimizer_tensors(self.opt))
        tensors.update(self.sync.tensors())
        tensors["torch_rng"] = torch.get_rng_state()
        checkpoint.save(self.state_dir, self.step, tensors, state)
        _collective(dist.barrier)  # every rank holds step S on disk ...
        if self.rank == 0:
            checkpoint.commit(self.run_dir, self.step, mode=state["mode"], world=state["world"])
        _collective(dist.barrier)  # ... and S is committed: the previous step's files can go
        checkpoint.prune(self.state_dir, keep=self.step)

    def _resume(self) -> None:
        """Continue from the committed checkpoint, if there is one: tensors, data position, RNGs, counters."""
        committed = checkpoint.committed(self.run_dir)
        if committed is None:
            return
        tensors, saved = checkpoint.load(self.state_dir, committed["step"])
        mode, world, rank = self.args.mode, self.world, self.rank
        if (saved["mode"], saved["world"], saved["rank"]) != (mode, world, rank):
            raise SystemExit(f"{self.name}: checkpoint of step {committed['step']} is for {saved['mode']} rank "
                             f"{saved['rank']} of {saved['world']}, not {mode} rank {rank} of {world}")
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(tensors[f"model.{n}"])
        self.sync.restore(tensors)
        checkpoint.load_optimizer_tensors(self.opt, tensors)
        torch.set_rng_state(tensors["torch_rng"])
        self.sampler.load_state_dict(saved["sampler"])
        checkpoint.rng_from_json(self.rng, saved["rng"])
        self.step, self.syncs, self.bytes_up, self.synced_steps, self.snaps = (
            int(saved["counters"][k]) for k in COUNTERS)
        print(f"{self.name}: resumed from the checkpoint of step {self.step}", flush=True)

    def _finish(self) -> None:
        if self.rank == 0:
            final = self.sync.global_params()
            save_file({n: t.contiguous() for n, t in final.items()}, str(self.run_dir / "final" / "theta.safetensors"))
            end = BaselineFinalState(mode=self.args.mode, steps=self.step, outer_steps=self.syncs,
                                     learners=self.world, wall_s=time.time() - self.t0)
            write_json(self.run_dir / FINAL_STATE, end.model_dump(mode="json"))
        self.metrics.close()
        _collective(dist.barrier)


# ---------------------------------------------------------------------- files


def _param_digest(params: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the parameters' bytes: equal digests mean bit-identical replicas."""
    h = hashlib.sha256()
    for n, t in sorted(params.items(), key=lambda kv: kv[0]):
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


def _save_snapshot(run_dir: Path, k: int, params: dict[str, torch.Tensor], tokens: int) -> None:
    name = f"snapshot-{k:02d}.safetensors"
    save_file({n: t.detach().contiguous().clone() for n, t in params.items()}, str(run_dir / "snapshots" / name))
    append_jsonl(run_dir / "snapshots" / "index.jsonl", {"file": name, "time": time.time(), "tokens": tokens})
