"""How the syncer turns learner contributions into one update: token weights, RDA / weighted mean, re-anchoring,
and the Nesterov outer step. Pure tensor math, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

METHODS = ("rda", "mean")
CANCELLED = 1e-6  # RDA: a merged direction shorter than this (of at most 1) is cancellation, not a direction


def token_weight(c_tokens: int, c_steps: int) -> float:
    """Merge weight of one contribution: quantity x tokens-per-step = c_tokens * (c_tokens / c_steps).

    A learner that ran fewer steps (slower) or smaller steps (fewer devices) weighs less; nobody waits for it.
    """
    if c_steps < 1:
        raise ValueError(f"c_steps must be >= 1, got {c_steps}")
    if c_tokens < 0:
        raise ValueError(f"c_tokens must be >= 0, got {c_tokens}")
    return c_tokens * (c_tokens / c_steps)


def _check_weights(weights: list[float], n: int) -> float:
    """Validate the weights of n contributions and return their total."""
    if n == 0:
        raise ValueError("cannot merge zero contributions")
    if len(weights) != n:
        raise ValueError(f"{n} contributions but {len(weights)} weights")
    for i, w in enumerate(weights):
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"weight {i} must be finite and non-negative, got {w}")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("all merge weights are zero")
    return total


def _check(deltas: list[Tensor], weights: list[float]) -> float:
    """Validate a merge's inputs and return the total weight."""
    total = _check_weights(weights, len(deltas))
    for i, d in enumerate(deltas):
        if d.shape != deltas[0].shape:
            raise ValueError(f"delta {i} has shape {tuple(d.shape)}, expected {tuple(deltas[0].shape)}")
    return total


def weighted_mean(deltas: list[Tensor], weights: list[float]) -> Tensor:
    """Σ w·Δ / Σ w (float32)."""
    total = _check(deltas, weights)
    out = torch.zeros_like(deltas[0], dtype=torch.float32)
    for d, w in zip(deltas, weights):
        if w:
            out.add_(d.to(torch.float32), alpha=w / total)
    return out


def _normalize(t: Tensor) -> Tensor:
    """t / ‖t‖, with normalize(0) = 0 (a zero update has no direction and must not produce NaN)."""
    n = torch.linalg.vector_norm(t)
    return t / n if n > 0 else torch.zeros_like(t)


def rda(deltas: list[Tensor], weights: list[float]) -> Tensor:
    """Radial-directional averaging of one tensor: (Σ w‖Δ‖/Σ w) · normalize(Σ w·normalize(Δ) / Σ w).

    The radius is the weighted mean of the norms, so the update keeps its size however many learners join
    (a plain mean of M independent deltas shrinks ~1/√M).

    Two passes over each Δ (its norm, then one fused scaled add) and none over a temporary: the merge runs near
    memory speed (bench syncer_speed compares it with one plain add pass over the same deltas).
    """
    total = _check(deltas, weights)
    radius = 0.0
    direction = torch.zeros_like(deltas[0], dtype=torch.float32)
    for d, w in zip(deltas, weights):
        if w:
            d = d.to(torch.float32)
            norm = float(torch.linalg.vector_norm(d))
            if norm > 0:  # a zero update has no direction (and must not produce NaN)
                radius += w * norm / total
                direction.add_(d, alpha=w / (total * norm))
    # Each Δ added a unit direction times its weight share, so a length near 0 (against at most 1) means the
    # directions cancelled: what is left is rounding (fused multiply-adds), which has no direction either.
    length = float(torch.linalg.vector_norm(direction))
    return direction.mul_(radius / length) if length > CANCELLED else direction.zero_()


