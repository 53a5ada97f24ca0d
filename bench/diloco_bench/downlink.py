"""Down-link: what a learner receives per inner step against what it sends, for each `outer.downlink` (fp32 whole
fragment versions; int4 / int2 quantized updates it rebuilds bit-identically), and the loss each costs, in short
real `diloco local` runs paired by seed. DDP receives what it sends: 2·(N−1)/N · 4 B · params per step.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from diloco_trainer.config import OuterConfig

from . import report, runs
from .bandwidth import report_bytes

NAME = "downlink"
DOWNLINKS = ("fp32", "int4", "int2")
TARGET_RATIO = 1.1  # bytes received per learner step ≤ 1.1 × bytes sent
TARGET_LOSS = 0.005  # ≤ 0.5% extra validation loss vs the fp32 down-link
COLORS = {"fp32": "#8c564b", "int4": report.color("int4"), "int2": "#2ca02c"}


def specs(ctx: report.Context) -> list[tuple[str, runs.RunSpec]]:
    """One Decoupled run per down-link and seed; the config's default down-link's runs are quality's (shared)."""
    default = OuterConfig().downlink
    out = []
    for seed in range(runs.seeds(ctx)):
        for dl in DOWNLINKS:
            sets = () if dl == default else (f"outer.downlink={dl}",)
            out.append((dl, runs.RunSpec("decoupled", runs.standard_steps(ctx), seed=seed, sets=sets,
                                         label=f"decoupled downlink {dl} seed {seed}")))
    return out


def run(ctx: report.Context) -> dict:
    result = report.new_result(NAME, ctx.mode)
    measured: dict[str, list[dict]] = {dl: [] for dl in DOWNLINKS}
    if ctx.mode != "tiny":
        todo = specs(ctx)
        task = ctx.task("downlink: runs", len(todo))
        for dl, spec in todo:
            s = runs.ensure(ctx, spec)
            steps = s["steps_trained"] or 1
            measured[dl].append({"seed": spec.seed, "val_loss": s["val_loss"], "run": s["run_dir"],
                                 "up_per_step": s["bytes"].get("sent_per_learner_step") or 0.0,
                                 "down_per_step": runs.bytes_down(s) / steps,
                                 "ddp_per_step": s["bytes"].get("ddp_per_learner_step")})
            task.advance()
        task.done()
    result["figures"]["runs"] = measured
    _summarize(result, measured)
    plot(result, ctx.out_dir / f"{NAME}.png")
    return result


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def _summarize(result: dict, measured: dict[str, list[dict]]) -> None:
    base = {m["seed"]: m["val_loss"] for m in measured["fp32"] if m["val_loss"] is not None}
    cost = {}
    for dl, rows in measured.items():
        rel = [(m["val_loss"] - base[m["seed"]]) / base[m["seed"]] for m in rows
               if m["seed"] in base and m["val_loss"] is not None]
        if rel:
            cost[dl] = report.spread(rel)
    result["figures"]["loss_cost"] = cost
    t = result["table"]
    t["title"] = "down-link — bytes per learner per inner step, received vs sent (bench model, N=4)"
    t["columns"] = ["outer.downlink", "sent", "received", "received / sent", "val loss", "vs fp32 (paired by seed)"]
    for dl, rows in measured.items():
        up, down = _mean(rows, "up_per_step"), _mean(rows, "down_per_step")
        c = cost.get(dl)
        t["rows"].append([dl, report_bytes(up), report_bytes(down), f"{down / up:.2f}×" if up and down else "-",
                          f"{_mean(rows, 'val_loss'):.4f}" if rows else "-",
                          (f"{100 * c['mean']:+.2f}%" + (f" ± {100 * c['std']:.2f}" if c["n"] > 1 else ""))
                          if c and dl != "fp32" else "-"])
    for dl in DOWNLINKS[1:]:
        rows = measured[dl]
        up, down = _mean(rows, "up_per_step"), _mean(rows, "down_per_step")
        if not (up and down):
            report.target(result, f"{dl} down-link bytes", f"received ≤ {TARGET_RATIO}× sent", "not run", None,
                          "tiny mode runs no training")
            continue
        report.target(result, f"{dl} down-link bytes", f"received ≤ {TARGET_RATIO}× sent", f"{down / up:.2f}×",
                      down / up <= TARGET_RATIO)
        c = cost.get(dl)
        if c is not None:
            report.target(result, f"{dl} down-link loss cost", f"≤ {100 * TARGET_LOSS:.1f}% extra val loss vs fp32",
                          f"{100 * c['mean']:+.2f}% (seeds: {', '.join(f'{100 * v:+.2f}%' for v in c['values'])})",
                          report.decide(c, TARGET_LOSS), "paired by seed")


def plot(result: dict, path: Path) -> Path:
    measured, cost = result["figures"]["runs"], result["figures"]["loss_cost"]
    fig, (a, b) = report.figure(2, 1, width=5.6, height=4.4)
    dls = [dl for dl in DOWNLINKS if measured.get(dl)]
    if not dls:
        for ax in (a, b):
            ax.text(0.5, 0.5, "no training runs in this mode", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
        return report.save(fig, path, "Down-link: bytes received vs sent", report.footnote(result))
    x = list(range(len(dls)))
    ups = [_mean(measured[dl], "up_per_step") for dl in dls]
    downs = [_mean(measured[dl], "down_per_step") for dl in dls]
    ddp = _mean(measured[dls[0]], "ddp_per_step")
    bu = a.bar([i - 0.2 for i in x], ups, 0.4, color=[COLORS[dl] for dl in dls], label="sent (up)")
    bd = a.bar([i + 0.2 for i in x], downs, 0.4, color="white", edgecolor=[COLORS[dl] for dl in dls],
               hatch="..", label="received (down)")
    for bars in (bu, bd):
        for bar in bars:
            a.annotate(report_bytes(bar.get_height()), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                       ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    if ddp:
        a.axhline(ddp, color=report.color("ddp"), lw=2)
        a.annotate(f"DDP {report_bytes(ddp)} each way", (0.02, ddp), xycoords=("axes fraction", "data"), fontsize=8,
                   va="bottom")
    a.set_yscale("log")
    a.set_xticks(x, [f"{dl}\n{d / u:.2f}× sent" if u and d else dl for dl, u, d in zip(dls, ups, downs)])
    a.set_ylabel("bytes per learner per inner step (log)")
    a.set_title(f"measured: target received ≤ {TARGET_RATIO}× sent")
    a.legend(fontsize=7, loc="lower left")
    a.margins(y=0.3)
    shown = [dl for dl in dls if dl in cost and dl != "fp32"]
    if shown:
        bars = b.bar(shown, [100 * cost[dl]["mean"] for dl in shown], yerr=[100 * cost[dl]["std"] for dl in shown],
                     capsize=4, color=[COLORS[dl] for dl in shown])
        for dl, bar in zip(shown, bars):
            for v in cost[dl]["values"]:
                b.plot(bar.get_x() + bar.get_width() / 2, 100 * v, "k.", ms=5)
        b.axhline(100 * TARGET_LOSS, color="k", ls=":", lw=1)
        b.axhline(0, color="#444444", lw=0.8)
        b.set_ylabel("val loss change vs fp32 down-link (%)")
        b.set_title(f"loss cost ({max(cost[dl]['n'] for dl in shown)} seed(s), dots = seeds)")
    else:
        b.text(0.5, 0.5, "no fp32 pair to compare with", ha="center", va="center", transform=b.transAxes)
        b.set_axis_off()
    return report.save(fig, path, "Down-link: bytes a learner receives vs sends, and what compression costs",
                       report.footnote(result))
