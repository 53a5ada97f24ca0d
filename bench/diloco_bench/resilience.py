"""Resilience: each learner killed on average every ~60 s (Poisson, per learner) and restarted. Throughput and goodput
of each method as a fraction of its own failure-free run (quality's seed-0 runs of the same length).

Decoupled: `diloco chaos run` (an mtbf experiment) against the live `diloco local` run; its supervisor restarts the
victim (on a warm spare). Synchronous baselines: the same seeded schedule (`diloco_chaos.inject.schedule`) kills the
same-named worker; the job restarts all its workers from its last checkpoint (`diloco baseline --max-restarts`,
checkpoints every H steps, as torchrun would), so it loses the steps since that checkpoint plus a restart.

Beside it, the harsh schedule of issue 11 (`harsh.py`): 3 learners, a kill every ~20 s pooled, ≥ 3 seeds, with
where the seconds of each kill go (`kill_cost.py`).

Both figures count from the first training step to the last (the one-time launch, the same for every method, left
out): tokens/s trained, and goodput-weighted tokens/s — tokens that reached the final model (Decoupled: merged by
the syncer; synchronous: not thrown away by a restart) per second.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import yaml

from diloco_chaos import goodput as chaos_goodput
from diloco_chaos.inject.experiment import parse_experiment
from diloco_chaos.inject.record import summarize
from diloco_chaos.inject.schedule import Schedule
from diloco_trainer.protocol.chaos_record import read_record
from diloco_trainer.protocol.messages import ProcessEntry, ProcessesDoc, SyncerSample
from diloco_trainer.protocol.runfiles import read_events
from diloco_trainer.runtime.rundir import metrics_records, read_jsonl

from . import harsh, quality, report, restart_state, runs
from .companions import ChaosCompanion, training_started

NAME = "resilience"
MTBF_S = 60.0  # the schedule
QUICK_MTBF_S = 40.0  # --quick runs train ~40 s: a shorter clock so that some kills happen at all
# A synchronous job of N workers fails every MTBF/N on average and each whole-job restart costs ~15 s here: below
# an MTBF of ~60 s it barely progresses (measured at 20 s: no step in 4 min). Its chaos runs are capped so that
# --quick stays quick; a capped run reports what it trained by then.
CHAOS_MINUTES = (3.0, 3.0, 20.0)


def mtbf_s(ctx: report.Context) -> float:
    return ctx.pick(QUICK_MTBF_S, QUICK_MTBF_S, MTBF_S)
TARGET_KEEP = 0.90


def experiment(seed: int, mtbf: float = MTBF_S) -> dict:
    """The chaos experiment: every learner on its own Poisson clock (MTBF 60 s), killed, restarted by the runtime."""
    return {"name": "bench-resilience", "description": f"each learner killed on average every {mtbf:g}s",
            "schedule": {"mtbf": f"{mtbf:g}s", "seed": seed}, "target": {"kind": "learner"},
            "action": {"type": "kill"},
            "safety": {"minAliveUnits": 1, "maxConcurrent": 3, "maxDuration": "1h", "recoveryTimeout": "90s"}}


class BaselineKiller:
    """The same seeded MTBF schedule against a synchronous baseline's workers: SIGKILL to the scheduled victim
    (its PID checked against its command line, as `diloco chaos` does). Faults are appended to `record`."""

    def __init__(self, exp: dict, record: Path):
        self.spec = parse_experiment(exp).schedule
        self.record = record
        self.schedule: Schedule | None = None

    def tick(self, run_dir: Path) -> None:
        procs_doc = _processes(run_dir)
        workers = {p.name: p for p in procs_doc if p.role == "learner"}
        if self.schedule is None:
            if workers and training_started(run_dir):
                self.schedule = Schedule(self.spec, time.time(), sorted(workers))
            return
        alive = sorted(n for n, p in workers.items() if p.alive)
        for tick in self.schedule.due(time.time(), alive):
            p = workers[tick.unit]
            pid = p.pid or 0
            rank = p.rank if p.rank is not None else tick.unit.rsplit("-", 1)[-1]
            if pid and _cmdline_has(pid, f"--rank {rank}"):
                os.kill(pid, signal.SIGKILL)
                _append(self.record, {"event": "fault", "time": time.time(), "unit": tick.unit, "pid": pid,
                                      "action": "kill", "why": tick.why})

    def close(self) -> None:
        pass


def _processes(run_dir: Path) -> list[ProcessEntry]:
    try:
        return ProcessesDoc.model_validate_json((run_dir / "processes.json").read_text()).processes
    except (FileNotFoundError, ValueError):
        return []


def _cmdline_has(pid: int, needle: str) -> bool:
    try:
        return needle.encode() in b" ".join(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
    except OSError:
        return False


def _append(path: Path, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def chaos_spec(ctx: report.Context, method: str) -> runs.RunSpec:
    steps = runs.standard_steps(ctx)
    extra = () if method == "decoupled" else (
        "--max-restarts", "1000", "--checkpoint-every", str(runs.BENCH_CONFIG["outer"]["sync_every"]))
    return runs.RunSpec(method, steps, seed=0, kill_every_s=mtbf_s(ctx), extra=extra, minutes=ctx.pick(*CHAOS_MINUTES),
                        label=f"{method} under chaos")


def run(ctx: report.Context) -> dict:
    result = report.new_result(NAME, ctx.mode)
    methods = ["decoupled", "sync-diloco", "ddp"]
    exp = experiment(seed=7, mtbf=mtbf_s(ctx))
    root = ctx.out_dir / "runs"
    root.mkdir(parents=True, exist_ok=True)
    exp_path = root / "resilience-experiment.yaml"
    exp_path.write_text(yaml.safe_dump(exp, sort_keys=False))
    task = ctx.task("resilience runs", 2 * len(methods))
    figures = {}
    for method in methods:
        ff = runs.ensure(ctx, quality.spec(ctx, method, 0))
        task.advance()
        spec = chaos_spec(ctx, method)
        record = root / f"{spec.key}-chaos.jsonl"
        if method == "decoupled":
            companion = ChaosCompanion(exp_path, record, root / f"{spec.key}-chaos.log")
        else:
            companion = BaselineKiller(exp, record)
        ch = runs.ensure(ctx, spec, companion=companion, allow_failure=method != "decoupled")
        task.advance()
        figures[method] = _measure(method, ff, ch, record)
    task.done()
    if runs.seeds(ctx) > 1:  # noise floor: two failure-free runs of the same method (quality's seeds 0 and 1)
        for method in methods:
            other = runs.rates(runs.ensure(ctx, quality.spec(ctx, method, 1)))
            figures[method]["failure_free_repeat_ratio"] = other["useful_per_s"] / \
                figures[method]["failure_free"]["useful_per_s"]
    result["figures"] = {"mtbf_s": mtbf_s(ctx), "experiment": exp, "methods": figures,
                         "steps_per_learner": runs.standard_steps(ctx)}
    ddp_ff = runs.ensure(ctx, quality.spec(ctx, "ddp", 0))["val_loss"]
    _summarize(result, ddp_ff)
    plot(result, ctx.out_dir / f"{NAME}.png")
    result["figures"]["harsh"] = h = harsh.measure(ctx)  # issue 11: a kill every ~20 s pooled
    harsh.summarize(result, h)
    harsh.plot(h, ctx.out_dir / f"{NAME}_harsh.png", report.footnote(result))
    result["figures"]["restart_state"] = rs = restart_state.measure(ctx)
    result["notes"].append("what a restarted learner loses with its inner state: " + restart_state.describe(rs))
    return result


def _faults(record: Path) -> list[dict]:
    return [e.model_dump(exclude_none=True) for e in read_record(record) if e.event == "fault"]


def _measure(method: str, ff: dict, ch: dict, record: Path) -> dict:
    """Failure-free vs chaos figures of one method, from the two runs' summaries and the fault record."""
    out = {"failure_free": runs.rates(ff), "chaos": runs.rates(ch), "faults": _faults(record),
           "chaos_run": ch["run_dir"], "failure_free_run": ff["run_dir"]}
    out["keep_tokens_per_s"] = out["chaos"]["tokens_per_s"] / out["failure_free"]["tokens_per_s"]
    out["keep_goodput"] = out["chaos"]["useful_per_s"] / out["failure_free"]["useful_per_s"] \
        if out["failure_free"]["useful_per_s"] else None
    out["finished"] = ch.get("val_loss") is not None and "every learner finished" in str(ch.get("stop_reason"))
    if method == "decoupled":
        out["recovery"] = summarize(read_record(record))
        out["uptime"] = chaos_goodput.from_run_dir(ch["run_dir"]).get("uptime")
    else:
        out["job_restarts"] = [e.model_dump(exclude_defaults=True) for e in read_events(Path(ch["run_dir"]))
                               if e.event == "job_restart"]
    return out


