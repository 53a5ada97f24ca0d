"""Harsh failures (issue 11): 3 learners for ~150 s, each killed on average every 60 s on its own Poisson clock (a
kill every ~20 s pooled), restarted `--restart-delay 2` s later; ≥ 3 schedule seeds, each seed's schedule the same
for every configuration run under it, each chaos run next to a failure-free twin (the machine's other work drifts).

Reported per seed: kills, useful tokens/s kept (and per CPU-second of the run's own processes), the cost of one
kill ((1 − kept) ÷ kills), and where the seconds of each kill went (`kill_cost.py`)."""

from __future__ import annotations

import statistics
from pathlib import Path

import yaml

from diloco_trainer.protocol.chaos_record import read_record

from . import kill_cost, report, runs
from .companions import ChaosCompanion

LEARNERS = 3
RESTART_DELAY_S = 2.0
MTBF_PER_LEARNER_S = (20.0, 30.0, 60.0)  # tiny, quick, full: a kill every MTBF/3 s pooled
MINUTES = (1.0, 1.5, 3.0)  # --minutes of each run (start-up included): ~150 s of training in full mode
SEEDS = (101, 102, 103)  # the first three; --seeds N continues 104, ...
TARGET_KEEP = 0.95
TARGET_PER_KILL = 0.005
STEPS = 100_000  # more than a run can train: the time budget ends every run at the same wall time


def seeds(ctx: report.Context) -> tuple[int, ...]:
    """Schedule seeds: 1 in tiny and quick mode, at least 3 in full mode (more with --seeds)."""
    n = ctx.pick(1, 1, max(3, ctx.seeds or 3))
    return tuple(SEEDS[0] + i for i in range(n))


def experiment(seed: int, mtbf: float) -> dict:
    """Each learner on its own Poisson clock (MTBF `mtbf` s), SIGKILLed; any number of them down at once."""
    return {"name": f"bench-harsh-{seed}", "description": f"each learner killed on average every {mtbf:g}s",
            "schedule": {"mtbf": f"{mtbf:g}s", "seed": seed}, "target": {"kind": "learner"},
            "action": {"type": "kill"},
            "safety": {"minAliveUnits": 0, "maxConcurrent": LEARNERS, "maxDuration": "1h",
                       "recoveryTimeout": "60s"}}


def spec(ctx: report.Context, chaos_seed: int, kills: bool = True, extra: tuple[str, ...] = ()) -> runs.RunSpec:
    """A run of the harsh benchmark: under the schedule of `chaos_seed`, or (`kills` False) its failure-free twin."""
    return runs.RunSpec("decoupled", STEPS, seed=0, learners=LEARNERS,
                        kill_every_s=ctx.pick(*MTBF_PER_LEARNER_S) if kills else None, chaos_seed=chaos_seed,
                        minutes=ctx.pick(*MINUTES), eval_batches=ctx.pick(4, 8, 16), snapshots=1,
                        extra=("--restart-delay", f"{RESTART_DELAY_S:g}", "--log-every", "1", *extra),
                        label=f"harsh, seed {chaos_seed}" + ("" if kills else ": its failure-free twin"))


def _useful_per_cpu_s(summary: dict, rates: dict) -> float | None:
    cpu = (summary.get("usage") or {}).get("cpu_s")
    return rates["goodput"] * rates["tokens_trained"] / cpu if cpu else None


