"""`diloco simulate`: the goodput simulator (table beside the paper's, JSON, plot) and the WAN bandwidth
calculator. Rendering only; the models are in simulator.py and bandwidth.py."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, fields

from diloco_chaos.simulate.bandwidth import BandwidthInputs, required_bandwidth
from diloco_chaos.simulate.simulator import PAPER_CHIPS, PAPER_GOODPUT, FailureModel, simulate

PAPER_LEARNERS = (2, 4, 8, 16)
PAPER_BANDWIDTH_GBPS = {"data-parallel": 198.0, "decoupled": 0.84, "sites": 8}


def label(method: str, learners: int) -> str:
    """Row name used in tables, JSON and the plot."""
    return {"dp": "data-parallel", "elastic": "elastic data-parallel"}.get(method, f"decoupled M={learners}")


def goodput_table(model: FailureModel, chips: list[int], learners: list[int], *, hours: float,
                  warmup_hours: float, seed: int, progress=None) -> dict:
    """Simulate every (method, chips) cell; the paper's value is attached where the paper has that cell."""
    rows_spec = [("dp", 1), ("elastic", 1)] + [("decoupled", m) for m in learners]
    weights = [c for _ in rows_spec for c in chips]   # cost grows with the number of failures ~ chips
    total, done = float(sum(weights)), 0.0
    compare = model.mtbi_years == 1.0
    rows, started = [], time.monotonic()
    for method, m in rows_spec:
        cells = []
        for c in chips:
            def step(frac: float, _base=done, _w=c) -> None:
                if progress is not None:
                    progress((_base + frac * _w) / total)
            r = simulate(method, c, m, model=model, hours=hours, warmup_hours=warmup_hours, seed=seed,
                         progress=step)
            done += c
            ref = PAPER_GOODPUT.get((method, m))
            paper = ref[PAPER_CHIPS.index(c)] if compare and ref and c in PAPER_CHIPS else None
            cells.append({"chips": c, "simulated_chips": r.chips, "goodput": r.goodput, "uptime": r.uptime,
                          "failures": r.failures, "stalls": r.stalls, "paper": paper,
                          "diff": None if paper is None else r.goodput - paper})
        rows.append({"method": method, "learners": m, "label": label(method, m), "cells": cells})
    if progress is not None:
        progress(1.0)
    diffs = [abs(c["diff"]) for r in rows for c in r["cells"] if c["diff"] is not None]
    return {"model": asdict(model), "hours": hours, "warmup_hours": warmup_hours, "seed": seed,
            "rows": rows, "max_abs_diff": max(diffs) if diffs else None,
            "elapsed_s": time.monotonic() - started}


def _chips_label(c: int) -> str:
    return f"{c / 1e6:g}M" if c >= 1_000_000 else f"{c / 1e3:g}k"


