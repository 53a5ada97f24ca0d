"""Resilience: each learner killed on average every ~60 s (Poisson, per learner) and restarted. Throughput and goodput
of each method as a fraction of its own failure-free run (quality's seed-0 runs of the same length).

Decoupled: `diloco chaos run` (an mtbf experiment) against the live `diloco local` run; its supervisor restarts the
victim. Synchronous baselines: the same seeded schedule (`diloco_chaos.schedule`) kills the same-named worker; a
synchronous job cannot lose a worker, so it stops. What a checkpoint-restart would have kept is also given,
modelled from this run's own measurements (labelled as such).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import yaml

from diloco_chaos import goodput as chaos_goodput
from diloco_chaos.experiment import parse_experiment
from diloco_chaos.record import summarize
from diloco_chaos.schedule import Schedule
from diloco_trainer.runtime import procs
from diloco_trainer.runtime.rundir import read_jsonl

from . import quality, report, runs

NAME = "resilience"
MTBF_S = 60.0
TARGET_KEEP = 0.90


def experiment(seed: int) -> dict:
    """The chaos experiment: every learner on its own Poisson clock (MTBF 60 s), killed, restarted by the runtime."""
    return {"name": "bench-resilience", "description": f"each learner killed on average every {MTBF_S:g}s",
            "schedule": {"mtbf": f"{MTBF_S:g}s", "seed": seed}, "target": {"kind": "learner"},
            "action": {"type": "kill"},
            "safety": {"minAliveUnits": 1, "maxConcurrent": 3, "maxDuration": "1h", "recoveryTimeout": "90s"}}


def _training_started(run_dir: Path) -> bool:
    return any(p.stat().st_size > 0 for p in (run_dir / "learners").glob("*/metrics.jsonl"))


class ChaosCompanion:
    """Runs `diloco chaos run EXPERIMENT --run-dir RUN` once the learners train; stops it when the run ends."""

    def __init__(self, exp_path: Path, record: Path, log: Path):
        self.exp_path, self.record, self.log = exp_path, record, log
        self.proc: subprocess.Popen | None = None

    def tick(self, run_dir: Path) -> None:
        if self.proc is None and (run_dir / "processes.json").exists() and _training_started(run_dir):
            with open(self.log, "w") as log:
                self.proc = subprocess.Popen(
                    procs.diloco_argv("chaos", "run", str(self.exp_path), "--run-dir", str(run_dir), "--plain",
                                      "--record", str(self.record)),
                    stdout=log, stderr=subprocess.STDOUT, env=procs.child_env(), cwd=report.REPO)

    def close(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)  # stop injecting; it waits (bounded) for open recoveries
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGINT)  # second Ctrl+C: quit now
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class BaselineKiller:
    """The same seeded MTBF schedule against a synchronous baseline's workers: SIGKILL to the scheduled victim
    (its PID checked against its command line, as `diloco chaos` does). Faults are appended to `record`."""

    def __init__(self, exp: dict, record: Path):
        self.spec = parse_experiment(exp).schedule
        self.record = record
        self.schedule: Schedule | None = None

    def tick(self, run_dir: Path) -> None:
        procs_doc = _processes(run_dir)
        workers = {p["name"]: p for p in procs_doc if p.get("role") == "learner"}
        if self.schedule is None:
            if workers and _training_started(run_dir):
                self.schedule = Schedule(self.spec, time.time(), sorted(workers))
            return
        alive = sorted(n for n, p in workers.items() if p.get("alive"))
        for tick in self.schedule.due(time.time(), alive):
            p = workers[tick.unit]
            pid = int(p.get("pid") or 0)
            if pid and _cmdline_has(pid, f"--rank {p.get('meta', {}).get('rank', tick.unit.rsplit('-', 1)[-1])}"):
                os.kill(pid, signal.SIGKILL)
                _append(self.record, {"event": "fault", "time": time.time(), "unit": tick.unit, "pid": pid,
                                      "action": "kill", "why": tick.why})

    def close(self) -> None:
        pass


def _processes(run_dir: Path) -> list[dict]:
    try:
        return json.loads((run_dir / "processes.json").read_text()).get("processes", [])
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
    return runs.RunSpec(method, steps, seed=0, kill_every_s=MTBF_S, label=f"{method} under chaos")


def run(ctx: report.Context) -> dict:
    result = report.new_result(NAME, ctx.mode)
    methods = ["decoupled", "sync-diloco", "ddp"]
    exp = experiment(seed=7)
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
            other = runs.learner_tokens_per_s(runs.ensure(ctx, quality.spec(ctx, method, 1)))
            figures[method]["failure_free_repeat_ratio"] = other / figures[method]["failure_free"]["tokens_per_s"]
    window = figures["decoupled"]["chaos"]["wall_time_s"]
    for method in methods[1:]:
        _sync_window(figures[method], window, runs.BENCH_CONFIG["outer"]["sync_every"])
    result["figures"] = {"mtbf_s": MTBF_S, "experiment": exp, "methods": figures,
                         "steps_per_learner": runs.standard_steps(ctx)}
    ddp_ff = runs.ensure(ctx, quality.spec(ctx, "ddp", 0))["val_loss"]
    _summarize(result, ddp_ff)
    plot(result, ctx.out_dir / f"{NAME}.png")
    return result


def _faults(record: Path) -> list[dict]:
    return [e for e in read_jsonl(record) if e.get("event") == "fault"]


def _measure(method: str, ff: dict, ch: dict, record: Path) -> dict:
    """Failure-free vs chaos figures of one method, from the two runs' summaries (and chaos goodput)."""
    out = {"failure_free": _basic(ff), "chaos": _basic(ch), "faults": _faults(record),
           "chaos_run": ch["run_dir"], "failure_free_run": ff["run_dir"]}
    if method == "decoupled":
        g_ff = chaos_goodput.from_run_dir(ff["run_dir"])
        g_ch = chaos_goodput.from_run_dir(ch["run_dir"])
        # After start-up: the one-time launch (same in both runs) left out; every restart's start-up counts.
        key = "goodput_after_startup"
        out["failure_free"]["goodput"] = g_ff[key]
        out["chaos"]["goodput"] = g_ch[key]
        out["chaos"]["uptime"] = g_ch.get("uptime")
        out["recovery"] = summarize(read_jsonl(record))
        out["keep_tokens_per_s"] = out["chaos"]["tokens_per_s"] / out["failure_free"]["tokens_per_s"]
        out["keep_goodput"] = (g_ch[key] / g_ff[key]) if g_ff[key] else None
        out["measured"] = True
    return out