def measure(ctx: report.Context, extra: tuple[str, ...] = (), only_seeds: tuple[int, ...] | None = None) -> dict:
    """Per seed, a failure-free run and right after it the run under that seed's schedule: the other work on this
    shared machine drifts over minutes, so each chaos run is compared with the failure-free run next to it. Also
    per CPU-second the run's own processes used, which that other work does not move. `only_seeds`: these schedule
    seeds instead of `seeds(ctx)`."""
    root = ctx.out_dir / "runs"
    root.mkdir(parents=True, exist_ok=True)
    per_seed = []
    for seed in only_seeds or seeds(ctx):
        ff = runs.ensure(ctx, spec(ctx, seed, kills=False, extra=extra))
        ff_rates = runs.rates(ff)
        s = spec(ctx, seed, extra=extra)
        exp = experiment(seed, ctx.pick(*MTBF_PER_LEARNER_S))
        exp_path = root / f"{s.key}-experiment.yaml"
        exp_path.write_text(yaml.safe_dump(exp, sort_keys=False))
        record = root / f"{s.key}-chaos.jsonl"
        ch = runs.ensure(ctx, s, companion=ChaosCompanion(exp_path, record, root / f"{s.key}-chaos.log"))
        rates = runs.rates(ch)
        overwritten = max(0.0, 1.0 - ff_rates["goodput"])
        kills = kill_cost.kills(Path(ch["run_dir"]), read_record(record), overwritten)
        kept = rates["useful_per_s"] / ff_rates["useful_per_s"]
        per_cpu = _useful_per_cpu_s(ch, rates), _useful_per_cpu_s(ff, ff_rates)
        span = runs.training_span(ch)
        phases = kill_cost.phase_summary(kills)
        phases["spare_warm_up"] = kill_cost.spare_cpu(Path(ch["run_dir"]), after=span[0] if span else 0.0)
        phases["spare_cpu_s"] = phases["spare_warm_up"]["cpu_s"] / len(kills) if kills else None
        per_seed.append({"seed": seed, "chaos_run": ch["run_dir"], "failure_free_run": ff["run_dir"],
                         "kills": len(kills), "rates": rates, "failure_free": ff_rates,
                         "usage": ch.get("usage"), "failure_free_usage": ff.get("usage"),
                         "keep_tokens_per_s": rates["tokens_per_s"] / ff_rates["tokens_per_s"],
                         "keep_goodput": kept, "cost_per_kill": (1 - kept) / len(kills) if kills else None,
                         "keep_per_cpu_s": per_cpu[0] / per_cpu[1] if all(per_cpu) else None,
                         # Goodput points (share of trained tokens merged) each kill cost: unlike tokens/s, hardly
                         # moved by the machine's other work (seen: the twins' tokens/s 1.5x apart at load 8-21).
                         "goodput_drop_per_kill": (ff_rates["goodput"] - rates["goodput"]) / len(kills)
                         if kills else None,
                         "breakdown": kills, "phases": phases,
                         "steps_went": kill_cost.steps_went(Path(ch["run_dir"])),
                         "failure_free_steps_went": kill_cost.steps_went(Path(ff["run_dir"]))})
    all_kills = [k for s in per_seed for k in s["breakdown"]]
    phases = kill_cost.phase_summary(all_kills)
    n = sum(s["kills"] for s in per_seed)
    phases["spare_cpu_s"] = sum(s["phases"]["spare_warm_up"]["cpu_s"] for s in per_seed) / n if n else None
    return {"seeds": per_seed, "phases": phases, "mtbf_per_learner_s": ctx.pick(*MTBF_PER_LEARNER_S),
            "restart_delay_s": RESTART_DELAY_S, "learners": LEARNERS, "minutes": ctx.pick(*MINUTES)}


def summarize(result: dict, h: dict) -> None:
    """Notes, targets and a breakdown table for the harsh schedule (beside the 60 s one's)."""
    seeds_ = h["seeds"]
    keeps = [s["keep_goodput"] for s in seeds_]
    costs = [s["cost_per_kill"] for s in seeds_ if s["cost_per_kill"] is not None]
    kills = [s["kills"] for s in seeds_]
    pooled = h["mtbf_per_learner_s"] / h["learners"]
    result["notes"].append(
        f"harsh schedule (a kill every ~{pooled:g} s pooled, restarted after {h['restart_delay_s']:g} s): kept "
        + ", ".join(f"seed {s['seed']} {100 * s['keep_goodput']:.1f}% ({s['kills']} kills; per CPU-second "
                    + (f"{100 * s['keep_per_cpu_s']:.1f}%" if s.get("keep_per_cpu_s") else "-")
                    + (f"; goodput {points(s['goodput_drop_per_kill'])} per kill"
                       if s.get("goodput_drop_per_kill") is not None else "") + ")"
                    for s in seeds_)
        + " of the useful tokens/s of the failure-free run next to it")
    result["notes"].append("where the seconds of a kill go (median over every kill, s after the kill): "
                           + kill_cost.describe(h["phases"]))
    report.target(result, f"harsh: a kill every ~{pooled:g} s pooled", f"keeps ≥ {100 * TARGET_KEEP:.0f}% (median)",
                  f"{100 * statistics.median(keeps):.1f}% median ({100 * min(keeps):.1f}–{100 * max(keeps):.1f}%, "
                  f"{sum(kills)} kills over {len(seeds_)} seeds)",
                  statistics.median(keeps) >= TARGET_KEEP if sum(kills) else None)
    report.target(result, "harsh: the cost of one kill", f"≤ {100 * TARGET_PER_KILL:.1f}% of the job's throughput",
                  f"{100 * statistics.mean(costs):.2f}% (per seed "
                  + ", ".join(f"{100 * c:.2f}%" for c in costs) + ")" if costs else "no kill",
                  statistics.mean(costs) <= TARGET_PER_KILL if costs else None)


def points(drop: float | None) -> str:
    """Goodput points a kill cost ("0.33 points lost"; a run that beat its twin "0.30 points gained")."""
    if drop is None:
        return "-"
    return f"{abs(100 * drop):.2f} points {'lost' if drop >= 0 else 'gained'}"


