"""Syncer recovery (issue 12): 3 learners, the syncer SIGKILLed every 15 s, 6 kills
(`chaos/examples/syncer-dies-every-15s.yaml`), once restarted from scratch (`--no-syncer-standby`, the baseline) and
once with the warm standby (the default), one right after the other on the same machine.

Reported for each: kill → serving and kill → first merge (median, max), the merged fraction of trained steps, system
uptime (goodput.py's definition) and the same uptime with a fixed 6 s stall threshold (the default threshold grows
with the gaps between merges, i.e. with the machine's load); and the standby run's ratios to the baseline."""

from __future__ import annotations

import datetime
import json
import re
import statistics
from pathlib import Path
from typing import NamedTuple

from diloco_chaos import goodput as chaos_goodput
from diloco_trainer.protocol.chaos_record import read_record
from diloco_trainer.runtime.rundir import read_jsonl

from . import report, runs
from .companions import ChaosCompanion

NAME = "syncer_recovery"
EXPERIMENT = report.REPO / "chaos" / "examples" / "syncer-dies-every-15s.yaml"
LEARNERS = 3
STEPS = 100_000  # more than a run can train: the time budget ends both runs at the same wall time
MINUTES = (1.5, 2.5, 3.5)  # start-up included; the schedule's 6 kills need ~100 s once the learners train
FIXED_STALL_S = 6.0
TARGET_SERVING_S = 2.0
TARGET_MERGED = 0.85
TARGET_UPTIME = 0.90


def spec(ctx: report.Context, standby: bool) -> runs.RunSpec:
    extra = ("--log-every", "1") + (() if standby else ("--no-syncer-standby",))
    return runs.RunSpec("decoupled", STEPS, seed=0, learners=LEARNERS, minutes=ctx.pick(*MINUTES),
                        eval_batches=ctx.pick(4, 8, 16), snapshots=1, extra=extra,
                        label="syncer killed every 15 s: " + ("warm standby" if standby else "cold restart"))


def _stamp(line: str) -> float | None:
    m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line)
    return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


class Kill(NamedTuple):
    """One syncer fault of a chaos record: the process it hit (`syncer`, or `syncer-<i>` for shard i of a sharded
    run: runtime/shards.py) and when (unix time)."""

    unit: str
    at: float


def recovery_times(run_dir: Path, kills: list[Kill]) -> dict:
    """Seconds from each kill to the next serving and to the next merge of the syncer (or shard) it hit.

    Serving: RUN/<unit>/incarnations.jsonl, or, for runs of syncers older than it, the "state loaded" lines of
    RUN/logs/<unit>.log (listening follows within milliseconds). Merges: that log's "merged N contributions" lines
    (a shard merges only its own fragments: the others' merges say nothing about its recovery)."""
    events = {unit: _serving_and_merges(run_dir, unit) for unit in sorted({k.unit for k in kills})}
    out = {"to_serving_s": [], "to_merge_s": []}
    for k in kills:
        serving, merges = events[k.unit]
        if (s := next((t for t in serving if t > k.at), None)) is not None:
            out["to_serving_s"].append(s - k.at)
        if (m := next((t for t in merges if t > k.at), None)) is not None:
            out["to_merge_s"].append(m - k.at)
    return out


def _serving_and_merges(run_dir: Path, unit: str) -> tuple[list[float], list[float]]:
    log_path = run_dir / "logs" / f"{unit}.log"
    log = log_path.read_text().splitlines() if log_path.exists() else []
    incarnations = run_dir / unit / "incarnations.jsonl"
    if incarnations.exists():
        serving = sorted(r["serving_at"] for r in read_jsonl(incarnations))
    else:
        serving = sorted(t for line in log if "state loaded" in line and (t := _stamp(line)) is not None)
    merges = sorted(t for line in log if "merged" in line and "contributions" in line and (t := _stamp(line)))
    return serving, merges


def kills_of(record: Path) -> list[Kill]:
    """The syncer faults a chaos record says were injected (dry runs and faults of learners left out)."""
    return [Kill(e.unit or "syncer", e.back_at) for e in read_record(record)
            if e.event == "fault" and not e.dry_run and (e.role or "syncer") == "syncer"]


def _stats(xs: list[float]) -> dict | None:
    return {"median": statistics.median(xs), "max": max(xs), "n": len(xs), "all": xs} if xs else None


def _measure(ctx: report.Context, standby: bool) -> dict:
    s = spec(ctx, standby)
    root = ctx.out_dir / "runs"
    root.mkdir(parents=True, exist_ok=True)
    record = root / f"{s.key}-chaos.jsonl"
    summary = runs.ensure(ctx, s, companion=ChaosCompanion(EXPERIMENT, record, root / f"{s.key}-chaos.log"))
    run_dir = root / s.key
    kills = kills_of(record)
    times = recovery_times(run_dir, kills)
    g = chaos_goodput.from_run_dir(run_dir)
    fixed = chaos_goodput.from_run_dir(run_dir, stall_threshold_s=FIXED_STALL_S)
    usage = json.loads((run_dir / runs.USAGE).read_text()) if (run_dir / runs.USAGE).exists() else {}
    return {"standby": standby, "kills": len(kills), "to_serving_s": _stats(times["to_serving_s"]),
            "to_merge_s": _stats(times["to_merge_s"]), "merged_fraction": summary.get("merged_fraction"),
            "uptime": g.get("uptime"), "stall_threshold_s": g.get("stall_threshold_s"),
            "uptime_fixed": fixed.get("uptime"), "goodput": g.get("goodput"),
            "load": [usage.get("load_before", [None])[0], usage.get("load_after", [None])[0]]}