def _basic(s: dict) -> dict:
    return {"wall_time_s": s["wall_time_s"], "tokens_trained": s["tokens_trained"],
            "tokens_per_s": runs.learner_tokens_per_s(s), "val_loss": s.get("val_loss"),
            "stop_reason": s.get("stop_reason"), "restarts": s.get("restarts") or {}}


def _startup_s(run_dir: str) -> float | None:
    """Seconds from the first worker start to its first training report, minus the steps that report covers."""
    events = read_jsonl(Path(run_dir) / "events.jsonl")
    starts = [float(e["time"]) for e in events if e.get("event") == "start" and e.get("role", "learner") == "learner"]
    first = []
    for m in (Path(run_dir) / "learners").glob("*/metrics.jsonl"):
        recs = read_jsonl(m)
        if recs:
            r = recs[0]
            first.append(float(r["time"]) - int(r.get("step", 0)) * float(r.get("step_time_s") or 0.0))
    return (min(first) - min(starts)) if starts and first else None


def _sync_window(fig: dict, window_s: float, sync_every: int) -> None:
    """A synchronous job under the same schedule, over the decoupled chaos run's wall time.

    Measured: it stops at its first failure, and without a checkpoint its work is lost. Modelled (labelled):
    restart of the whole job from its last outer step, costing its own measured start-up R per failure plus
    on average H/2 steps of lost work, with job failures at N/MTBF: kept = 1 / (1 + N/MTBF·(R + H/2·step)).
    """
    ff, ch = fig["failure_free"], fig["chaos"]
    fig["window_s"] = window_s
    fig["killed"] = bool(fig["faults"])
    fig["stopped"] = fig["killed"] and ch["val_loss"] is None
    if fig["stopped"]:  # the job ended at the kill: what it trained is lost, and it trains nothing after
        fig["outcome"] = f"stopped by the kill at {ch['wall_time_s']:.0f} s; no model"
        fig["keep_tokens_per_s"] = ch["tokens_trained"] / (ff["tokens_per_s"] * max(window_s, ch["wall_time_s"]))
        fig["keep_useful"] = 0.0
    else:
        fig["outcome"] = "finished despite the kill" if fig["killed"] else "finished before any kill was due"
        fig["keep_tokens_per_s"] = ch["tokens_per_s"] / ff["tokens_per_s"]
        fig["keep_useful"] = fig["keep_tokens_per_s"]
    fig["stopped_after_s"] = ch["wall_time_s"]
    n = 4
    tokens_per_step = runs.BENCH_CONFIG["inner"]["batch_size"] * runs.BENCH_CONFIG["model"]["seq_len"]
    step_s = n * tokens_per_step / ff["tokens_per_s"]  # one synchronous step of all n workers
    restart = _startup_s(fig["failure_free_run"]) or 0.0
    lost = sync_every / 2 * step_s
    keep = 1.0 / (1.0 + n / MTBF_S * (restart + lost))
    fig["modelled"] = {"keep": keep, "restart_s": restart, "lost_work_s": lost, "step_s": step_s,
                       "formula": f"1 / (1 + N/MTBF·(R + H/2·step)) = 1 / (1 + {n}/{MTBF_S:g}·({restart:.1f} + "
                                  f"{lost:.1f})) = {keep:.2f}"}
    fig["measured"] = True