def overall(h: dict) -> str:
    """The seeds together: median and spread of the kept fraction, points per kill per seed (median) and pooled over
    every kill (the goodput drops summed, over the kills summed)."""
    seeds_ = h["seeds"]
    keeps = sorted(100 * s["keep_goodput"] for s in seeds_)
    drops = [s for s in seeds_ if s.get("goodput_drop_per_kill") is not None]
    kills = sum(s["kills"] for s in drops)
    pooled = sum(s["goodput_drop_per_kill"] * s["kills"] for s in drops) / kills if kills else None
    median_drop = statistics.median(s["goodput_drop_per_kill"] for s in drops) if drops else None
    return (f"{len(seeds_)} seeds: useful tokens/s kept {statistics.median(keeps):.1f}% median "
            f"({keeps[0]:.1f}–{keeps[-1]:.1f}%; target ≥ {100 * TARGET_KEEP:.0f}%), goodput {points(median_drop)} "
            f"per kill median, {points(pooled)} pooled over {kills} kills (target ≤ {100 * TARGET_PER_KILL:.1f} points)")


def plot(h: dict, path: Path, footnote: str) -> Path:
    """Left: useful tokens/s kept per seed. Right: when each phase of a recovery was reached (median, s after the
    kill) and the work a kill took with it, in seconds of a learner."""
    fig, (a, b) = report.figure(2, 1, width=6.0, height=4.2)
    seeds_ = h["seeds"]
    bars = a.bar([str(s["seed"]) for s in seeds_], [100 * s["keep_goodput"] for s in seeds_],
                 color=report.color("decoupled"))
    report.bar_labels(a, bars, "{:.1f}%")
    for bar, s in zip(bars, seeds_):
        a.annotate(f"{s['kills']} kills", (bar.get_x() + bar.get_width() / 2, 5), ha="center", fontsize=8,
                   color="white")
    a.axhline(100 * TARGET_KEEP, color="k", ls=":", lw=1)
    a.set_ylim(0, max(110.0, 115 * max(s["keep_goodput"] for s in seeds_)))
    a.set_xlabel("chaos seed")
    a.set_ylabel("useful tokens/s, % of the failure-free run")
    a.set_title(f"a kill every ~{h['mtbf_per_learner_s'] / h['learners']:g} s pooled", fontsize=10)
    ph = h["phases"]
    names = [p for p in kill_cost.PHASES if ph.get(p)]
    med = [ph[p]["median"] for p in names]
    top = [ph[p]["max"] for p in names]
    y = list(range(len(names)))
    b.barh(y, top, color="#cccccc", label="max")
    b.barh(y, med, color=report.color("decoupled"), label="median")
    if ph.get("lost_s"):
        y.append(len(names))
        names.append("work lost (s of a learner)")
        b.barh([y[-1]], [ph["lost_s"]["max"]], color="#cccccc")
        b.barh([y[-1]], [ph["lost_s"]["median"]], color=report.color("sync-diloco"))
    b.set_yticks(y, [n.replace("_", " ") for n in names])
    b.invert_yaxis()
    b.set_xlabel("seconds after the kill")
    b.set_title(f"where a kill's seconds go ({ph['kills']} kills)", fontsize=10)
    b.legend(fontsize=7, loc="lower right")
    return report.save(fig, path, "Resilience under harsh failures", footnote)


def main(argv: list[str] | None = None) -> None:
    """`python -m diloco_bench.harsh OUT [--seeds N]`: the harsh case alone (full-mode sizes), N seeds from 101 (any
    N >= 1, unlike the suite's >= 3), each chaos run beside its failure-free twin; prints the figures per seed."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m diloco_bench.harsh", description=main.__doc__)
    parser.add_argument("out", type=Path, help="results directory (runs already in it are reused)")
    parser.add_argument("--seeds", type=int, default=3, help="schedule seeds, from 101 (default 3)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run, chaos and twin (diloco local --set), e.g. "
                             "outer.align_first_sends=false to measure without a setting; repeatable")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    extra = tuple(x for kv in args.set for x in ("--set", kv))
    result = report.new_result("harsh", "full")  # the time and load as the runs start, for the plot's footnote
    h = measure(report.Context("full", args.out), extra, only_seeds=tuple(SEEDS[0] + i for i in range(args.seeds)))
    for s in h["seeds"]:
        print(f"seed {s['seed']}: {s['kills']} kills, useful tokens/s kept {100 * s['keep_goodput']:.1f}%, goodput "
              f"{100 * s['failure_free']['goodput']:.1f}% failure-free vs {100 * s['rates']['goodput']:.1f}%, "
              f"{points(s['goodput_drop_per_kill'])} per kill")
        for label, went in (("chaos run", s["steps_went"]), ("its twin", s["failure_free_steps_went"])):
            if went:
                print(f"  {label}: of {went['trained']} fragment-steps trained, {100 * went['acked']:.0f}% "
                      f"acknowledged, {100 * went['discarded']:.0f}% discarded by an adoption, "
                      f"{100 * went['lost']:.0f}% neither (lost with a process)")
    print(kill_cost.describe(h["phases"]))
    print(overall(h))
    (args.out / "harsh.json").write_text(json.dumps(h, indent=1, default=str))
    print(f"plot: {plot(h, args.out / 'resilience_harsh.png', report.footnote(result))}")


if __name__ == "__main__":
    main()