def _summarize(result: dict, ddp_loss: float | None) -> None:
    m = result["figures"]["methods"]
    d = m["decoupled"]
    t = result["table"]
    t["title"] = (f"resilience — each learner killed on average every {result['figures']['mtbf_s']:g} s, restarted "
                  f"({len(d['faults'])} kills in the decoupled run)")
    t["columns"] = ["method", "failure-free tokens/s", "under chaos", "kept (tokens/s)", "kept (goodput)",
                    "final val loss", "what happened"]
    rc = d.get("recovery") or {}
    for method in ("decoupled", "sync-diloco", "ddp"):
        s = m[method]
        if method == "decoupled":
            what = (f"{len(s['faults'])} kills, trained again {rc.get('trained_again_s_median') or 0:.1f} s after a "
                    "kill (median)")
        else:
            restarts = s["job_restarts"]
            lost = sum(int(e.get("lost_steps", 0)) for e in restarts)
            what = (f"{len(s['faults'])} kills, {len(restarts)} whole-job restarts from checkpoints, {lost} "
                    f"learner steps redone" + ("" if s["finished"] else f"; {s['chaos']['stop_reason']}"))
        t["rows"].append([method, f"{s['failure_free']['tokens_per_s']:,.0f}", f"{s['chaos']['tokens_per_s']:,.0f}",
                          f"{100 * s['keep_tokens_per_s']:.0f}%",
                          f"{100 * s['keep_goodput']:.0f}%" if s.get("keep_goodput") is not None else "-",
                          f"{s['chaos']['val_loss']:.4f} (ff {s['failure_free']['val_loss']:.4f})"
                          if s["chaos"]["val_loss"] is not None else "no model", what])
    repeat = {k: v["failure_free_repeat_ratio"] for k, v in m.items() if "failure_free_repeat_ratio" in v}
    if repeat:
        result["notes"].append("run-to-run noise: a second failure-free run (seed 1) made "
                               + ", ".join(f"{k} {100 * v:.0f}%" for k, v in repeat.items())
                               + " of the seed-0 useful tokens/s")
    if not d["faults"]:
        result["notes"].append("no learner was killed during the decoupled run (too short for the schedule)")
    keep = d["keep_goodput"] if d.get("keep_goodput") is not None else d["keep_tokens_per_s"]
    met = (d["keep_tokens_per_s"] >= TARGET_KEEP and keep >= TARGET_KEEP) if d["faults"] else None
    report.target(result, "decoupled keeps its throughput", f"≥ {100 * TARGET_KEEP:.0f}% of its failure-free run",
                  f"tokens/s {100 * d['keep_tokens_per_s']:.0f}%, goodput {100 * keep:.0f}% "
                  f"({len(d['faults'])} kills)", met,
                  "" if met else
                  f"a killed learner's unsent work is lost (up to H steps per fragment) and it is out for "
                  f"{rc.get('trained_again_s_median') or 0:.1f} s (median, warm spare); with 4 learners on 2 cores a "
                  "dead learner's CPU goes to the others")
    syncs = {n: m[n] for n in ("sync-diloco", "ddp")}
    worst = max((x["keep_goodput"] or 0.0) for x in syncs.values())
    killed = all(x["faults"] for x in syncs.values())
    report.target(result, "synchronous methods lose far more", "measured under the same schedule",
                  "; ".join(f"{n} keeps {100 * (x['keep_goodput'] or 0):.0f}% ({len(x['job_restarts'])} job "
                            "restarts)" for n, x in syncs.items()),
                  (worst < keep) if killed else None,
                  "" if killed else "a run ended before the schedule killed one of its workers")
    if ddp_loss and d["chaos"]["val_loss"]:
        rel = (d["chaos"]["val_loss"] - ddp_loss) / ddp_loss
        report.target(result, "final loss under chaos", "within the quality target (2% of DDP)",
                      f"{100 * rel:+.2f}% vs failure-free DDP", rel <= quality.TARGET_VS_DDP,
                      "" if rel <= quality.TARGET_VS_DDP else "see quality: the failure-free gap already exceeds it")


