"""Training runs for the benchmarks, through the public commands (`diloco local`, `diloco baseline ddp|sync-diloco`).

A run is described by a `RunSpec`; its run directory is keyed by the spec, so benchmarks that need the same run
(e.g. quality's Decoupled int4 run is bandwidth's int4 point and resilience's failure-free run) share it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from diloco_trainer.runtime import procs
from diloco_trainer.runtime.rundir import metrics_records, read_jsonl

from . import report

METHODS = ("decoupled", "ddp", "sync-diloco")
USAGE = "bench-usage.json"  # in a run directory: the CPU seconds the run cost and the load around it

# The benchmark model: configs/local.yaml's ~0.8M-parameter transformer on the stdlib byte corpus. Sized so a run
# of 4 learners x a few hundred steps fits in ~2 minutes of a shared 2-core CPU, yet learns far below unigram.
BENCH_CONFIG: dict = {
    "model": {"vocab_size": 256, "seq_len": 128, "d_model": 128, "n_layers": 4, "n_heads": 4, "mlp_ratio": 4},
    "data": {"source": "stdlib", "val_fraction": 0.05, "max_bytes": 8_000_000},
    "inner": {"lr": 0.003, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "warmup_steps": 20, "grad_clip": 1.0,
              "batch_size": 16},
    "outer": {"fragments": 4, "sync_every": 16, "overlap": 2, "compression": "int4", "block_size": 64, "lr": 1.0,
              "momentum": 0.0, "quorum": 1, "grace": 0.5, "merge": "rda", "token_weights": True, "versions_kept": 8},
}
# Outer lr 1.0 without momentum, not the lineage's 0.7 / 0.9 (tuned for H in the hundreds on large models): at this
# size and length (~12 outer steps per fragment) momentum overshoots. Measured, seed 0, 4 learners x 200 steps, final
# validation loss (DDP: 2.048): sync DiLoCo 0.7/0.9 2.468, 0.9/0.8 2.534, 1.0/0.5 2.314, 1.0/0 2.254, 1.2/0 2.240;
# Decoupled 0.7/0.9 2.571, 1.0/0 2.288. Both methods use the same outer settings.


@dataclass(frozen=True)
class RunSpec:
    """One training run: which method, how many learners and steps, config overrides, slowdown, failures."""

    method: str  # decoupled | ddp | sync-diloco
    steps: int
    seed: int = 0
    learners: int = 4
    sets: tuple[str, ...] = ()  # config overrides KEY=VALUE (e.g. outer.merge=mean)
    slowdown: str = "1"
    jitter: float = 0.0
    kill_every_s: float | None = None  # chaos: each learner killed on average this often (set by resilience)
    minutes: float = 20.0  # wall-clock cap handed to the command (a safety net; runs are sized to finish first)
    eval_batches: int = 16
    snapshots: int = 3
    extra: tuple[str, ...] = ()  # further command-line flags (e.g. a baseline's --max-restarts)
    chaos_seed: int | None = None  # the failure schedule's seed (a run of its own per seed; not a command flag)
    network: str = ""  # the emulated links the run trains over (wan.py; not a command flag: see `Launch`)
    label: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")

    @property
    def key(self) -> str:
        d = asdict(self)
        d.pop("label")
        if d["chaos_seed"] is None:  # keys of runs without one stay what they were
            d.pop("chaos_seed")
        if not d["network"]:
            d.pop("network")
        digest = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]
        return f"{self.method}-s{self.seed}-{digest}"

    def config(self) -> dict:
        """BENCH_CONFIG with this run's seed and overrides applied (the YAML the command reads)."""
        cfg = json.loads(json.dumps(BENCH_CONFIG))
        cfg["seed"] = self.seed
        for item in self.sets:
            k, _, v = item.partition("=")
            *parents, leaf = k.split(".")
            node = cfg
            for part in parents:
                node = node[part]
            node[leaf] = yaml.safe_load(v)
        return cfg

    def argv(self, run_dir: Path, config_path: Path) -> list[str]:
        common = ["--config", str(config_path), "--learners", str(self.learners), "--steps", str(self.steps),
                  "--minutes", f"{self.minutes:g}", "--slowdown", self.slowdown, "--run-dir", str(run_dir),
                  "--plain", "--snapshots", str(self.snapshots), "--eval-batches", str(self.eval_batches)]
        if self.jitter:
            common += ["--jitter", f"{self.jitter:g}"]
        common += list(self.extra)
        if self.method == "decoupled":
            return procs.diloco_argv("local", *common)
        return procs.diloco_argv("baseline", self.method, *common)