def _summarize(result: dict, ddp_loss: float | None) -> None:
    m = result["figures"]["methods"]
    d = m["decoupled"]
    t = result["table"]
    t["title"] = (f"resilience — each learner killed on average every {MTBF_S:g} s, restarted "
                  f"({len(d['faults'])} kills in the decoupled run)")
    t["columns"] = ["method", "failure-free tokens/s", "under chaos", "kept (tokens/s)", "kept (goodput)",
                    "final val loss", "what happened"]
    rc = d.get("recovery") or {}
    t["rows"].append(["decoupled", f"{d['failure_free']['tokens_per_s']:,.0f}", f"{d['chaos']['tokens_per_s']:,.0f}",
                      f"{100 * d['keep_tokens_per_s']:.0f}%",
                      f"{100 * d['keep_goodput']:.0f}%" if d.get("keep_goodput") is not None else "-",
                      f"{d['chaos']['val_loss']:.4f} (ff {d['failure_free']['val_loss']:.4f})",
                      f"{len(d['faults'])} kills, back training in {rc.get('trained_again_s_median') or 0:.0f} s "
                      "(median)"])
    for method in ("sync-diloco", "ddp"):
        s = m[method]
        t["rows"].append([method, f"{s['failure_free']['tokens_per_s']:,.0f}",
                          f"{s['chaos']['tokens_per_s']:,.0f} until {s['stopped_after_s']:.0f} s",
                          f"{100 * s['keep_tokens_per_s']:.0f}%", f"{100 * s['keep_useful']:.0f}% (modelled "
                          f"checkpoint restart: {100 * s['modelled']['keep']:.0f}%)",
                          "no model" if s["chaos"]["val_loss"] is None else f"{s['chaos']['val_loss']:.4f}",
                          f"{len(s['faults'])} kill(s): {s['outcome']}"])
    keep = d["keep_goodput"] if d.get("keep_goodput") is not None else d["keep_tokens_per_s"]
    repeat = {k: v["failure_free_repeat_ratio"] for k, v in m.items() if "failure_free_repeat_ratio" in v}
    if repeat:
        result["notes"].append("run-to-run noise: a second failure-free run (seed 1) trained at "
                               + ", ".join(f"{k} {100 * v:.0f}%" for k, v in repeat.items())
                               + " of the seed-0 tokens/s")
    if not d["faults"]:
        result["notes"].append("no learner was killed during the decoupled run (too short for the schedule)")
    report.target(result, "decoupled keeps its throughput", f"≥ {100 * TARGET_KEEP:.0f}% of its failure-free run",
                  f"tokens/s {100 * d['keep_tokens_per_s']:.0f}%, goodput {100 * keep:.0f}% "
                  f"({len(d['faults'])} kills)",
                  (d["keep_tokens_per_s"] >= TARGET_KEEP and keep >= TARGET_KEEP) if d["faults"] else None,
                  f"a restart costs a process start (python, torch, corpus, register, pull Θ): learners trained "
                  f"again {rc.get('trained_again_s_median') or 0:.0f} s after a kill (median) against a {MTBF_S:g} s "
                  "MTBF; a killed learner frees CPU for the others (2 cores, 4 learners), which props up tokens/s")
    syncs = [m[x] for x in ("sync-diloco", "ddp")]
    if all(x["stopped"] for x in syncs):
        worst = max(x["modelled"]["keep"] for x in syncs)
        report.target(result, "synchronous methods lose far more", "measured under the same schedule",
                      f"both stopped at their first kill (the baselines have no elastic restart): 0% kept; "
                      f"modelled checkpoint restart ≤ {100 * worst:.0f}%", worst < keep,
                      "the modelled figure uses each baseline's own measured start-up and H/2 lost steps per failure")
    else:
        report.target(result, "synchronous methods lose far more", "measured under the same schedule",
                      "; ".join(f"{n}: {x['outcome']}" for n, x in zip(("sync-diloco", "ddp"), syncs)), None,
                      "a run ended before the schedule killed one of its workers")
    if ddp_loss and d["chaos"]["val_loss"]:
        rel = (d["chaos"]["val_loss"] - ddp_loss) / ddp_loss
        report.target(result, "final loss under chaos", "within the quality target (2% of DDP)",
                      f"{100 * rel:+.2f}% vs failure-free DDP", rel <= quality.TARGET_VS_DDP,
                      "" if rel <= quality.TARGET_VS_DDP else "see quality: the failure-free gap already exceeds it")


