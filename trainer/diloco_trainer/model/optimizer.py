"""The inner optimizer every trainer here uses: AdamW without weight decay on norms and biases, and a linear
warm-up to a constant learning rate. The learner and the synchronous baselines build it the same way."""

from __future__ import annotations

from collections.abc import Callable

import torch

from diloco_trainer.config import TrainConfig


def inner_lr(step: int, lr: float, warmup_steps: int) -> float:
    """Linear warmup to `lr` over `warmup_steps`, then constant (an asynchronous run has no known end)."""
    return lr * min(1.0, step / warmup_steps) if warmup_steps else lr


def inner_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> tuple[torch.optim.AdamW, Callable[[int], float]]:
    """(AdamW over the model's parameters, step -> learning rate). Matrices decay, vectors (norms, biases) do not."""
    inner = cfg.inner
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": inner.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=inner.lr, betas=(inner.beta1, inner.beta2))
    return opt, lambda step: inner_lr(step, inner.lr, inner.warmup_steps)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
