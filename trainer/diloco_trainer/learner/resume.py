"""What a learner start leaves in its state directory and takes back at the next (a mixin of loop.Learner): the data
position, the snapshots of the inner state (AdamW, residuals, adopted versions) and of the unsent work, their restore
and the resend of that work."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from diloco_trainer.checkpoint import optimizer_tensors
from diloco_trainer.fsutil import atomic_write_json
from diloco_trainer.learner import inner_state
from diloco_trainer.learner.snapshots import within_budget

log = logging.getLogger("diloco_trainer.learner.loop")

# Steps between two snapshots of the whole inner state (data position, AdamW state, residuals, adopted Θ, unsent
# work). In between, a unit of one process snapshots its unsent work, residuals and data position after every step
# whose previous snapshot is on disk (written in the background, learner/snapshots.py), so a SIGKILL takes with it
# about one step, not up to POSITION_EVERY (measured: docs/benchmarks.md, "Harsh failures"). A unit of several
# processes takes only the whole ones (capturing its AdamW state is a collective under FSDP2).
POSITION_EVERY = 10


class Resumable:
    """Snapshots and restore of a Learner's state (loop.py holds the attributes these methods read: opts, group,
    sampler, outer, inner, opt, snapshots, step, ...)."""

    def _position_path(self) -> Path | None:
        return self.opts.state_dir / "position.json" if self.opts.state_dir else None

    def _load_position(self) -> None:
        """Resume the data where the restored snapshot was taken (its unsent work was resent: training those batches
        again would count them twice), else where position.json says."""
        path = self._position_path()
        if path is None or not (self.resumed_position is not None or path.exists()):
            return
        try:
            saved = self.resumed_position if self.resumed_position is not None else json.loads(path.read_text())
            self.sampler.load_state_dict(saved)
            log.info("resuming shard %d/%d at epoch %d, offset %d", self.sampler.shard, self.sampler.num_shards,
                     self.sampler.epoch, self.sampler.offset)
        except (ValueError, OSError) as exc:  # another shard layout, or a damaged file: start the shard over
            log.warning("ignoring the saved data position %s: %s", path, exc)

    def _snapshot_due(self) -> bool:
        """After this step: a unit of one process whenever its previous snapshot is on disk and the copies taken
        so far are within snapshots.CAPTURE_BUDGET of its training time (else every POSITION_EVERY steps); a unit
        of several every POSITION_EVERY steps (the same answer on every rank)."""
        if self.group.world_size > 1:
            return self.step % POSITION_EVERY == 0
        if self.resent and self.step < POSITION_EVERY:
            return False  # the snapshot on disk still holds the previous start's work, resent and not yet answered
        if not within_budget(self.snapshots.capture_s, self.train_s):
            return self.step % POSITION_EVERY == 0  # a model whose copies cost more: the whole ones only
        return not self.snapshots.busy()

    def _save_position(self, background: bool = False) -> None:
        """The data position, the inner state and the unsent work, as of now: captured on the step (copies of what
        training changes in place), written by rank 0 in the background (`background`) or before returning. Every
        rank calls it: gathering an FSDP2 unit's AdamW state is a collective."""
        path = self._position_path()
        if path is None:
            return
        started, saved_at = time.monotonic(), time.time()
        snapshot = self.step > 0  # an optimizer that has not stepped has no state worth a snapshot
        whole = (not background or self.group.world_size > 1 or self.whole_at is None
                 or self.step - self.whole_at >= POSITION_EVERY)
        if whole or not snapshot:
            self._save_whole(path, snapshot, started, saved_at, background)
            return
        work, fragments = self.outer.unsent_work()
        work = {k: t.detach().to("cpu", copy=True) if k.startswith("theta.") else t for k, t in work.items()}
        ef, steps, position = self.outer.ef.state_dict(), self.steps_before + self.step, self.sampler.state_dict()
        work_path, nonce = self.opts.state_dir / inner_state.WORK_FILE, self.nonce

        def write() -> None:  # first: a position newer than the unsent work would skip batches, never train one twice
            inner_state.save_work(work_path, ef, steps, (work, fragments), nonce, position, saved_at)
            atomic_write_json(path, position)

        self.snapshots.captured(time.monotonic() - started)
        self.snapshots.submit(write)

    def _save_whole(self, path: Path, snapshot: bool, started: float, saved_at: float, background: bool) -> None:
        """The whole snapshot (see _save_position)."""
        opt = self.inner.optimizer_state() if snapshot and self.inner.sharded else self.opt
        # The unsent work holds θ of its fragments: full tensors (under FSDP2 gathered, so rank 0 says which).
        unsent = self.group.broadcast_json(self.outer.unsent_fragments() if snapshot else [])
        with self.inner.full([n for p in unsent for n in self.plan[p]]):
            if not self.group.is_main:
                return
            position = self.sampler.state_dict()
            if snapshot:
                opt_tensors = inner_state.cpu_copies(opt if isinstance(opt, dict) else optimizer_tensors(opt))
                work, fragments = self.outer.unsent_work()
                work = {k: t.detach().to("cpu", copy=True) if k.startswith("theta.") else t for k, t in work.items()}
                ef, held, steps = self.outer.ef.state_dict(), self.outer.held(), self.steps_before + self.step
        state_path = self.opts.state_dir / inner_state.FILE
        nonce, run = self.nonce, self.run_digest

        def write() -> None:
            if snapshot:  # first: a position newer than the unsent work would skip batches, never train one twice
                inner_state.save(state_path, opt_tensors, ef, steps, (work, fragments), nonce, held, run, position,
                                 saved_at)
            atomic_write_json(path, position)

        if snapshot:
            self.whole_at = self.step

        self.snapshots.captured(time.monotonic() - started)
        if background:
            self.snapshots.submit(write)
        else:
            self.snapshots.wait()  # an older snapshot must not land after this one
            t0 = time.monotonic()
            write()
            self.snapshots.written += 1
            self.snapshots.write_s += time.monotonic() - t0

    def _restore_inner_state(self, versions: dict[int, int]) -> None:
        """AdamW moments and step, and the residuals, from the last snapshot (rank 0 reads, the unit gets them)."""
        found = None
        if self.group.is_main and self.opts.state_dir is not None:
            # The model's parameters for their names and (full, also when sharded) shapes.
            params = dict(self.model.named_parameters())
            found = inner_state.read(self.opts.state_dir / inner_state.FILE, self.opt, params)
            found = inner_state.with_newer_work(found, self.opts.state_dir / inner_state.WORK_FILE, params)
        steps, self.resumed_position = self.group.broadcast_json((found.steps, found.position) if found else (None, None))
        if steps is None:
            return
        template = inner_state.optimizer_template(self.opt)  # the names every rank broadcasts, in one order
        tensors = found.tensors if found else template
        self.group.broadcast_tensors([tensors[k] for k in sorted(template)])
        inner_state.restore(self.opt, self.outer.ef if self.group.is_main else None,
                            self.inner.local_optimizer_state(tensors))
        self.steps_before = steps
        log.info("resumed AdamW and error feedback after %d steps trained before this start", steps)
        resend = found is not None and found.unsent and found.nonce and self.client is not None
        if not self.group.broadcast_json(bool(resend)):
            return
        with self.inner.full(self.names):  # the shapes of θ (a collective under FSDP2)
            if not resend:
                return
            subs = self.outer.resend(found.tensors, found.unsent, versions, self.opts.learner_id, found.nonce)
            for sub in subs:
                self.client.submit(sub)
            self.resent = {sub.submission_id for sub in subs}
            rebased = sum(1 for sub in subs if versions[sub.fragment] > sub.base_version)
            log.info("resending the unsent work of the previous start: %d of %d fragment(s), %d of them rebased onto "
                     "a newer version (%d steps)", len(subs), len(found.unsent), rebased, sum(s.c_steps for s in subs))
