"""Heterogeneous hardware: one learner 2× slower than the others, every step ±10% jitter. Wall time until the global
model reaches a target validation loss, Decoupled DiLoCo vs synchronous DiLoCo (which waits for the slow one).
"""

from __future__ import annotations

from pathlib import Path

from . import report, runs

NAME = "heterogeneity"
SLOWDOWN = "1,1,1,2"
JITTER = 0.1
TARGET_RATIO = 0.6
METHODS = ("decoupled", "sync-diloco")


def spec(ctx: report.Context, method: str) -> runs.RunSpec:
    # More snapshots than the other runs: the time to a loss is read off the global model's validation curve.
    return runs.RunSpec(method, runs.standard_steps(ctx), seed=0, slowdown=SLOWDOWN, jitter=JITTER,
                        snapshots=ctx.pick(3, 6, 10), label=f"{method}, one learner 2× slower")


def time_to(curve: tuple[list[float], list[float], list[float]], level: float) -> float | None:
    """First wall time at which the validation curve reaches `level` (linear between evaluations), else None."""
    times, _, losses = curve
    for i, (t, v) in enumerate(zip(times, losses)):
        if v <= level:
            if i == 0:
                return t
            t0, v0 = times[i - 1], losses[i - 1]
            return t0 + (t - t0) * (v0 - level) / (v0 - v) if v0 != v else t
    return None


def run(ctx: report.Context) -> dict:
    result = report.new_result(NAME, ctx.mode)
    task = ctx.task("heterogeneity runs", len(METHODS))
    summaries = {}
    for method in METHODS:
        summaries[method] = runs.ensure(ctx, spec(ctx, method))
        task.advance()
    task.done()
    curves = {m: runs.val_curve(s) for m, s in summaries.items()}
    finals = {m: s["val_loss"] for m, s in summaries.items()}
    # The loss both runs reach: the worse of the two final losses (the better run gets there earlier).
    level = max(finals.values())
    times = {m: time_to(curves[m], level) for m in METHODS}
    fig = result["figures"]
    fig.update({"slowdown": SLOWDOWN, "jitter": JITTER, "target_loss": level, "time_to_target_s": times,
                "final_val_loss": finals, "steps_per_learner": runs.standard_steps(ctx),
                "curves": {m: dict(zip(("time_s", "tokens", "val_loss"), c)) for m, c in curves.items()},
                "wall_time_s": {m: s["wall_time_s"] for m, s in summaries.items()},
                "tokens_per_s": {m: runs.learner_tokens_per_s(s) for m, s in summaries.items()},
                "runs": {m: s["run_dir"] for m, s in summaries.items()}})
    ratio = times["decoupled"] / times["sync-diloco"] if times["decoupled"] and times["sync-diloco"] else None
    fig["ratio"] = ratio
    t = result["table"]
    t["title"] = f"heterogeneity — learner speeds {SLOWDOWN} (±{100 * JITTER:.0f}% jitter), target val loss {level:.4f}"
    t["columns"] = ["method", "time to target", "× sync DiLoCo", "final val loss", "run wall time", "tokens/s"]
    for m in METHODS:
        t["rows"].append([m, f"{times[m]:.0f} s" if times[m] else "-",
                          f"{times[m] / times['sync-diloco']:.2f}" if times[m] and times["sync-diloco"] else "-",
                          f"{finals[m]:.4f}", f"{fig['wall_time_s'][m]:.0f} s", f"{fig['tokens_per_s'][m]:,.0f}"])
    report.target(result, "decoupled vs sync DiLoCo, one slow learner", f"≤ {TARGET_RATIO}× the synchronous time "
                  "to the target loss", f"{ratio:.2f}×" if ratio else "not reached",
                  None if ratio is None else ratio <= TARGET_RATIO,
                  "" if ratio is None or ratio <= TARGET_RATIO else
                  "the slow learner only sleeps, freeing CPU the others use (2 shared cores), so sync DiLoCo "
                  "loses less than on real hardware; eval points are coarse (interpolated)")
    plot(result, ctx.out_dir / f"{NAME}.png")
    return result


def plot(result: dict, path: Path) -> Path:
    fig_data = result["figures"]
    fig, (a, b) = report.figure(2, 1, width=6.2, height=4.4)
    for m in METHODS:
        c = fig_data["curves"][m]
        a.plot(c["time_s"], c["val_loss"], "o-", ms=3, color=report.color(m), label=m)
        t = fig_data["time_to_target_s"][m]
        if t:
            a.axvline(t, color=report.color(m), ls="--", lw=1)
            a.annotate(f"{t:.0f} s", (t, 0.96), xycoords=("data", "axes fraction"), fontsize=8,
                       color=report.color(m), ha="left")
    a.axhline(fig_data["target_loss"], color="k", ls=":", lw=1)
    a.annotate("target", (0.02, fig_data["target_loss"]), xycoords=("axes fraction", "data"), fontsize=8,
               va="bottom")
    a.set_xlabel("wall time since training started (s)")
    a.set_ylabel("validation loss of the global model")
    a.set_title(f"learner speeds {fig_data['slowdown']}, ±{100 * fig_data['jitter']:.0f}% jitter")
    a.legend(fontsize=8)

    times = [fig_data["time_to_target_s"][m] or 0 for m in METHODS]
    bars = b.bar(list(METHODS), times, color=[report.color(m) for m in METHODS])
    report.bar_labels(b, bars, "{:.0f} s")
    if fig_data["time_to_target_s"]["sync-diloco"]:
        b.axhline(TARGET_RATIO * fig_data["time_to_target_s"]["sync-diloco"], color="k", ls=":", lw=1)
        b.annotate(f"target: {TARGET_RATIO}× sync", (0.55, TARGET_RATIO * fig_data["time_to_target_s"]["sync-diloco"]),
                   xycoords=("axes fraction", "data"), fontsize=8, va="bottom")
    ratio = fig_data.get("ratio")
    b.set_title(f"time to val loss {fig_data['target_loss']:.3f}" + (f": {ratio:.2f}× sync" if ratio else ""))
    b.set_ylabel("seconds")
    return report.save(fig, path, "Heterogeneous learners: wall time to a target loss", report.footnote(result))
