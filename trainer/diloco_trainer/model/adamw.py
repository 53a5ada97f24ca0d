"""AdamW with decoupled weight decay, step for step the arithmetic of `torch.optim.AdamW`, without its import cost:
every `torch.optim` optimizer imports `torch._dynamo` on first use (3.5 CPU-s, as much again as `import torch`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


class AdamW:
    """The subset of `torch.optim.AdamW` the trainers use: `param_groups` (lr, betas, eps, weight_decay), `state`,
    `step`, `zero_grad`, `state_dict` / `load_state_dict` in torch's layout (so snapshots stay interchangeable).
    Per tensor (torch's path on CPU and XLA), or with `torch._foreach_*` (torch's default on CUDA); both equal
    torch's result bit for bit."""

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
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p not in self.state:  # a loaded state that had none for it
                    self.state[p] = self._fresh(p)
            if self.foreach if self.foreach is not None else params and all(p.device.type == "cuda" for p in params):
                self._step_foreach(group, params)
            else:
                for p in params:
                    self._step_one(group, p)

    def _step_one(self, group: dict, p: torch.Tensor) -> None:
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        state, grad = self.state[p], p.grad
        state["step"] += 1
        if wd != 0:
            p.mul_(1 - lr * wd)
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = state["step"].item()
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        denom = (state["exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(state["exp_avg"], denom, value=-(lr / (1 - beta1 ** step)))

    def _step_foreach(self, group: dict, params: list[torch.Tensor]) -> None:
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        grads = [p.grad for p in params]
        steps = [self.state[p]["step"] for p in params]
        exp_avgs, exp_avg_sqs = ([self.state[p][m] for p in params] for m in MOMENTS)
        torch._foreach_add_(steps, torch.tensor(1.0), alpha=1.0)
        if wd != 0:
            torch._foreach_mul_(params, 1 - lr * wd)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        step_size = [(lr / (1 - beta1 ** s.item())) * -1 for s in steps]
        bias_correction2_sqrt = [(1 - beta2 ** s.item()) ** 0.5 for s in steps]
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)

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
