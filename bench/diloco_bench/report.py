"""Shared by every benchmark: timing with same-run baselines, the JSON result, the printed table, plot styling.

A result is a plain dict (see `new_result`); figures are ratios to a baseline measured in the same run, because
this machine is shared and absolute times drift with the load of other work.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

REPO = Path(__file__).resolve().parents[2]
SCHEMA_VERSION = 1


@dataclass
class Context:
    """What every benchmark gets: its size ("tiny" for the smoke test, "quick", "full"), where to write, output."""

    mode: str
    out_dir: Path
    console: Console = field(default_factory=Console)
    progress: Progress | None = None
    seeds: int | None = None  # override of the number of seeds (quality)

    def __post_init__(self) -> None:
        if self.mode not in ("tiny", "quick", "full"):
            raise ValueError(f"mode must be tiny, quick or full, got {self.mode!r}")
        self.out_dir = Path(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def pick(self, tiny, quick, full):
        """The value for this context's mode."""
        return {"tiny": tiny, "quick": quick, "full": full}[self.mode]

    def task(self, description: str, total: float | None):
        """A progress bar; without a live display, a log line now and then instead."""
        return _Task(self.progress, self.console, description, total)

    def log(self, text: str) -> None:
        self.console.log(text)


class _Task:
    PLAIN_EVERY_S = 15.0

    def __init__(self, progress: Progress | None, console: Console, description: str, total: float | None):
        self.progress, self.console, self.description, self.total = progress, console, description.strip(), total
        self.completed, self.started, self.last_log = 0.0, time.monotonic(), time.monotonic()
        self.id = progress.add_task(description, total=total) if progress is not None else None
        if progress is None:
            console.log(f"{self.description} ...")

    def advance(self, n: float = 1.0) -> None:
        self.update(completed=self.completed + n)

    def update(self, completed: float | None = None, **kw) -> None:
        if completed is not None:
            self.completed = completed
        if self.progress is not None:
            self.progress.update(self.id, completed=self.completed, **kw)
        elif time.monotonic() - self.last_log >= self.PLAIN_EVERY_S:
            self.last_log = time.monotonic()
            of = f"/{self.total:g}" if self.total else ""
            self.console.log(f"{self.description}: {self.completed:g}{of} "
                             f"({time.monotonic() - self.started:.0f} s)")

    def done(self) -> None:
        if self.progress is not None:
            self.progress.update(self.id, completed=self.total or self.completed, visible=False)
        else:
            self.console.log(f"{self.description}: done in {time.monotonic() - self.started:.0f} s")


def make_progress(console: Console) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=False)


# ---------------------------------------------------------------------- timing


def clock(fn: Callable[[], object]) -> float:
    """Seconds one call of fn takes (perf_counter)."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def paired(measure: Callable[[], object], reference: Callable[[], object], repeats: int) -> dict:
    """Time `measure` and `reference` alternately, `repeats` times each after one warm-up of both.

    Alternating puts both under the same background load. On a shared CPU a run can only be slowed down, never
    sped up, so the best (minimum) time of each is the estimate of its own cost and `ratio` is min / min; the
    medians and the spread of the per-pair ratios are kept to show how noisy the machine was.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    measure(), reference()
    ms, rs = [], []
    for _ in range(repeats):
        rs.append(clock(reference))
        ms.append(clock(measure))
    ratios = [m / r for m, r in zip(ms, rs)]
    return {"time_s": min(ms), "reference_s": min(rs), "ratio": min(ms) / min(rs),
            "time_median_s": statistics.median(ms), "reference_median_s": statistics.median(rs),
            "ratio_min": min(ratios), "ratio_max": max(ratios), "repeats": repeats}


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (0 with one value), min and max."""
    vals = [float(v) for v in values]
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
            "min": min(vals), "max": max(vals), "n": len(vals), "values": vals}


# ---------------------------------------------------------------------- results


def environment() -> dict:
    """Where and when the figures were taken (load average says how shared the CPU was)."""
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "loadavg": list(os.getloadavg()), "git_commit": commit}


def new_result(name: str, mode: str) -> dict:
    """The skeleton every benchmark fills: figures, targets (claim, measured, met, why), a table, a plot."""
    return {"schema": SCHEMA_VERSION, "benchmark": name, "mode": mode, "env": environment(), "started": time.time(),
            "figures": {}, "targets": [], "table": {"title": name, "columns": [], "rows": []}, "notes": []}


def target(result: dict, claim: str, goal: str, measured: str, met: bool | None, why: str = "") -> None:
    """Record one claim's verdict; `met` None means the run could not decide (say why)."""
    result["targets"].append({"claim": claim, "target": goal, "measured": measured, "met": met, "why": why})


