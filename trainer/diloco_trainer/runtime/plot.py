"""The run's PNG: training loss per learner and the global model's validation loss, against wall time and tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Curve:
    """One learner's training loss over the run (all incarnations), with its restart times."""

    name: str
    time_s: list[float] = field(default_factory=list)  # seconds since the run started
    tokens: list[float] = field(default_factory=list)  # this learner's cumulative tokens
    loss: list[float] = field(default_factory=list)
    restarts_s: list[float] = field(default_factory=list)  # when a restarted incarnation logged its first line
    deaths_s: list[float] = field(default_factory=list)  # when an incarnation died (non-zero exit)
    breaks: list[int] = field(default_factory=list)  # indices where a new incarnation's points begin

    def segments(self) -> list[slice]:
        """One slice of the points per incarnation (lines are not drawn across an outage)."""
        edges = [0, *[b for b in self.breaks if 0 < b < len(self.time_s)], len(self.time_s)]
        return [slice(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def smooth(values: list[float]) -> np.ndarray:
    """Centered moving average over ~5% of the points (the raw training loss is noisy; a centered window
    does not lag behind the curve the way an EMA does)."""
    v = np.asarray(values, dtype=float)
    half = len(v) // 40
    if half == 0:
        return v
    csum = np.concatenate([[0.0], np.cumsum(v)])
    idx = np.arange(len(v))
    lo, hi = np.maximum(0, idx - half), np.minimum(len(v), idx + half + 1)
    return (csum[hi] - csum[lo]) / (hi - lo)


def _si(v: float) -> str:
    """Axis labels like 250k, 1.5M."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:g}{suffix}"
    return f"{v:g}"


def total_tokens_at(curves: list[Curve], times: np.ndarray) -> np.ndarray:
    """Tokens trained by all learners together at each time (each learner's counter interpolated)."""
    total = np.zeros(len(times))
    for c in curves:
        if c.time_s:
            total += np.interp(times, c.time_s, c.tokens, left=0.0)
    return total


def plot_run(path: Path, curves: list[Curve], evals: list[tuple[float, float, float]], unigram: float | None,
             title: str, unit: str = "nats/byte") -> Path:
    """Write the PNG: left loss vs wall time, right loss vs tokens trained by the whole run.

    `evals` are (time_s, total_tokens, val_loss) points of the global model (final included).
    """
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_n) = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, c in enumerate(curves):
        if not c.time_s:
            continue
        color = colors[i % len(colors)]
        t = np.array(c.time_s) / 60
        run_tokens = total_tokens_at(curves, np.array(c.time_s))
        loss = np.array(c.loss)
        for k, seg in enumerate(c.segments()):
            smoothed = smooth(c.loss[seg])
            for ax, x in ((ax_t, t), (ax_n, run_tokens)):
                ax.plot(x[seg], loss[seg], color=color, alpha=0.18, linewidth=0.8)
                ax.plot(x[seg], smoothed, color=color, linewidth=1.6, label=f"{c.name} (train)" if k == 0 else None)
            if k > 0:  # the learner came back: its first point after the outage
                ax_t.plot([t[seg][0]], [smoothed[0]], marker="^", color=color, markersize=9, markeredgecolor="black",
                          zorder=6)
        for d in c.deaths_s:  # where the learner died: at its last logged loss before that moment
            before = [j for j, x in enumerate(c.time_s) if x <= d]
            if before:
                ax_t.plot([d / 60], [c.loss[before[-1]]], marker="X", color=color, markersize=10,
                          markeredgecolor="black", zorder=6)
    if evals:
        et, en, ev = (np.array(v) for v in zip(*sorted(evals)))
        for ax, x in ((ax_t, et / 60), (ax_n, en)):
            ax.plot(x, ev, "o-", color="black", linewidth=2, markersize=6, label="global model (validation)",
                    zorder=5)
        ax_t.annotate(f"{ev[-1]:.3f}", (et[-1] / 60, ev[-1]), textcoords="offset points", xytext=(6, 6))
    if unigram is not None:
        for ax in (ax_t, ax_n):
            ax.axhline(unigram, color="grey", linestyle="--", linewidth=1, label=f"unigram baseline {unigram:.2f}")
    ax_t.set_xlabel("wall time since launch (minutes)")
    ax_n.set_xlabel("tokens trained by all learners")
    ax_n.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: _si(v)))
    ax_t.set_ylabel(f"cross-entropy ({unit.replace('/', ' / ')})")
    for ax in (ax_t, ax_n):
        ax.grid(alpha=0.3)
    all_loss = [v for c in curves for v in c.loss] + [e[2] for e in evals]
    if all_loss:
        top = max(unigram or 0, np.percentile(all_loss, 98)) * 1.05
        ax_t.set_ylim(min(all_loss) * 0.95, top)
    ax_n.legend(loc="upper right", fontsize=8, framealpha=0.9)
    if any(c.deaths_s or c.breaks for c in curves):
        handles = [plt.Line2D([], [], marker="X", color="grey", markeredgecolor="black", linestyle="", markersize=9,
                              label="learner died"),
                   plt.Line2D([], [], marker="^", color="grey", markeredgecolor="black", linestyle="", markersize=9,
                              label="restarted learner trains again")]
        ax_t.legend(handles=handles, loc="upper right", fontsize=8, framealpha=0.9)
    ax_t.set_xlim(left=0)
    ax_n.set_xlim(left=0)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