def plot(result: dict, path: Path) -> Path:
    m = result["figures"]["methods"]
    fig, (a, b) = report.figure(2, 1, width=6.4, height=4.4)
    names = ["decoupled", "sync-diloco", "ddp"]
    trained = [m["decoupled"]["keep_tokens_per_s"]] + [m[n]["keep_tokens_per_s"] for n in names[1:]]
    useful = [m["decoupled"].get("keep_goodput") or 0.0] + [m[n]["keep_useful"] for n in names[1:]]
    modelled = [None] + [m[n]["modelled"]["keep"] for n in names[1:]]
    x = range(len(names))
    b1 = a.bar([i - 0.27 for i in x], [100 * v for v in trained], 0.27, label="tokens/s (trained)",
               color=[report.color(n) for n in names], alpha=0.55)
    b2 = a.bar(list(x), [100 * v for v in useful], 0.27, label="goodput / kept in the model",
               color=[report.color(n) for n in names])
    b3 = a.bar([i + 0.27 for i in list(x)[1:]], [100 * v for v in modelled[1:]], 0.27, label="modelled: job restart",
               color="white", edgecolor=[report.color(n) for n in names[1:]], hatch="//")
    for bars in (b1, b2, b3):
        report.bar_labels(a, bars, "{:.0f}%")
    a.axhline(100 * TARGET_KEEP, color="k", ls=":", lw=1)
    a.annotate(f"target {100 * TARGET_KEEP:.0f}%", (0.75, 100 * TARGET_KEEP), xycoords=("axes fraction", "data"),
               fontsize=8, va="bottom")
    a.set_xticks(list(x), names)
    a.set_ylabel("% of the method's own failure-free run")
    a.set_ylim(0, 165)
    a.set_yticks(range(0, 125, 20))
    a.set_title(f"each learner killed every ~{MTBF_S:g} s on average")
    a.legend(fontsize=7, loc="upper center", ncol=3)

    run_dir = Path(m["decoupled"]["chaos_run"])
    t0 = min((float(e["time"]) for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") == "start"),
             default=0.0)
    for i, metrics in enumerate(sorted((run_dir / "learners").glob("*/metrics.jsonl"))):
        recs = read_jsonl(metrics)
        total, last, xs, ys = 0, 0, [], []
        for r in recs:
            tok = int(r.get("tokens", 0))
            if tok < last:
                total += last
            last = tok
            xs.append(float(r["time"]) - t0)
            ys.append((total + tok) / 1e3)
        b.plot(xs, ys, "-", lw=1.4, label=metrics.parent.name)
    for e in m["decoupled"]["faults"]:
        b.axvline(float(e["time"]) - t0, color="#444444", ls=":", lw=1)
    for name in [n for n in names[1:] if m[n]["stopped"]]:
        b.axvline(m[name]["stopped_after_s"], color=report.color(name), ls="--", lw=1)
        b.annotate(f"{name} stopped", (m[name]["stopped_after_s"], 0.02), xycoords=("data", "axes fraction"),
                   rotation=90, fontsize=7, color=report.color(name), ha="right", va="bottom")
    b.set_xlabel("seconds since launch (dotted: kills; dashed: where each baseline's own run was stopped)")
    b.set_ylabel("thousand tokens trained, per learner")
    b.set_title("decoupled under chaos: learners keep training")
    b.legend(fontsize=7)
    return report.save(fig, path, "Resilience: throughput kept under failures, vs each method's failure-free run",
                       report.footnote(result))
