"""One learner unit of Decoupled DiLoCo: inner AdamW on its own shard, outer gradients of due fragments sent in
the background, newer global fragments adopted at step boundaries (outer_sync.py keeps that bookkeeping). Compute
never waits on the network."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diloco_trainer.learner import devices
from diloco_trainer.learner.devices import UnitGroup
from diloco_trainer.learner.link import FragmentUpdate, Submission, SyncerLink
from diloco_trainer.learner.sharded_client import make_client
from diloco_trainer.protocol.fragments import aligned_first_due
from diloco_trainer.protocol.shardmap import split_syncer_urls
from diloco_trainer.config import TrainConfig
from diloco_trainer.data.source import open_tokens
from diloco_trainer.learner import inner_state
from diloco_trainer.learner.inner_step import InnerStep
from diloco_trainer.model.build import build_model, vocab_size_of
from diloco_trainer.learner.outer_sync import OuterSync
from diloco_trainer.learner.resume import Resumable
from diloco_trainer.learner.snapshots import SnapshotWriter
from diloco_trainer.learner.stop_flag import StopFlag
from diloco_trainer.protocol.messages import LearnerRecord, LinkCounters

log = logging.getLogger(__name__)



@dataclass
class LearnerOptions:
    """Command-line settings of one learner unit (see `diloco learner --help`)."""

    syncer: str
    learner_id: str
    token: str
    unit: int = 0
    units: int = 1
    device: str = "auto"
    state_dir: Path | None = None
    steps: int | None = None  # None: train until stopped
    slowdown: float = 1.0
    jitter: float = 0.0
    log_every: int = 10
    metrics_port: int = 0
    drain_s: float = 10.0
    seed: int = 0
    data_cache: Path | None = None
    poll_s: float = 0.25
    save_params: Path | None = None  # write the final local θ here (params-rank{r}.safetensors), for inspection
    ca: Path | None = None  # CA certificate the syncer's (https) certificate is verified against
    restore_inner: bool = True  # resume AdamW and error feedback from the state directory's snapshot (inner_state.py)
    process_restarts: int = 0  # restarts in place by `diloco pod-learner` before this process (runtime/podsup.py)


@dataclass
class Window:
    """Figures accumulated between two metrics lines."""

    started: float = field(default_factory=time.monotonic)
    steps: int = 0
    loss: float = 0.0
    tokens: int = 0
    busy_s: float = 0.0


def step_sleep(compute_s: float, slowdown: float, jitter: float, rng: random.Random) -> float:
    """Seconds to sleep so the step takes slowdown·(1 + jitter·u)·compute, u uniform in [-1, 1], never < compute."""
    factor = max(1.0, slowdown * (1.0 + jitter * rng.uniform(-1.0, 1.0)))
    return (factor - 1.0) * compute_s


class Learner(Resumable):
    """A learner unit's state and loop; `run()` returns the process exit code."""

    def __init__(self, opts: LearnerOptions):
        self.opts = opts
        self.group = UnitGroup()  # joined in _start(), once the device (and so the backend) is known
        self.stop_flag = StopFlag()  # set by SIGTERM/SIGINT: stop_flag.py says why not a threading.Event
        self.client: SyncerLink | None = None
        self.nonce = secrets.token_hex(4)
        self.outer: OuterSync | None = None  # built in _start(), once the plan and versions are known
        self.step = 0  # this incarnation's steps (its counters restart with the process)
        self.steps_before = 0  # steps trained by earlier incarnations whose AdamW state this one resumed
        self.tokens = 0
        self.step_time_ema = 0.0
        self.train_s = 0.0  # seconds of this start's steps (the snapshots' budget, snapshots.within_budget)
        self.last_loss: float | None = None
        self.rng = random.Random(opts.seed * 1_000_003 + opts.unit)
        self.metrics_state: dict = {}
        self.run_digest = ""  # names the run the saved Θ belongs to (inner_state.run_digest; rank 0)
        self.snapshots = SnapshotWriter()
        self.resumed_position: dict | None = None  # the data position the restored snapshot was taken at
        self.resent: set[str] = set()  # ids of the previous start's unsent work resent by this one, not yet answered
        self.whole_at: int | None = None  # the step of this start's last snapshot of the whole inner state
        # Fragment-steps of the previous start's unsent work that this one resent and the syncer refused, by class:
        # that start's work, counted by this one (the run's ledger moves it from lost or unsent to refused).
        self.resent_refused = {"stale": 0, "other": 0}

    # ------------------------------------------------------------------ start-up

    def _start(self) -> None:
        """Pull Θ, versions, plan and config from the syncer (rank 0; broadcast to the unit), build everything."""
        self.device = devices.select_device(self.opts.device)
        self.group = UnitGroup.from_env(self.device)
        self.device = self.group.device or self.device  # a multi-GPU unit: each rank on its cuda:LOCAL_RANK
        if self.group.is_main:
            self.client = make_client(split_syncer_urls(self.opts.syncer), self.opts.token, self.opts.learner_id,
                                      unit=self.opts.unit, world_size=self.group.world_size,
                                      device=devices.describe(self.device), poll_s=self.opts.poll_s, ca=self.opts.ca)
            boot = self.client.bootstrap(self.stop_flag, held=self._held_fragments)
            self.run_digest = inner_state.run_digest(boot.config, boot.plan)
            info = {"config": boot.config, "plan": boot.plan, "versions": {str(k): v for k, v in boot.versions.items()}}
        else:
            boot, info = None, None
        info = self.group.broadcast_json(info)
        if info is None:  # rank 0 was stopped before the syncer answered
            raise InterruptedError("stopped while waiting for the syncer")
        self.cfg = TrainConfig.model_validate(info["config"])
        self.plan: list[list[str]] = info["plan"]
        versions = {int(k): int(v) for k, v in info["versions"].items()}

        self.model = build_model(self.cfg.model, self.cfg.seed).to(self.device)
        self.params = dict(self.model.named_parameters())
        self.names = list(self.params)
        planned = [n for frag in self.plan for n in frag]
        if sorted(planned) != sorted(self.params) or len(self.plan) != self.cfg.outer.fragments:
            raise ValueError("the syncer's fragment plan does not match this learner's model "
                             f"(plan: {len(planned)} tensors in {len(self.plan)} fragments, model: {len(self.params)})")
        if boot is not None:
            missing = sorted(set(self.params) - set(boot.theta))
            if missing:
                raise ValueError(f"the syncer's state lacks parameters {missing[:5]}")
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(boot.theta[name].to(self.device, p.dtype))
        self.group.broadcast_tensors([p.data for p in self.params.values()])
        # From here the outer sync reads and writes the parameters through the inner step's `params` (the model's
        # own, or the gathered full tensors of an FSDP2 unit's fragments in use).
        self.inner = InnerStep(self.model, self.cfg, self.device, self.group)
        self.params, self.opt = self.inner.params, self.inner.opt
        outer = self.cfg.outer
        with self.inner.full(self.names):
            self.outer = OuterSync(self.plan, versions, self.params, sync_every=outer.sync_every, adopt=outer.adopt,
                                   compression=outer.compression, block_size=outer.block_size, step=self.step,
                                   sends=self.group.is_main, keep_fraction=outer.keep_fraction,
                                   state_device=devices.outer_state_device(self.device))
        if self.opts.restore_inner:
            self._restore_inner_state(versions)

        tokens = open_tokens(self.cfg.data, vocab_size_of(self.model, self.cfg.model), self.opts.data_cache)
        # One unit-wide sampler (same on every rank); each rank trains its own slice of the unit's batch, so the
        # position file describes the unit and survives a restart with a different number of processes.
        self.batch = self.cfg.inner.batch_size
        self.sampler = tokens.sampler(self.opts.unit, self.opts.units, self.batch * self.group.world_size,
                                      self.cfg.model.seq_len, seed=self.cfg.seed)
        self._load_position()
        self.tokens_per_step = self.batch * self.group.world_size * self.cfg.model.seq_len
        # Every rank sends (or gathers for a send of) the same fragments at the same steps: rank 0 decides.
        due = self.group.broadcast_json(self._aligned_first_sends(boot) if self.group.is_main else None)
        if due:
            due = dict(sorted((int(p), d) for p, d in due.items()))  # JSON keys back to fragment numbers
            self.outer.align(due, self.step)
            log.info("first sends lined up with the other learners': fragment -> steps from now %s", due)

    def _aligned_first_sends(self, boot) -> dict[str, int] | None:
        """Steps until this life first sends each fragment the syncer published a version of while others trained
        (outer.align_first_sends); None when there is nothing to line up with (a job's first start, a syncer that
        restarted since, no step time known yet)."""
        if not self.cfg.outer.align_first_sends or not boot.published_at or not boot.step_s:
            return None
        now = time.monotonic()
        return {str(p): aligned_first_due(now - at, boot.step_s, self.cfg.outer.sync_every)
                for p, at in boot.published_at.items()}

    def _held_fragments(self, config: dict, plan: list[list[str]]) -> dict[int, tuple[int, dict[str, torch.Tensor]]]:
        """The global Θ this learner saved before a restart, {p: (version, Θ_p)}: what it may train a fragment from
        while the syncer shard that owns it is down (nothing when its inner state is not restored)."""
        if self.opts.state_dir is None or not self.opts.restore_inner:
            return {}
        return inner_state.read_held(self.opts.state_dir / inner_state.FILE, inner_state.run_digest(config, plan),
                                     plan)

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        """Train until --steps or a stop signal, then drain in-flight submissions (bounded) and exit 0."""
        self._install_signal_handlers()
        try:
            self._start()
        except InterruptedError:
            log.info("%s: stopped before the syncer answered", self._stop_reason())
            if self.group.is_main and self.group.world_size > 1:
                self.group.broadcast_json(None)  # release the other ranks waiting for the bootstrap
            if self.client is not None:
                self.client.close()
            self.group.close()
            self.stop_flag.close()
            return 0
        server = self._serve_metrics()
        window = Window()
        log.info("learner %s (unit %d of %d, %d process%s on %s) starting at versions %s", self.opts.learner_id,
                 self.opts.unit, self.opts.units, self.group.world_size, "" if self.group.world_size == 1 else "es",
                 self.device, self._versions())
        while self.opts.steps is None or self.step < self.opts.steps:
            started = time.monotonic()
            loss = self._inner_step()
            if not math.isfinite(loss):  # fail fast: a restarted learner pulls a sane Θ from the syncer
                raise FloatingPointError(f"the training loss became {loss} at step {self.step + 1}; "
                                         "lower inner.lr or raise inner.warmup_steps")
            compute_s = time.monotonic() - started
            self.stop_flag.wait(step_sleep(compute_s, self.opts.slowdown, self.opts.jitter, self.rng))

            self.step += 1
            self.tokens += self.tokens_per_step
            self.outer.trained(self.tokens_per_step)
            self._book_answers()
            self._write_ledger()  # before this step's sends: a Δ merged after a SIGKILL covers no unrecorded step
            # Due fragments go out before adoption: a version landing on the step p is due must not erase
            # the work this Δ carries.
            due = [n for p in self.outer.due_fragments(self.step) for n in self.plan[p]]
            with self.inner.full(due):
                self.outer.send_due(self.step, self.opts.learner_id, self.nonce, self._queue)
            stop = self._adopt_updates()

            step_s = time.monotonic() - started
            self.train_s += step_s
            self.step_time_ema = step_s if self.step == 1 else 0.9 * self.step_time_ema + 0.1 * step_s
            self.last_loss = loss
            window.steps, window.loss = window.steps + 1, window.loss + loss
            window.tokens, window.busy_s = window.tokens + self.tokens_per_step, window.busy_s + step_s
            if self.client is not None:
                self.client.report(self.step, self.step_time_ema, self.tokens, self.nonce, self.outer.steps_discarded)
            if self._snapshot_due():
                self._save_position(background=True)
            if self.step % self.opts.log_every == 0:
                self._log(window)
                window = Window()
            if stop:
                log.info("%s: stopping after step %d", self._stop_reason(), self.step)
                break
        return self._finish(window, server)

    def _inner_step(self) -> float:
        """One AdamW step on this rank's slice of the unit batch (inner_step.py); returns the unit's mean loss."""
        x, y = self.sampler.next_batch()
        r = self.group.rank
        mine = slice(r * self.batch, (r + 1) * self.batch)
        x, y = x[mine].to(self.device), y[mine].to(self.device)
        return self.inner.step(x, y, self.inner.lr_at(self.steps_before + self.step + 1))

    # ------------------------------------------------------------------ outer gradients

    def _queue(self, sub: Submission) -> bool:
        """Hand a Δ to the link (only the rank that talks to the syncer builds one)."""
        return self.client.submit(sub)

    def _book_answers(self) -> None:
        """Book the syncer's answers to this start's Δs. An answer to the previous start's resent work (its ids,
        its nonce) settles that work; it says nothing of this start's own Δ of the same fragment and base."""
        if self.client is None:
            return
        answers = self.client.take_answers()
        self.resent.difference_update(a.submission_id for a in answers)
        own = f"{self.opts.learner_id}.{self.nonce}."
        for a in answers:
            if not a.accepted and not a.submission_id.startswith(own):
                self.resent_refused["stale" if a.status == 409 else "other"] += a.c_steps
        self.outer.book([a for a in answers if a.submission_id.startswith(own)])

    # ------------------------------------------------------------------ adoption

    def _adopt_updates(self) -> bool:
        """Take newer global versions (rank 0 fetched them; every rank applies them at this same step, as
        `outer.adopt` says: see outer_sync.py). Returns True when any rank of the unit was asked to stop.

        Decision, measured: every newer version is adopted at the next step boundary. Holding versions until the
        learner had sent its own Δ diverged (configs/tiny.yaml, 3 learners, 200 steps: validation loss 3414 vs 2.72
        eager): a Δ from a stale base is re-anchored as Θ_current − θ_m, which drags Θ back toward the stale θ_m."""
        updates: list[FragmentUpdate] = self.client.take_updates() if self.client is not None else []
        # A rewind replaces a version its shard no longer has (it lost state while this learner was restarting).
        updates = [u for u in updates if u.version > self.outer.frags[u.fragment].version or u.rewind]
        stop, adopted = self.group.step_header(self.stop_flag.is_set(), [(u.fragment, u.version) for u in updates],
                                               slots=len(self.plan))
        by_fragment = {u.fragment: u for u in updates}
        for p, version in adopted:
            # The AdamW moments are kept (Decision); rank 0 computes the new θ_p, the unit gets it from rank 0.
            with self.inner.full(self.plan[p], write_back=True):
                self.outer.adopt(p, version, by_fragment[p].tensors if self.group.is_main else None, self.step)
            devices.run_lazy(self.device)
        return stop

    # ------------------------------------------------------------------ reporting and shutdown

    def _versions(self) -> dict[str, int]:
        return self.outer.versions()

    def _ledger(self) -> dict[str, int]:
        """This life's ledger (OuterSync.ledger) with the refused resends of the previous start's work."""
        return self.outer.ledger() | {f"resent_refused_{k}": v for k, v in self.resent_refused.items()}

    def _write_ledger(self, final: bool = False) -> None:
        """learners/<id>/ledger/<life>.json: this life's steps and ledger as of now, replaced after every step
        (before its sends) and as it stops (`final`). What a SIGKILLed life trained is then known to the step, so
        the run's ledger (runtime/ledger.py) can count its lost work. Not fsynced: a killed process's writes
        survive it (a crashed machine's are lost, and the ledger then reads an earlier step)."""
        if self.opts.state_dir is None or not self.group.is_main:
            return
        doc = {"life": self.nonce, "time": time.time(), "steps": self.step, "fragments": len(self.plan),
               "final": final, **self._ledger()}
        path = self.opts.state_dir / "ledger" / f"{self.nonce}.json"
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(doc))
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)

    def _record(self, window: Window) -> dict:
        elapsed = max(1e-9, time.monotonic() - window.started)
        net = self.client.snapshot() if self.client is not None else {}
        return LearnerRecord(
            time=time.time(), learner_id=self.opts.learner_id, unit=self.opts.unit,
            world_size=self.group.world_size, step=self.step,
            loss=window.loss / window.steps if window.steps else self.last_loss,
            tokens=self.tokens, tokens_per_s=window.tokens / elapsed if window.steps else 0.0,
            step_time_s=window.busy_s / window.steps if window.steps else self.step_time_ema,
            versions=self._versions(), queued=self.outer.queued, adoptions=self.outer.adoptions,
            steps_kept=self.outer.steps_kept, steps_discarded=self.outer.steps_discarded,
            **{f"ledger_{k}": v for k, v in self._ledger().items()},
            epoch=self.sampler.epoch, lr=self.opt.param_groups[0]["lr"],
            **self.snapshots.stats(),
            **{k: net[k] for k in LinkCounters.model_fields if k in net}, **devices.xla_graph_counts(self.device),
        ).model_dump()

    def _log(self, window: Window, final: bool = False) -> None:
        if not self.group.is_main:
            return
        rec = self._record(window) | ({"final": True} if final else {})
        self.metrics_state = rec
        if self.opts.state_dir is not None:
            self.opts.state_dir.mkdir(parents=True, exist_ok=True)
            with open(self.opts.state_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
        loss = f"{rec['loss']:.3f}" if rec["loss"] is not None else "-"
        log.info("step %d loss %s tok/s %.0f versions %s queued %d sent %d acked %d rejected %d adopted %d syncer %s",
                 rec["step"], loss, rec["tokens_per_s"], rec["versions"], rec["queued"], rec["sent"], rec["acked"],
                 rec["rejected"], rec["adoptions"], "up" if rec["syncer_up"] else "away")
        if rec["xla_compiles"] is not None:
            log.info("xla: %d graphs compiled (%.1f s), %d run", rec["xla_compiles"], rec["xla_compile_s"],
                     rec["xla_executions"])

    def _finish(self, window: Window, server) -> int:
        self._save_position()
        started = time.monotonic()
        drained = self._hand_over(started + self.opts.drain_s)
        self.outer.discard_after_acknowledged()  # what the next adoption would drop (overwrite): not work lost
        self._write_ledger(final=True)
        if self.opts.save_params is not None:
            with self.inner.full(self.names):
                self._dump_params(self.opts.save_params / f"params-rank{self.group.rank}.safetensors")
        if self.client is not None:
            self.client.report(self.step, self.step_time_ema, self.tokens, self.nonce, self.outer.steps_discarded)
            if drained:
                log.info("handed over in %.2f s: every trained step is covered by an acknowledged outer gradient",
                         time.monotonic() - started)
            else:
                log.warning("stopping with %d submission(s) unanswered after %.0f s of drain; fragments %s hold work "
                            "no acknowledged outer gradient covers", self.client.pending(), self.opts.drain_s,
                            self.outer.unsettled())
            self.client.close(0.0)
        self.snapshots.close()
        self._log(window, final=True)
        if server is not None:
            server.shutdown()
        self.group.close()
        self.stop_flag.close()
        log.info("learner %s stopped after %d steps (%d tokens)", self.opts.learner_id, self.step, self.tokens)
        return 0

    def _hand_over(self, deadline: float) -> bool:
        """Leaving (a stop signal such as a pod's SIGTERM, or --steps done): until every trained step is covered
        by an acknowledged Δ, or until `deadline`, send what no Δ covers and take the syncer's answers and new
        versions, as the loop does between steps. Returns True when nothing was left unsettled or unanswered.

        Decision: the Δ of a partial window goes out (c_steps < H). The protocol carries each Δ's own counters and
        the merge weighs it by its real tokens (w = c_tokens²/c_steps, docs/protocol.md "Algorithm modules"), so a
        3-step Δ weighs 3/16 of a full one and loses nothing. The steps a learner trained after its acknowledged Δ
        of a fragment cannot go out from that base (one Δ per base version); with adopt=keep they ride on the
        version that merges it and go out from there, so the learner waits for that version (a merge, within the
        quorum and grace window); with adopt=overwrite that adoption would discard them anyway."""
        while True:
            self._book_answers()
            self._adopt_updates()
            flush = self.group.broadcast_json(self.outer.flushable() if self.group.is_main else None)
            with self.inner.full([n for p in flush for n in self.plan[p]]):
                self.outer.flush(self.opts.learner_id, self.nonce, self._queue)
            left = self.client is not None and bool(self.outer.unsettled() or self.client.pending())
            done = self.group.broadcast_json(not left or time.monotonic() >= deadline)
            if done:
                return not left
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _dump_params(self, path: Path) -> None:
        from diloco_trainer.protocol.wire import encode_tensors

        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"versions": json.dumps(self._versions()), "step": str(self.step), "rank": str(self.group.rank)}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(encode_tensors({n: p.detach() for n, p in self.params.items()}, meta))
        tmp.replace(path)

    def _stop_reason(self) -> str:
        """What asked this rank to stop, for the log: the signal it received, or its unit's rank 0 (which did)."""
        return f"received {self.stop_flag.reason}" if self.stop_flag.reason else "stop requested by the unit"

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, _frame):  # no logging, no locks in here (stop_flag.py): the loop logs the reason
            self.stop_flag.set(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def _serve_metrics(self):
        if not self.opts.metrics_port or not self.group.is_main:
            return None
        from diloco_trainer.learner.exporter import serve_metrics

        return serve_metrics(self.opts.metrics_port, lambda: self.metrics_state or self._record(Window()),
                             process_restarts=self.opts.process_restarts)

