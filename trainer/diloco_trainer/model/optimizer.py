"""The inner optimizer every trainer here uses: AdamW without weight decay on norms, biases and embeddings, and a
linear warm-up to a constant learning rate. The learner and the synchronous baselines build it the same way."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from diloco_trainer.config import TrainConfig
from diloco_trainer.model.adamw import AdamW


def inner_lr(step: int, lr: float, warmup_steps: int) -> float:
    """Linear warmup to `lr` over `warmup_steps`, then constant (an asynchronous run has no known end)."""
    return lr * min(1.0, step / warmup_steps) if warmup_steps else lr


def decay_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(decayed, not decayed) parameters of any model, each once (tied weights too), decided by module type and
    shape, never by name: embedding tables (and a head tied to one) and every tensor of fewer than 2 dimensions
    (norm scales, biases) are not decayed; the other matrices are."""
    embedded = {id(p) for mod in model.modules() if isinstance(mod, nn.Embedding) for p in mod.parameters(False)}
    decayed, plain = [], []
    for p in model.parameters():  # parameters() yields a tied tensor once
        (plain if p.dim() < 2 or id(p) in embedded else decayed).append(p)
    return decayed, plain


def inner_optimizer(model: nn.Module, cfg: TrainConfig) -> tuple[AdamW, Callable[[int], float]]:
    """(AdamW over the model's parameters, step -> learning rate); weight decay as `decay_groups` splits them."""
    inner = cfg.inner
    decayed, plain = decay_groups(model)
    opt = AdamW([{"params": decayed, "weight_decay": inner.weight_decay},
                             {"params": plain, "weight_decay": 0.0}],
                            lr=inner.lr, betas=(inner.beta1, inner.beta2))
    return opt, lambda step: inner_lr(step, inner.lr, inner.warmup_steps)


def set_lr(opt: AdamW, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