def _render_goodput(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    chips = [c["chips"] for c in result["rows"][0]["cells"]]
    table = Table(title=f"Goodput (%), chip MTBI {result['model']['mtbi_years']:g} y, "
                        f"{result['hours']:g} h simulated per cell")
    table.add_column("method")
    for c in chips:
        table.add_column(_chips_label(c), justify="right")
    for row in result["rows"]:
        compared = any(c["paper"] is not None for c in row["cells"])
        table.add_row(row["label"], *(f"{100 * c['goodput']:.1f}" for c in row["cells"]),
                      end_section=not compared)
        if compared:
            table.add_row("  paper", *("" if c["paper"] is None else f"{100 * c['paper']:.0f}"
                                       for c in row["cells"]), style="dim")
            table.add_row("  difference", *("" if c["diff"] is None else
                                            f"[{'green' if abs(c['diff']) <= 0.04 else 'red'}]"
                                            f"{100 * c['diff']:+.1f}[/]" for c in row["cells"]),
                          end_section=True)
    console.print(table)
    uptime = Table(title="Global uptime (%): time the global model advanced")
    uptime.add_column("method")
    for c in chips:
        uptime.add_column(_chips_label(c), justify="right")
    for row in result["rows"]:
        uptime.add_row(row["label"], *(f"{100 * c['uptime']:.1f}" for c in row["cells"]))
    console.print(uptime)
    if result["max_abs_diff"] is not None:
        console.print(f"largest difference from the paper: {100 * result['max_abs_diff']:.1f} points")
    console.print(f"simulated in {result['elapsed_s']:.1f} s")


def plot_goodput(result: dict, path: str) -> None:
    """Write a PNG of goodput vs chips (log-x), one line per method, the paper's values as crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, row in enumerate(result["rows"]):
        colour = f"C{i}"
        xs = [c["chips"] for c in row["cells"]]
        ax.plot(xs, [100 * c["goodput"] for c in row["cells"]], "o-", color=colour, label=row["label"])
        paper = [(c["chips"], 100 * c["paper"]) for c in row["cells"] if c["paper"] is not None]
        if paper:
            ax.plot(*zip(*paper), "x", color=colour, markersize=8, alpha=0.7)
    ax.set_xscale("log")
    chips = [c["chips"] for c in result["rows"][0]["cells"]]
    ax.set_xticks(chips, [_chips_label(c) for c in chips])
    ax.minorticks_off()
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"Goodput vs chips (chip MTBI {result['model']['mtbi_years']:g} y); x = paper")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _run_goodput(args: argparse.Namespace) -> int:
    overrides = {f.name: getattr(args, f.name) for f in fields(FailureModel)
                 if getattr(args, f.name) is not None}
    chips, learners = args.chips, args.learners
    if args.paper_table:
        overrides["mtbi_years"], chips, learners = 1.0, list(PAPER_CHIPS), list(PAPER_LEARNERS)
    model = FailureModel(**overrides)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("simulating"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("simulate", total=1.0)
        result = goodput_table(model, chips, learners, hours=args.hours, warmup_hours=args.warmup_hours,
                               seed=args.seed, progress=lambda f: bar.update(task, completed=f))
    if args.plot:
        plot_goodput(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _render_goodput(result)
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def _run_bandwidth(args: argparse.Namespace) -> int:
    x = BandwidthInputs(params=args.params, step_time_s=args.step_time, sync_every=args.sync_every,
                        fragments=args.fragments, bits=args.bits, sites=args.sites,
                        learners_per_site=args.learners_per_site, dp_bits=args.dp_bits,
                        down_bits=args.down_bits, block_size=args.block_size, link_gbps=args.link_gbps)
    report = required_bandwidth(x)
    if args.json:
        print(json.dumps({"inputs": asdict(x), "report": report.as_dict(), "paper": PAPER_BANDWIDTH_GBPS},
                         indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"WAN bandwidth per site: {x.params:.3g} params, {x.step_time_s:g} s/step, "
                        f"{x.sites} sites")
    table.add_column("traffic")
    table.add_column("Gbit/s", justify="right")
    table.add_row(f"data-parallel: ring all-reduce of {x.dp_bits}-bit gradients every step",
                  f"{report.dp_gbps:.3g}")
    table.add_row(f"decoupled up: one {x.bits}-bit fragment of Δ per {x.sync_every / x.fragments:g} steps "
                  f"({report.fragment_mb:.4g} MB each)", f"{report.decoupled_up_gbps:.3g}")
    table.add_row("decoupled down: merged fragments", f"{report.decoupled_down_gbps:.3g}")
    table.add_row("decoupled link (full duplex: max of up, down)", f"{report.decoupled_gbps:.3g}")
    table.add_row("data-parallel / decoupled", f"{report.ratio:.3g}×")
    if report.speedup is not None:
        table.add_row(f"step time on a {x.link_gbps:g} Gbit/s link: data-parallel / decoupled",
                      f"{report.dp_step_time_s:.3g} s / {report.decoupled_step_time_s:.3g} s "
                      f"({report.speedup:.3g}× faster)")
    console = Console()
    console.print(table)
    console.print("paper (8 datacenters): 198 Gbit/s data-parallel vs 0.84 Gbit/s decoupled; "
                  "assumptions that reproduce it: docs/simulator.md")
    return 0


def _run_syncer_memory(args: argparse.Namespace) -> int:
    from diloco_chaos.simulate.syncer_plan import GIB, Machine, SyncerPlanInputs, fit, shard_plan

    inputs = [SyncerPlanInputs(params=p, fragments=args.fragments, learners=args.learners, sync_every=args.sync_every,
                               step_time_s=args.step_time, versions_kept=args.versions_kept,
                               pending_bits=args.pending_bits, downlink_bits=args.downlink_bits,
                               merge_threads=args.merge_threads, standby=args.standby) for p in args.params]
    machines = [Machine(ram, cores) for ram in args.ram_gib for cores in args.cores]
    whole = [shard_plan(x, 1) for x in inputs]
    fits = [[fit(x, m) for m in machines] for x in inputs]
    if args.json:
        print(json.dumps({"inputs": [asdict(x) for x in inputs], "one_shard": [w.as_dict() for w in whole],
                          "fits": [[{**asdict(f), "machine": asdict(f.machine)} for f in row] for row in fits]},
                         indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    x0 = inputs[0]
    table = Table(title=f"Syncer memory (GiB) and CPU of the whole model in one shard: P={x0.fragments}, "
                        f"M={x0.learners} learners, H={x0.sync_every}, {x0.step_time_s:g} s/step, "
                        f"{x0.versions_kept} versions kept, pending at {x0.pending_bits} bits")
    for col in ("params", "Θ", "momentum", "versions", "pending", "merge", "ckpt buffer", "down-link", "processes",
                "total", "cores"):
        table.add_column(col, justify="right")
    for x, w in zip(inputs, whole):
        table.add_row(f"{x.params:.3g}", *(f"{v / GIB:.1f}" for v in (
            w.theta, w.momentum, w.versions, w.pending, w.merge_workspace, w.checkpoint_buffer, w.downlink,
            w.process, w.total)), f"{w.cores:.2f}")
    fit_table = Table(title="Fewest shards (dividing P) each fitting a machine (80% of its RAM, its cores): "
                            "shards × GiB and cores per shard; machines (m) for all of them")
    fit_table.add_column("params")
    for m in machines:
        fit_table.add_column(f"{m.ram_gib:g} GiB, {m.cores} cores", justify="right")
    for x, row in zip(inputs, fits):
        fit_table.add_row(f"{x.params:.3g}", *(
            "does not fit" if f.shards is None else
            f"{f.shards} × {f.per_shard_gib:.0f} GiB, {f.per_shard_cores:.1f} c; {f.machines} m" for f in row))
    console = Console(width=max(120, 12 + 30 * len(machines)))
    console.print(table)
    console.print(fit_table)
    console.print(f"merge time scaled from the measured {0.395:g} s for a 100M-parameter fragment with 16 "
                  "submissions (bench syncer_speed); assumptions: docs/simulator.md, \"Syncer memory plan\"")
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the `goodput`, `bandwidth` and `syncer-memory` subcommands."""
    sub = parser.add_subparsers(dest="what", required=True, metavar="{goodput,bandwidth,syncer-memory}")
    g = sub.add_parser("goodput", help="simulate goodput vs chips for data-parallel, elastic, decoupled")
    g.add_argument("--paper-table", action="store_true",
                   help="the paper's cells: chips 150k..2.4M, M = 2, 4, 8, 16, MTBI 1 year")
    g.add_argument("--json", action="store_true", help="print the result as JSON")
    g.add_argument("--plot", metavar="PATH", help="write a PNG of goodput vs chips")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chips", type=int, nargs="+", default=list(PAPER_CHIPS))
    g.add_argument("--learners", type=int, nargs="+", default=list(PAPER_LEARNERS),
                   help="Decoupled DiLoCo learner counts M")
    g.add_argument("--hours", type=float, default=200.0, help="simulated hours measured per cell")
    g.add_argument("--warmup-hours", type=float, default=2.0, help="simulated hours discarded first")
    for f in fields(FailureModel):   # every physical parameter can be overridden
        g.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=type(f.default), default=None,
                       help=f"default {f.default}")
    g.set_defaults(handler=_run_goodput)
    b = sub.add_parser("bandwidth", help="WAN bandwidth: data-parallel vs Decoupled DiLoCo")
    b.add_argument("--params", type=float, required=True, help="model parameters, e.g. 12e9")
    b.add_argument("--step-time", type=float, required=True, help="seconds per step")
    b.add_argument("--sync-every", type=int, default=24, help="H")
    b.add_argument("--fragments", type=int, default=24, help="P")
    b.add_argument("--bits", type=int, default=4, help="bits per outer-gradient element on the wire")
    b.add_argument("--sites", type=int, default=8)
    b.add_argument("--learners-per-site", type=int, default=1)
    b.add_argument("--dp-bits", type=int, default=16, help="gradient bits in the data-parallel all-reduce")
    b.add_argument("--down-bits", type=int, default=None, help="merged-fragment bits (default: --bits)")
    b.add_argument("--block-size", type=int, default=0, help="quantization block with an fp32 scale (0: none)")
    b.add_argument("--link-gbps", type=float, default=None, help="compare step times on this WAN link")
    b.add_argument("--json", action="store_true", help="print the result as JSON")
    b.set_defaults(handler=_run_bandwidth)
    m = sub.add_parser("syncer-memory", help="syncer memory and CPU per shard, and shards per machine size")
    m.add_argument("--params", type=float, nargs="+", default=[1e9, 12e9, 100e9], help="model sizes")
    m.add_argument("--fragments", type=int, default=24, help="P")
    m.add_argument("--learners", type=int, default=8, help="M: submissions per fragment per round")
    m.add_argument("--sync-every", type=int, default=24, help="H")
    m.add_argument("--step-time", type=float, default=1.0, help="seconds per inner step")
    m.add_argument("--versions-kept", type=int, default=8, help="outer.versions_kept")
    m.add_argument("--pending-bits", type=int, default=32,
                   help="bits per element of a pending submission in memory (32: as the syncer holds them today; 4: "
                        "if kept at an int4 wire compression)")
    m.add_argument("--downlink-bits", type=int, default=32, help="outer.downlink bits (32: fp32, no residual)")
    m.add_argument("--merge-threads", type=int, default=1, help="merges running at once in one shard")
    m.add_argument("--no-standby", dest="standby", action="store_false", help="no warm standby per shard")
    m.add_argument("--ram-gib", type=float, nargs="+", default=[64, 256, 1024], help="machine RAM sizes")
    m.add_argument("--cores", type=int, nargs="+", default=[16, 64], help="machine core counts")
    m.add_argument("--json", action="store_true", help="print the result as JSON")
    m.set_defaults(handler=_run_syncer_memory)


def run(args: argparse.Namespace) -> int:
    """Dispatch to the chosen subcommand; a bad value is reported, not raised."""
    try:
        return args.handler(args)
    except ValueError as exc:
        print(f"diloco simulate {args.what}: {exc}", file=sys.stderr)
        return 2