@dataclass(frozen=True)
class Launch:
    """How a run's command starts inside an emulated network (wan.py): a prefix for the whole command (e.g. `ip netns
    exec NS`), flags appended to it (per-child prefixes, addresses) and environment variables for it."""

    prefix: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


def standard_steps(ctx: report.Context) -> int:
    """Inner steps per learner of every comparison run (one length, so benchmarks can share runs)."""
    return ctx.pick(20, 64, 200)


def seeds(ctx: report.Context) -> int:
    """Seeds per configuration: the suite's --seeds, else 1 in quick mode and 2 in full mode."""
    return ctx.seeds or ctx.pick(1, 1, 2)


def bytes_down(summary: dict) -> float:
    """Fragment/state bytes all learners received (sum over incarnations of each one's last metrics line)."""
    total = 0.0
    for metrics in (Path(summary["run_dir"]) / "learners").glob("*/metrics.jsonl"):
        last = None
        for rec in metrics_records(metrics):
            if last is not None and rec.step < last.step:
                total += last.bytes_down
            last = rec
        total += last.bytes_down if last is not None else 0.0
    return total


def steps_done(run_dir: Path) -> int:
    """Inner steps trained so far by all learners (a restarted learner's counter starts again at 0; a synchronous
    worker resumed from a checkpoint counts from its `resumed_from_step`)."""
    total = 0
    for metrics in (run_dir / "learners").glob("*/metrics.jsonl"):
        last = None
        for rec in metrics_records(metrics):
            if last is not None and rec.step < last.step:  # a new incarnation
                total += last.steps_in_incarnation
            last = rec
        total += last.steps_in_incarnation if last is not None else 0
    return total


def ensure(ctx: report.Context, spec: RunSpec, companion=None, allow_failure: bool = False,
           launch: Launch | None = None) -> dict:
    """The run's summary.json, running the command first unless this results directory already has it.

    `companion` (optional) has `tick(run_dir)`, called about once a second while the run is live, and `close()`
    (the resilience benchmark injects failures through it); `launch` starts the command inside an emulated network.
    A run that fails raises RuntimeError with its log's tail, unless `allow_failure` and it still wrote a summary (a
    synchronous job stopped by a failure does).
    """
    root = ctx.out_dir / "runs"
    run_dir = root / spec.key
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        return _load(summary_path, spec)
    if run_dir.exists():  # an interrupted earlier attempt: start over
        import shutil

        shutil.rmtree(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    config_path = root / f"{spec.key}.yaml"
    config_path.write_text(yaml.safe_dump(spec.config(), sort_keys=False))
    log_path = root / f"{spec.key}.log"
    total = spec.steps * spec.learners
    task = ctx.task(f"  {spec.label or spec.key}", total)
    started = time.monotonic()
    with open(log_path, "w") as log:
        launch = launch or Launch()
        argv = [*launch.prefix, *spec.argv(run_dir, config_path), *launch.flags]
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=procs.child_env(dict(launch.env)),
                                cwd=report.REPO, start_new_session=True)
        load_before = os.getloadavg()
        try:
            while (usage := _reap(proc)) is None:
                time.sleep(1.0)
                if run_dir.exists():
                    task.update(completed=min(total, steps_done(run_dir)))
                    if companion is not None:
                        companion.tick(run_dir)
        except BaseException:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        finally:
            if companion is not None:
                companion.close()
    task.done()
    if run_dir.exists():
        report.write_json(run_dir / USAGE, {"cpu_s": usage.ru_utime + usage.ru_stime, "load_before": load_before,
                                            "load_after": os.getloadavg()})
    if not summary_path.exists() or (proc.returncode != 0 and not allow_failure):
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"{spec.label or spec.key} failed (exit {proc.returncode}); log {log_path}:\n{tail}")
    ctx.log(f"  {spec.label or spec.key}: {time.monotonic() - started:.0f} s (exit {proc.returncode})")
    return _load(summary_path, spec)