def finish(result: dict, out_dir: Path) -> Path:
    """Stamp the duration and load, write `<out_dir>/<benchmark>.json`; returns its path."""
    result["duration_s"] = time.time() - result["started"]
    result["env"]["loadavg_end"] = list(os.getloadavg())
    path = Path(out_dir) / f"{result['benchmark']}.json"
    write_json(path, result)
    return path


def write_json(path: Path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_jsonable) + "\n")
    tmp.replace(path)


def _jsonable(o):
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def rich_table(result: dict) -> Table:
    """The result's table, plus its target verdicts, for the terminal."""
    t = result["table"]
    table = Table(title=t["title"], title_justify="left")
    for i, col in enumerate(t["columns"]):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in t["rows"]:
        table.add_row(*[str(c) for c in row])
    return table


def decide(sp: dict, limit: float) -> bool | None:
    """mean ≤ limit, unless the spread over seeds is wider than the distance to the limit (then None: the runs
    cannot tell), or there is a single value (then the mean decides, and the table says "1 seed")."""
    if sp["n"] > 1 and sp["std"] >= abs(sp["mean"] - limit):
        return None
    return sp["mean"] <= limit


def verdict(met: bool | None) -> str:
    return {True: "[green]met[/]", False: "[red]short[/]", None: "[yellow]n/a[/]"}[met]


def targets_table(results: list[dict]) -> Table:
    table = Table(title="claims vs targets (ratios to baselines measured in the same run)", title_justify="left")
    for col in ("benchmark", "claim", "target", "measured", "verdict"):
        table.add_column(col)
    for r in results:
        for t in r["targets"]:
            table.add_row(r["benchmark"], t["claim"], t["target"], t["measured"], verdict(t["met"]))
    return table


# ---------------------------------------------------------------------- plots


def figure(ncols: int = 1, nrows: int = 1, width: float = 6.0, height: float = 4.2):
    """A matplotlib figure with the suite's style (Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"axes.spines.top": False, "axes.spines.right": False, "axes.grid": True,
                         "grid.alpha": 0.3, "font.size": 10, "axes.titlesize": 11, "axes.titleweight": "bold"})
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return fig, axes.ravel().tolist()


METHOD_COLORS = {"decoupled": "#1f77b4", "ddp": "#7f7f7f", "sync-diloco": "#d62728", "k1-no-grace": "#9467bd",
                 "mean-merge": "#ff7f0e", "none": "#8c564b", "bf16": "#2ca02c", "int8": "#ff7f0e", "int4": "#1f77b4"}


def color(name: str) -> str:
    return METHOD_COLORS.get(name, "#17becf")


def save(fig, path: Path, title: str, subtitle: str = "") -> Path:
    """Title, a footnote with the machine's load, tight layout, 130 dpi PNG."""
    fig.suptitle(title, fontsize=13, fontweight="bold")
    if subtitle:
        fig.text(0.5, 0.005, subtitle, ha="center", va="bottom", fontsize=8, color="#555555")
    fig.tight_layout(rect=(0, 0.03 if subtitle else 0, 1, 0.95))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def bar_labels(ax, bars, fmt: str = "{:.2f}") -> None:
    """Write each bar's value above it."""
    for b in bars:
        h = b.get_height()
        ax.annotate(fmt.format(h), (b.get_x() + b.get_width() / 2, h), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")


def footnote(result: dict) -> str:
    env = result["env"]
    load = env.get("loadavg", [0])[0]
    return (f"{env['time']} · {env['cpus']} CPUs, torch {env['torch']} ({env['torch_threads']} threads) · "
            f"load average {load:.1f} at start · mode {result['mode']} · commit {env.get('git_commit')}")
