"""AdamW as `torch.optim.AdamW` computes it (its functional `torch.optim.adamw.adamw`), without that class's import
cost: every `torch.optim` optimizer imports `torch._dynamo` on its first step (3.5 CPU-s, as much again as
`import torch`), the functional form does not."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim.adamw import adamw

MOMENTS = ("exp_avg", "exp_avg_sq")


class AdamW:
    """The subset of `torch.optim.AdamW` the trainers use: `param_groups` (lr, betas, eps, weight_decay), `state`,
    `step`, `zero_grad`, `state_dict` / `load_state_dict` in torch's layout (so snapshots stay interchangeable).
    `foreach` as torch's (None: torch's own default, `torch._foreach_*` on CUDA, per tensor on CPU and XLA)."""

    def __init__(self, groups: Iterable[dict], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, foreach: bool | None = None):
        self.foreach = foreach  # None: `torch._foreach_*` only when every parameter of a group is on CUDA
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        self.param_groups = [{**defaults, **group, "params": list(group["params"])} for group in groups]
        # Moments exist from the start, not from the first step as in torch: on XLA the first step then runs the
        # graph every later step runs, instead of one of its own that also creates them (a second compilation).
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {p: self._fresh(p) for p in self._params()}

    @staticmethod
    def _fresh(p: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"step": torch.tensor(0.0, dtype=torch.float32),
                **{m: torch.zeros_like(p, memory_format=torch.preserve_format) for m in MOMENTS}}

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One step of every group: torch's own functional AdamW (`torch.optim.adamw.adamw`, the arithmetic
        `torch.optim.AdamW.step` runs), on the state this optimizer keeps."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if p not in self.state:  # a loaded state that had none for it
                    self.state[p] = self._fresh(p)
            beta1, beta2 = group["betas"]
            adamw(params, [p.grad for p in params], [self.state[p]["exp_avg"] for p in params],
                  [self.state[p]["exp_avg_sq"] for p in params], [], [self.state[p]["step"] for p in params],
                  foreach=self.foreach, has_complex=any(torch.is_complex(p) for p in params), amsgrad=False,
                  beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                  maximize=False)

    def state_dict(self) -> dict:
        """torch's layout: state by parameter index, groups with indices."""
        index = {p: i for i, p in enumerate(self._params())}
        groups, start = [], 0
        for group in self.param_groups:
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        return {"state": {index[p]: dict(s) for p, s in self.state.items()}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch loads it: the groups' hyper-parameters from `state_dict`, each moment cast to its parameter's
        dtype and device, the step count kept as saved (a CPU scalar); copies, as torch's deep copy, never aliases."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(mine["params"]) for g, mine in zip(groups, self.param_groups)):
            raise ValueError("the loaded state dict's parameter groups do not match this optimizer's")
        for saved, mine in zip(groups, self.param_groups):
            mine.update({k: v for k, v in saved.items() if k != "params"})
        params = self._params()
        self.state = {}
        for idx, saved in state_dict["state"].items():
            p = params[int(idx)]
            self.state[p] = {k: v.detach().clone() if k == "step" else v.to(dtype=p.dtype, device=p.device, copy=True)
                             for k, v in saved.items()}