def run(ctx: report.Context) -> dict:
    result = report.new_result(NAME, ctx.mode)
    task = ctx.task("syncer recovery runs", 2)
    cold = _measure(ctx, standby=False)
    task.advance()
    warm = _measure(ctx, standby=True)
    task.done()
    result["figures"] = {"cold": cold, "standby": warm, "experiment": str(EXPERIMENT.relative_to(report.REPO)),
                         "fixed_stall_s": FIXED_STALL_S}
    _summarize(result, cold, warm)
    plot(result, ctx.out_dir / f"{NAME}.png")
    return result


def _fmt(st: dict | None) -> str:
    return f"{st['median']:.2f} s / {st['max']:.2f} s" if st else "-"


def _pct(x: float | None) -> str:
    return f"{100 * x:.1f}%" if x is not None else "-"


def _summarize(result: dict, cold: dict, warm: dict) -> None:
    for name, f in (("cold restart", cold), ("warm standby", warm)):
        result["notes"].append(
            f"{name}: {f['kills']} kills; kill → serving {_fmt(f['to_serving_s'])}, kill → first merge "
            f"{_fmt(f['to_merge_s'])} (median / max); merged {_pct(f['merged_fraction'])}; uptime {_pct(f['uptime'])} "
            f"(stalls > {f['stall_threshold_s'] or 0:.1f} s), {_pct(f['uptime_fixed'])} (stalls > {FIXED_STALL_S:g} s); "
            f"load {f['load'][0]}..{f['load'][1]}")
    if cold["to_serving_s"] and warm["to_serving_s"]:
        result["notes"].append(f"standby / cold: kill → serving median "
                               f"{warm['to_serving_s']['median'] / cold['to_serving_s']['median']:.3f}×")
    serving = warm["to_serving_s"]
    report.target(result, "syncer killed every 15 s: serving again", f"≤ {TARGET_SERVING_S:g} s",
                  _fmt(serving) + f" (cold: {_fmt(cold['to_serving_s'])})",
                  serving["max"] <= TARGET_SERVING_S if serving else None)
    report.target(result, "syncer killed every 15 s: trained steps merged", f"≥ {100 * TARGET_MERGED:.0f}%",
                  f"{_pct(warm['merged_fraction'])} (cold: {_pct(cold['merged_fraction'])})",
                  warm["merged_fraction"] >= TARGET_MERGED if warm["merged_fraction"] is not None else None)
    report.target(result, "syncer killed every 15 s: system uptime", f"≥ {100 * TARGET_UPTIME:.0f}%",
                  f"{_pct(warm['uptime'])}; {_pct(warm['uptime_fixed'])} with {FIXED_STALL_S:g} s stalls "
                  f"(cold: {_pct(cold['uptime'])}; {_pct(cold['uptime_fixed'])})",
                  warm["uptime"] >= TARGET_UPTIME if warm["uptime"] is not None else None,
                  why="uptime also counts gaps between merges on a loaded machine; compare with the cold run")


def plot(result: dict, path: Path) -> Path:
    """Left: kill → serving and kill → first merge, median and max, cold vs standby. Right: merged and uptime."""
    fig, (a, b) = report.figure(2, 1, width=6.0, height=4.2)
    f = result["figures"]
    rows = [("cold", f["cold"]), ("standby", f["standby"])]
    labels, med, top = [], [], []
    for name, r in rows:
        for key, what in (("to_serving_s", "serving"), ("to_merge_s", "first merge")):
            st = r[key] or {"median": 0.0, "max": 0.0}
            labels.append(f"{name}: {what}")
            med.append(st["median"])
            top.append(st["max"])
    y = list(range(len(labels)))
    a.barh(y, top, color="#cccccc", label="max")
    a.barh(y, med, color=report.color("decoupled"), label="median")
    a.set_yticks(y, labels)
    a.invert_yaxis()
    a.set_xlabel("seconds after the kill")
    a.legend(fontsize=7, loc="lower right")
    a.set_title("syncer recovery", fontsize=10)
    xs = range(3)
    width = 0.38
    for i, (name, r) in enumerate(rows):
        vals = [100 * (r[k] or 0.0) for k in ("merged_fraction", "uptime", "uptime_fixed")]
        bars = b.bar([x + (i - 0.5) * width for x in xs], vals, width,
                     color=report.color("sync-diloco" if name == "cold" else "decoupled"), label=name)
        report.bar_labels(b, bars, "{:.0f}")
    b.set_xticks(list(xs), ["merged", "uptime", f"uptime ({FIXED_STALL_S:g} s)"])
    b.set_ylabel("%")
    b.set_ylim(0, 110)
    b.legend(fontsize=7)
    b.set_title("6 kills, 15 s apart", fontsize=10)
    return report.save(fig, path, "Syncer killed every 15 s: cold restart vs warm standby", report.footnote(result))
