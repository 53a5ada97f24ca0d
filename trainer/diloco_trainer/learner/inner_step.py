"""A learner unit's inner step, built for accelerators: micro-batches under bf16 autocast (fp32 master weights),
gradients averaged across the unit's processes by DistributedDataParallel or sharded by FSDP2 (`fully_shard`),
clipped by the unit's global norm, one AdamW step; and the full parameters the outer sync reads and writes."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from diloco_trainer.checkpoint import optimizer_tensors
from diloco_trainer.config import TrainConfig
from diloco_trainer.learner import devices
from diloco_trainer.learner.devices import UnitGroup
from diloco_trainer.model.optimizer import inner_optimizer, set_lr

log = logging.getLogger(__name__)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on the device for 'bf16' (the weights stay fp32), nothing for 'fp32'."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards apart from the root, for any model: the entries of every ModuleList (transformer
    blocks: the GPT's `blocks`, a Hugging Face model's `layers`); the root keeps the rest (embeddings, tied head)."""
    return [block for mod in model.modules() if isinstance(mod, nn.ModuleList) for block in mod]


class InnerStep:
    """The model wrapped for the unit (DDP or FSDP2 when it has several processes, torch.compile if asked), its
    AdamW, and `step()`. `params` is what the outer sync holds: the model's own parameters (a replica), or for FSDP2
    a dict that `full()` fills with the gathered full tensors of the fragments in use (fp32 throughout)."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, device: torch.device, group: UnitGroup):
        inner = cfg.inner
        self.device, self.group, self.precision = device, group, inner.precision
        self.micro_batches, self.grad_clip = inner.micro_batches, inner.grad_clip
        self.sharded = inner.parallel == "fsdp" and group.world_size > 1
        self.ddp = None
        runner: nn.Module = model
        if self.sharded:
            from torch.distributed.fsdp import fully_shard

            for block in shard_units(model):
                fully_shard(block)
            fully_shard(model)
            self._shards = dict(model.named_parameters())  # DTensors, each rank holding its shard
            self.params: dict[str, torch.Tensor] = {}
        else:
            self.params = dict(model.named_parameters())
            if group.world_size > 1:
                from torch.nn.parallel import DistributedDataParallel

                self.ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
                runner = self.ddp
        self.model = model
        # Built on the parameters as the wrapping left them (FSDP2 replaces them with sharded DTensors).
        self.opt, self.lr_at = inner_optimizer(model, cfg)
        devices.sync(self.device)  # XLA: the moments become data now, so the first step compiles the usual graph
        self.runner = torch.compile(runner) if inner.compile else runner

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> float:
        """One AdamW step on this rank's batch (x, y), in `micro_batches` equal parts whose losses are scaled so the
        step equals the full-batch step; returns the unit's mean loss."""
        set_lr(self.opt, lr)
        self.opt.zero_grad(set_to_none=True)
        m = self.micro_batches
        total = torch.zeros((), device=self.device)
        for i, (xi, yi) in enumerate(zip(x.chunk(m), y.chunk(m))):
            with self._gradient_sync(last=i == m - 1):
                with autocast(self.device, self.precision):
                    _, loss = self.runner(xi, yi)
                (loss / m).backward()
            total += loss.detach().float()
        # Gradients are the unit's mean here (DDP all-reduced them, FSDP2 reduce-scattered them): this norm is the
        # unit's global norm on every rank (over DTensor shards for FSDP2).
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.opt.step()
        mean = total / m  # before the sync: on XLA it joins the step's graph instead of running as one of its own
        devices.sync(self.device)
        return self.group.mean(mean)

    def _gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Reduce gradients across the unit only on the last micro-batch."""
        if self.ddp is not None and not last:
            return self.ddp.no_sync()
        if self.sharded:
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def full(self, names: list[str], write_back: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """`params` holds the full tensors of `names` inside the block; with `write_back`, rank 0's values of them
        become the unit's parameters at its end. A collective under FSDP2 (every rank enters it, names in the same
        order); for a replica only the write-back is one (a broadcast from rank 0)."""
        if not self.sharded:
            yield self.params
            if write_back:
                self.group.broadcast_tensors([self.params[n].data for n in names])
            return
        from torch.distributed.tensor import distribute_tensor

        for n in names:
            self.params[n] = self._shards[n].full_tensor().detach()
        yield self.params
        if write_back:
            with torch.no_grad():
                for n in names:
                    shard = self._shards[n]
                    # distribute_tensor scatters rank 0's tensor: every rank gets its slice of rank 0's values.
                    mine = distribute_tensor(self.params[n], shard.device_mesh, shard.placements, src_data_rank=0)
                    shard.to_local().copy_(mine.to_local())
        for n in names:
            del self.params[n]

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """AdamW's state named as `checkpoint.optimizer_tensors` names it, full tensors whatever the sharding: under
        FSDP2 gathered from every rank's shards one tensor at a time onto the CPU (a collective: every rank enters
        it), so the snapshot of a sharded unit is the snapshot of a replica."""
        tensors = optimizer_tensors(self.opt)
        if not self.sharded:
            return tensors
        from torch.distributed.tensor import DTensor

        # One order on every rank (a restored state may hold its entries in another): the gathers must pair up.
        order = sorted(tensors, key=lambda k: (int(k.split(".")[1]), k))
        return {k: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
                for k in order for t in [tensors[k]]}

    def local_optimizer_state(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full optimizer tensors (as `optimizer_state` gives them, the same on every rank) as this rank holds them:
        unchanged for a replica, each FSDP2 rank's slice of the moments (no communication)."""
        if not self.sharded:
            return tensors
        from torch.distributed.tensor import DTensor, distribute_tensor

        params = [p for group in self.opt.param_groups for p in group["params"]]
        out = {}
        for key, t in tensors.items():
            section, _, rest = key.partition(".")
            idx, _, kind = rest.partition(".")
            p = params[int(idx)] if section == "opt" else None
            if p is None or kind == "step" or not isinstance(p, DTensor):
                out[key] = t  # the step count, a replicated parameter's state, or not the optimizer's (ef.*, ...)
            else:  # src_data_rank None: every rank cuts its slice from the full tensor it already holds
                out[key] = distribute_tensor(t.to(p.device, p.dtype), p.device_mesh, p.placements, src_data_rank=None)
        return out