def merge_fragment(contributions: list[dict[str, Tensor]], weights: list[float], embedding_names: set[str],
                   method: str = "rda") -> dict[str, Tensor]:
    """Merge one fragment's re-anchored deltas: embeddings by weighted mean, other tensors by RDA (or all by mean)."""
    if method not in METHODS:
        raise ValueError(f"unknown merge method {method!r}; expected one of {METHODS}")
    if not contributions:
        raise ValueError("cannot merge zero contributions")
    names = list(contributions[0])
    for i, c in enumerate(contributions[1:], start=1):
        if set(c) != set(names):
            raise ValueError(f"contribution {i} names different tensors: {sorted(set(c) ^ set(names))}")
    _check_weights(weights, len(contributions))
    out = {}
    for name in names:
        deltas = [c[name] for c in contributions]
        use_mean = method == "mean" or name in embedding_names
        out[name] = weighted_mean(deltas, weights) if use_mean else rda(deltas, weights)
    return out


def reanchor(base: Tensor, current: Tensor, delta_hat: Tensor) -> Tensor:
    """Outer gradient against the current global version: Δ' = Θ_current − θ_m with θ_m = Θ_base − Δ̂ (App. D.2)."""
    if not base.shape == current.shape == delta_hat.shape:
        raise ValueError(f"shapes differ: base {tuple(base.shape)}, current {tuple(current.shape)}, "
                         f"delta {tuple(delta_hat.shape)}")
    return current.to(torch.float32) - (base.to(torch.float32) - delta_hat.to(torch.float32))


class NesterovOuter:
    """SGD with Nesterov momentum on outer gradients: buf ← μ·buf + Δ; Θ ← Θ − η·(Δ + μ·buf).

    Identical to torch.optim.SGD(lr=η, momentum=μ, nesterov=True) with Δ as the gradient. Buffers are kept
    per parameter name and created on a name's first step, so each fragment steps independently.
    """

    def __init__(self, lr: float, momentum: float):
        if not lr > 0:
            raise ValueError(f"outer lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"outer momentum must be in [0, 1), got {momentum}")
        self.lr = lr
        self.momentum = momentum
        self._buf: dict[str, Tensor] = {}

    def step(self, params: dict[str, Tensor], delta: dict[str, Tensor]) -> None:
        """Apply one outer step IN PLACE to params named in delta (all names and shapes checked first)."""
        self._check(params, delta)
        with torch.no_grad():
            for name, d in delta.items():
                p = params[name]
                d, buf = self._momentum(name, d.to(device=p.device, dtype=p.dtype))
                p.sub_(d, alpha=self.lr)
                if self.momentum:
                    p.sub_(buf, alpha=self.lr * self.momentum)

    def stepped(self, params: dict[str, Tensor], delta: dict[str, Tensor]) -> dict[str, Tensor]:
        """One outer step into NEW tensors (params untouched; the momentum buffers advance): the same values as
        `step` on a copy, without first copying the parameters."""
        self._check(params, delta)
        out = {}
        with torch.no_grad():
            for name, d in delta.items():
                p = params[name]
                d, buf = self._momentum(name, d.to(device=p.device, dtype=p.dtype))
                new = torch.sub(p, d, alpha=self.lr)
                if self.momentum:
                    new.sub_(buf, alpha=self.lr * self.momentum)
                out[name] = new
        return out

    @staticmethod
    def _check(params: dict[str, Tensor], delta: dict[str, Tensor]) -> None:
        unknown = sorted(set(delta) - set(params))
        if unknown:
            raise ValueError(f"outer gradient for unknown parameters: {unknown}")
        for name, d in delta.items():
            if d.shape != params[name].shape:
                raise ValueError(f"{name}: outer gradient shape {tuple(d.shape)} != parameter {tuple(params[name].shape)}")

    def _momentum(self, name: str, d: Tensor) -> tuple[Tensor, Tensor]:
        """buf ← μ·buf + Δ in one pass (created as a copy of Δ on the first step)."""
        buf = self._buf.get(name)
        if buf is None:
            buf = self._buf[name] = d.clone()
        else:
            torch.add(d, buf, alpha=self.momentum, out=buf)
        return d, buf

    def forget(self, names: Iterable[str]) -> None:
        """Drop the momentum of these parameters."""
        for name in names:
            self._buf.pop(name, None)

    def state_dict(self) -> dict[str, Tensor]:
        return dict(self._buf)

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self._buf = {name: t.detach().clone() for name, t in state.items()}
