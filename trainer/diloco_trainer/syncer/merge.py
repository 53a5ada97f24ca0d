"""How the syncer turns learner contributions into one update: token weights, RDA / weighted mean, re-anchoring,
and the Nesterov outer step. Pure tensor math, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

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


def tensor_norm(t: Tensor) -> float:
    """‖t‖₂ of any finite tensor, without overflow or underflow: float32 first (fast, no temporary), float64 when
    that overflowed to inf (a 1e20 everywhere squares past float32's range) or came out 0 for a non-zero tensor."""
    n = float(torch.linalg.vector_norm(t))
    if math.isinf(n) or (n == 0 and bool(t.any())):
        n = float(torch.linalg.vector_norm(t, dtype=torch.float64))
    return n


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
            norm = tensor_norm(d)
            if norm > 0:  # a zero update has no direction (and must not produce NaN)
                radius += w * norm / total
                direction.add_(d, alpha=w / (total * norm))
    # Each Δ added a unit direction times its weight share, so a length near 0 (against at most 1) means the
    # directions cancelled: what is left is rounding (fused multiply-adds), which has no direction either.
    length = tensor_norm(direction)
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


def late_share(weights: list[float], merged_since: list[float]) -> float:
    """How much of a merge to apply when others' work merged since its contributions' bases: W / (W + S̄), with W the
    merge's total weight and S̄ the weight merged into the fragment since each contribution's base (weighted by the
    contributions' weights). 1 when every base is the current version.

    A round of learners that sent from one version but landed in two merges (quorum 1, one learner outside the grace
    window) then ends where one merge of all of them would: re-anchored (Δ' = Θ_current − θ_m), a late learner's
    merge alone would move Θ all the way to its own θ_m at outer lr 1 and erase the merge before it; scaled by its
    share of the round, it moves Θ to the weighted average of everyone's θ. Work based further back shares the step
    with everything merged since, so stale work is discounted as it ages.
    """
    total = _check_weights(weights, len(merged_since))
    for s in merged_since:
        if not math.isfinite(s) or s < 0:
            raise ValueError(f"weight merged since a base must be finite and non-negative, got {s}")
    since = sum(w * s for w, s in zip(weights, merged_since)) / total
    return total / (total + since)


def reanchor(base: Tensor, current: Tensor, delta_hat: Tensor) -> Tensor:
    """Outer gradient against the current global version: Δ' = Θ_current − θ_m with θ_m = Θ_base − Δ̂ (App. D.2)."""
    if not base.shape == current.shape == delta_hat.shape:
        raise ValueError(f"shapes differ: base {tuple(base.shape)}, current {tuple(current.shape)}, "
                         f"delta {tuple(delta_hat.shape)}")
    return current.to(torch.float32) - (base.to(torch.float32) - delta_hat.to(torch.float32))


# The bound on one learner's update (docs/security.md): per tensor, its norm must not exceed ABSOLUTE_RATIO times
# max(‖Θ‖, √numel) (a sanity bound that always applies: RMS 10 per element for a small-initialized tensor, far beyond
# any honest outer gradient), nor, once NORM_WARMUP accepted contributions were seen for that tensor, max_norm_ratio
# times the lower median of the last NORM_WINDOW accepted norms of it (all learners'): a learner that is at most half
# of the recent contributions cannot move that reference. During the warm-up (the first, largest honest updates)
# only the absolute bound applies.
ABSOLUTE_RATIO = 10.0
NORM_WARMUP = 8
NORM_WINDOW = 32


class NormHistory:
    """The last NORM_WINDOW accepted update norms of each tensor of one fragment (in memory: a restart warms up)."""

    def __init__(self, window: int = NORM_WINDOW):
        self.window = window
        self._norms: dict[str, deque[float]] = {}

    def record(self, norms: Mapping[str, float]) -> None:
        for name, n in norms.items():
            self._norms.setdefault(name, deque(maxlen=self.window)).append(n)

    def snapshot(self) -> dict[str, tuple[float, ...]]:
        """An immutable copy, for bound_update in a worker thread."""
        return {name: tuple(h) for name, h in self._norms.items()}


def norm_limit(param: Tensor, history: Sequence[float], max_ratio: float) -> tuple[float, str]:
    """The largest update norm accepted for one tensor, and which bound sets it ("absolute" or "relative")."""
    limit, kind = ABSOLUTE_RATIO * max(tensor_norm(param), math.sqrt(param.numel())), "absolute"
    if len(history) >= NORM_WARMUP:
        reference = sorted(history)[(len(history) - 1) // 2]  # lower median: a minority cannot raise it
        if reference > 0 and max_ratio * reference < limit:  # all-zero updates so far: no scale to compare with
            limit, kind = max_ratio * reference, "relative"
    return limit, kind


@dataclass
class Bounded:
    """An update after the norm bound: its tensors (clipped ones are new), their norms after clipping (what the
    history records), and the tensors that were over their bound: (name, norm, limit, "absolute" | "relative")."""

    deltas: dict[str, Tensor]
    norms: dict[str, float]
    over: list[tuple[str, float, float, str]]

    def reason(self) -> str:
        """One line for the learner and the log, naming the first tensor over its bound."""
        name, norm, limit, kind = self.over[0]
        more = f" (and {len(self.over) - 1} more tensors)" if len(self.over) > 1 else ""
        return f"update norm {norm:.4g} of {name} exceeds its {kind} bound {limit:.4g}{more}"

    def kind(self) -> str:
        return "relative" if any(o[3] == "relative" for o in self.over) else "absolute"


def bound_update(deltas: Mapping[str, Tensor], params: Mapping[str, Tensor],
                 history: Mapping[str, Sequence[float]], max_ratio: float, clip: bool = True) -> Bounded:
    """Measure each tensor's update norm (overflow-safe) against its bound (norm_limit); with clip, scale a tensor
    over it down to the bound (its direction kept). Pure: the inputs are not modified."""
    out, norms, over = {}, {}, []
    for name, d in deltas.items():
        norm = tensor_norm(d)
        limit, kind = norm_limit(params[name], history.get(name, ()), max_ratio)
        if norm > limit:
            over.append((name, norm, limit, kind))
            if clip:
                # In float64 first: limit / norm may be below float32's range when norm is huge.
                d = (d.to(torch.float64) * (limit / norm)).to(d.dtype)
                norm = min(tensor_norm(d), limit)
        out[name], norms[name] = d, norm
    return Bounded(out, norms, over)


class NotFinite(ValueError):
    """A merge whose new version (or outer momentum) is not finite: it is never committed."""


def check_finite(tensors: Mapping[str, Tensor]) -> None:
    """NotFinite naming the tensors with a NaN or an infinity, if any."""
    bad = sorted(name for name, t in tensors.items() if not bool(torch.isfinite(t).all()))
    if bad:
        raise NotFinite(f"non-finite values in {len(bad)} tensor(s): {bad[:4]}")


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