def _model_progress(method: str, summary: dict) -> tuple[list[float], list[float], float]:
    """(seconds since training began, thousand tokens in the global model) of one run, and when training began.

    Decoupled: tokens the syncer merged (counted once per fragment, so divided by P). Synchronous: the step rank 0
    reports × workers × tokens per step (a job restart takes it back to its checkpoint)."""
    run_dir = Path(summary["run_dir"])
    span = runs.training_span(summary)
    t0 = span[0] if span else 0.0
    xs, ys = [], []
    if method == "decoupled":
        fragments = runs.BENCH_CONFIG["outer"]["fragments"]
        for line in read_jsonl(run_dir / "syncer.jsonl"):
            sample = SyncerSample.from_line(line)
            if sample.status is not None:
                xs.append(sample.time - t0)
                ys.append(sample.status.tokens_merged / fragments / 1e3)
    else:
        for r in metrics_records(run_dir / "learners" / "learner-0" / "metrics.jsonl"):
            xs.append(r.time - t0)
            ys.append(r.tokens * 4 / 1e3)
    return xs, ys, t0


def plot(result: dict, path: Path) -> Path:
    m = result["figures"]["methods"]
    fig, (a, b) = report.figure(2, 1, width=6.4, height=4.4)
    names = ["decoupled", "sync-diloco", "ddp"]
    trained = [m[n]["keep_tokens_per_s"] for n in names]
    useful = [m[n].get("keep_goodput") or 0.0 for n in names]
    x = range(len(names))
    b1 = a.bar([i - 0.2 for i in x], [100 * v for v in trained], 0.4, label="tokens/s trained",
               color=[report.color(n) for n in names], alpha=0.5)
    b2 = a.bar([i + 0.2 for i in x], [100 * v for v in useful], 0.4, label="goodput: tokens/s kept in the model",
               color=[report.color(n) for n in names])
    for bars in (b1, b2):
        report.bar_labels(a, bars, "{:.0f}%")
    a.axhline(100 * TARGET_KEEP, color="k", ls=":", lw=1)
    a.annotate(f"target {100 * TARGET_KEEP:.0f}%", (0.5, 100 * TARGET_KEEP), xycoords=("axes fraction", "data"),
               fontsize=8, va="center", ha="center", bbox={"boxstyle": "round", "fc": "white", "ec": "none"})
    a.set_xticks(list(x), names)
    a.set_ylabel("% of the method's own failure-free run")
    a.set_ylim(0, 140)
    a.set_yticks(range(0, 125, 20))
    a.set_title(f"each learner killed every ~{result['figures']['mtbf_s']:g} s on average", fontsize=10)
    a.legend(fontsize=7, loc="upper right")

    for name in names:
        xs, ys, t0 = _model_progress(name, {"run_dir": m[name]["chaos_run"]})
        xs, ys = [x for x in xs if x >= 0], [y for x, y in zip(xs, ys) if x >= 0]
        b.plot(xs, ys, "-", lw=1.5, color=report.color(name), label=f"{name} ({len(m[name]['faults'])} kills)")
        for e in m[name]["faults"]:
            at = float(e["time"]) - t0
            b.plot([at], [_at(xs, ys, at)], "x", color=report.color(name), ms=6)
    b.set_xlabel("seconds since training began (x: a kill)")
    b.set_ylabel("thousand tokens in the global model")
    b.set_title("under chaos (synchronous jobs restart from checkpoints)", fontsize=10)
    b.legend(fontsize=7)
    return report.save(fig, path, "Resilience: throughput kept under failures, vs each method's failure-free run",
                       report.footnote(result))


def _at(xs: list[float], ys: list[float], x: float) -> float:
    """The last y at or before x (0 before the first point)."""
    y = 0.0
    for xi, yi in zip(xs, ys):
        if xi > x:
            break
        y = yi
    return y