def _reap(proc: subprocess.Popen):
    """None while `proc` runs; then its resource usage, which covers every descendant it waited for (`diloco local`
    waits for all of its learners, spares and its syncer): the CPU the whole run cost, whatever else the machine
    ran meanwhile."""
    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    if pid == 0:
        return None
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage


def _load(path: Path, spec: RunSpec) -> dict:
    summary = json.loads(path.read_text())
    summary["spec"] = {**asdict(spec), "key": spec.key}
    usage = path.parent / USAGE
    summary["usage"] = json.loads(usage.read_text()) if usage.exists() else {}
    return summary


def training_span(summary: dict) -> tuple[float, float] | None:
    """(unix time the first learner began its first step, time of the last training report), from metrics.jsonl."""
    first, last = None, None
    for metrics in (Path(summary["run_dir"]) / "learners").glob("*/metrics.jsonl"):
        recs = metrics_records(metrics)
        if recs:
            r0 = recs[0]
            start = r0.time - r0.step * (r0.step_time_s or 0.0)
            first = start if first is None else min(first, start)
            last = recs[-1].time if last is None else max(last, recs[-1].time)
    return (first, last) if first is not None and last > first else None


def rates(s: dict) -> dict:
    """Trained and useful tokens per second over the training span (runs.training_span)."""
    span = training_span(s)
    seconds = span[1] - span[0] if span else float(s["wall_time_s"])
    # Tokens that reached the model = merged fraction × tokens trained (summaries older than goodput.py called the
    # merged fraction "goodput").
    merged = float(s.get("merged_fraction", s.get("goodput")) or 0.0)
    return {"wall_time_s": s["wall_time_s"], "training_s": seconds, "tokens_trained": s["tokens_trained"],
            "tokens_per_s": s["tokens_trained"] / seconds, "goodput": s.get("goodput"), "merged_fraction": merged,
            "useful_per_s": merged * s["tokens_trained"] / seconds, "val_loss": s.get("val_loss"),
            "stop_reason": s.get("stop_reason"), "restarts": s.get("restarts") or {},
            "lost_steps": s.get("lost_steps")}


def learner_tokens_per_s(summary: dict) -> float:
    """Tokens trained by all learners per second while training: from the first training report of any learner
    to the last one, so the one-time launch is left out but every restart's start-up counts."""
    span = training_span(summary)
    return summary["tokens_trained"] / (span[1] - span[0]) if span else 0.0


def val_curve(summary: dict) -> tuple[list[float], list[float], list[float]]:
    """(time_s, tokens, val_loss) of the global model's evaluations (snapshots, then the final model).

    Times count from the start of training (see `training_span`), not from the launch, so the one-time start-up,
    the same machinery for every method, does not dilute wall-time comparisons; the final model sits at the
    last training report.
    """
    points = summary.get("global_evals") or []
    span = training_span(summary)
    index = read_jsonl(Path(summary["run_dir"]) / "snapshots" / "index.jsonl")
    if span is None or len(index) + 1 != len(points):
        return ([p["time_s"] for p in points], [p["tokens"] for p in points], [p["val_loss"] for p in points])
    times = [max(0.0, float(snap["time"]) - span[0]) for snap in index] + [span[1] - span[0]]
    return (times, [p["tokens"] for p in points], [p["val_loss"] for p in points])
