"""Heterogeneous hardware: one learner 2× slower than the others, every step ±10% jitter. Wall time until the global
model reaches a target validation loss — the one synchronous DiLoCo (which waits for the slow learner at every
outer step) ends its run with — Decoupled DiLoCo vs synchronous DiLoCo.
"""

from __future__ import annotations

from pathlib import Path

from . import report, runs

NAME = "heterogeneity"
SLOWDOWN = "1,1,1,2"
JITTER = 0.1
TARGET_RATIO = 0.6
METHODS = ("decoupled", "sync-diloco")


def sync_spec(ctx: report.Context) -> runs.RunSpec:
    # More snapshots than the other runs: the time to a loss is read off the global model's validation curve.
    return runs.RunSpec("sync-diloco", runs.standard_steps(ctx), seed=0, slowdown=SLOWDOWN, jitter=JITTER,
                        snapshots=ctx.pick(3, 6, 10), label="sync-diloco, one learner 2× slower")


def decoupled_spec(ctx: report.Context, sync_wall_s: float) -> runs.RunSpec:
    """Decoupled gets the synchronous run's wall time (plus a start-up allowance) and more steps than it can use:
    the fast learners keep training instead of stopping at the slow one's step count."""
    minutes = round((1.2 * sync_wall_s + 30.0) / 60.0, 2)
    return runs.RunSpec("decoupled", 3 * runs.standard_steps(ctx), seed=0, slowdown=SLOWDOWN, jitter=JITTER,
                        snapshots=ctx.pick(3, 6, 10), minutes=minutes, label="decoupled, one learner 2× slower")


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
    summaries = {"sync-diloco": runs.ensure(ctx, sync_spec(ctx))}
    task.advance()
    summaries["decoupled"] = runs.ensure(ctx, decoupled_spec(ctx, summaries["sync-diloco"]["wall_time_s"]))
    task.advance()
    task.done()
    curves = {m: runs.val_curve(summaries[m]) for m in METHODS}
    finals = {m: s["val_loss"] for m, s in summaries.items()}
    # The target is what synchronous DiLoCo reaches in its run; Decoupled has as much wall time to get there.
    level = finals["sync-diloco"]
    times = {m: time_to(curves[m], level) for m in METHODS}
    fig = result["figures"]
    fig.update({"slowdown": SLOWDOWN, "jitter": JITTER, "target_loss": level, "time_to_target_s": times,
                "final_val_loss": finals, "steps_per_learner": {m: s["steps_trained"] / 4 for m, s in summaries.items()},
                "curves": {m: dict(zip(("time_s", "tokens", "val_loss"), c)) for m, c in curves.items()},
                "wall_time_s": {m: s["wall_time_s"] for m, s in summaries.items()},
                "tokens_per_s": {m: runs.learner_tokens_per_s(s) for m, s in summaries.items()},
                "runs": {m: s["run_dir"] for m, s in summaries.items()}})
    ratio = times["decoupled"] / times["sync-diloco"] if times["decoupled"] and times["sync-diloco"] else None
    fig["ratio"] = ratio
    t = result["table"]
    t["title"] = (f"heterogeneity — learner speeds {SLOWDOWN} (±{100 * JITTER:.0f}% jitter), target: sync DiLoCo's "
                  f"final val loss {level:.4f}")
    t["columns"] = ["method", "time to target", "× sync DiLoCo", "final val loss", "steps per learner (mean)",
                    "tokens/s"]
    for m in METHODS:
        t["rows"].append([m, f"{times[m]:.0f} s" if times[m] else "-",
                          f"{times[m] / times['sync-diloco']:.2f}" if times[m] and times["sync-diloco"] else "-",
                          f"{finals[m]:.4f}", f"{fig['steps_per_learner'][m]:.0f}", f"{fig['tokens_per_s'][m]:,.0f}"])
    report.target(result, "decoupled vs sync DiLoCo, one slow learner", f"≤ {TARGET_RATIO}× the synchronous time "
                  "to the target loss", f"{ratio:.2f}×" if ratio else "not reached",
                  None if ratio is None else ratio <= TARGET_RATIO,
                  "Decoupled never reached it within the synchronous run's wall time (+20%)" if ratio is None else
                  "" if ratio <= TARGET_RATIO else
                  "per token Decoupled learns less than sync DiLoCo at this size (see quality), eating into its "
                  "speed; the slow learner only sleeps, freeing CPU the others use (2 shared cores), so sync "
                  "DiLoCo loses less than on real hardware; eval points are interpolated")
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
    a.annotate("target: sync DiLoCo's final loss", (0.02, fig_data["target_loss"]), xycoords=("axes fraction", "data"), fontsize=8,
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
