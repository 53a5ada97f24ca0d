"""`diloco bench [--quick] [--only NAME,...]`: run the benchmark suite, write JSON + PNG per benchmark, print tables."""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import time
from pathlib import Path

from .report import REPO

# Cheapest first: a failure in a long benchmark should not hide the figures of the quick ones.
BENCHMARKS = ("syncer_speed", "syncer_shards", "precision", "overhead", "bandwidth", "downlink", "quality", "quality_llama", "resilience", "syncer_recovery", "heterogeneity")
# Only on request (--only): wan makes network namespaces, so it needs root and iproute2.
ON_REQUEST = ("wan",)
RESULTS = REPO / "bench" / "results"
LATEST = REPO / "bench" / "latest"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small sizes: the whole suite in a few minutes")
    parser.add_argument("--only", default="", metavar="NAME,...",
                        help=f"run only these benchmarks (of: {', '.join(BENCHMARKS + ON_REQUEST)}; "
                             f"{', '.join(ON_REQUEST)} only when named here)")
    parser.add_argument("--out", default=None, help="results directory (default bench/results/<timestamp>-<mode>/)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per quality configuration (default 2)")
    parser.add_argument("--latest", action=argparse.BooleanOptionalAction, default=None,
                        help="copy the JSON and PNG files to bench/latest/ (default: only after a full, "
                             "complete suite)")
    parser.add_argument("--plain", action="store_true", help="log lines instead of live progress bars")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # debugging: smallest sizes


def selected(only: str) -> list[str]:
    """Benchmark names from --only, in suite order; unknown names raise ValueError naming them."""
    if not only.strip():
        return list(BENCHMARKS)
    names = [n.strip().replace("-", "_") for n in only.split(",") if n.strip()]
    known = BENCHMARKS + ON_REQUEST
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--only: unknown benchmark(s) {unknown}; choose from {', '.join(known)}")
    return [n for n in known if n in names]


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from . import report

    try:
        names = selected(args.only)
    except ValueError as exc:
        print(f"diloco bench: {exc}", file=sys.stderr)
        return 2
    if args.seeds is not None and args.seeds < 1:
        print("diloco bench: --seeds must be >= 1", file=sys.stderr)
        return 2
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    out = Path(args.out) if args.out else RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-{mode}"
    console = Console()
    if not console.is_terminal:  # logs and pipes: wide enough that the tables keep one line per row
        console = Console(width=180)
    plain = args.plain or not console.is_terminal
    progress = None if plain else report.make_progress(console)
    ctx = report.Context(mode=mode, out_dir=out, console=console, progress=progress, seeds=args.seeds)
    console.log(f"diloco bench ({mode}): {', '.join(names)} → {out}")

    results, failed = [], []
    started = time.monotonic()
    if progress is not None:
        progress.start()
    try:
        suite = ctx.task("suite", len(names))
        for name in names:
            module = importlib.import_module(f"diloco_bench.{name}")
            console.log(f"[bold]{name}[/] ...")
            t0 = time.monotonic()
            try:
                result = module.run(ctx)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001 - one broken benchmark must not lose the others' figures
                console.print_exception(max_frames=8)
                failed.append(f"{name}: {exc}")
                suite.advance()
                continue
            path = report.finish(result, out)
            results.append(result)
            console.log(f"{name} done in {time.monotonic() - t0:.0f} s → {path}")
            console.print(report.rich_table(result))
            for note in result.get("notes", []):
                console.print(f"note: {note}")
            suite.advance()
    finally:
        if progress is not None:
            progress.stop()

    summary = {"mode": mode, "benchmarks": [r["benchmark"] for r in results], "failed": failed,
               "duration_s": time.monotonic() - started, "env": report.environment(),
               "targets": [{"benchmark": r["benchmark"], **t} for r in results for t in r["targets"]]}
    report.write_json(out / "summary.json", summary)
    console.print(report.targets_table(results))
    console.log(f"suite took {summary['duration_s'] / 60:.1f} min; results in {out}")
    complete = not failed and names == list(BENCHMARKS) and mode == "full"
    if args.latest or (args.latest is None and complete):
        publish(out, LATEST)
        console.log(f"copied JSON and PNG files to {LATEST}")
    for f in failed:
        console.print(f"[red]failed[/]: {f}")
    return 1 if failed else 0


def publish(src: Path, dst: Path) -> None:
    """Replace dst's JSON and PNG files with src's (what README shows)."""
    dst.mkdir(parents=True, exist_ok=True)
    for old in list(dst.glob("*.json")) + list(dst.glob("*.png")):
        old.unlink()
    for f in sorted(src.glob("*.json")) + sorted(src.glob("*.png")):
        shutil.copy2(f, dst / f.name)
