"""The run directory every local run and baseline leaves behind, and readers for the metrics inside it.

Layout: config.yaml, processes.json, events.jsonl, syncer.jsonl, learners/<id>/metrics.jsonl,
logs/<name>.log, final/{theta.safetensors,state.json}, snapshots/, summary.json, plot.png.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml

from diloco_trainer.config import TrainConfig
from diloco_trainer.fsutil import atomic_write_json, read_jsonl  # noqa: F401 - read_jsonl is part of this module's API
from diloco_trainer.goodput import Slot, slot
from diloco_trainer.protocol.messages import MetricsRecord
from diloco_trainer.protocol.runfiles import read_events


def make_run_dir(path: str | Path | None, root: str | Path = "runs") -> Path:
    """Create the run directory: `path` if given (must be empty or new), else runs/<timestamp>/."""
    if path is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run = Path(root) / stamp
        n = 1
        while run.exists():  # two runs started in the same second
            n += 1
            run = Path(root) / f"{stamp}-{n}"
    else:
        run = Path(path)
        if run.exists() and any(run.iterdir()):
            raise ValueError(f"--run-dir {str(run)!r} exists and is not empty; pick a new directory")
    for sub in ("learners", "logs", "final", "snapshots"):
        (run / sub).mkdir(parents=True, exist_ok=True)
    return run.resolve()


def write_config(run: Path, cfg: TrainConfig) -> Path:
    """config.yaml: the exact config every process of the run reads."""
    path = run / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path


def open_run(path: str | Path | None, cfg: TrainConfig, command: str) -> tuple[Path, Path]:
    """A new run's directory and its config.yaml, for `command` (`diloco local`, `diloco baseline`): a --run-dir
    that is not empty ends the command with its message (SystemExit), before anything starts."""
    try:
        run = make_run_dir(path)
    except ValueError as exc:
        raise SystemExit(f"{command}: {exc}") from None
    return run, write_config(run, cfg)


def write_json(path: Path, obj) -> None:
    """Write JSON atomically: readers never see half a file."""
    atomic_write_json(path, obj, indent=1)


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def last_jsonl(path: Path, window: int = 16384) -> dict | None:
    """The last complete JSON line of a file, reading only its tail (cheap enough to poll every second)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - window))
            tail = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return None


def as_record(rec: dict | MetricsRecord) -> MetricsRecord:
    """A metrics line as a typed record (lines read as plain dicts are validated here)."""
    return rec if isinstance(rec, MetricsRecord) else MetricsRecord.model_validate(rec)


def split_incarnations(records: list, starts: list[float]) -> list[list]:
    """Group a learner's metrics lines (records or dicts) by process incarnation, using the supervisor's start times.

    Counters in metrics.jsonl (step, tokens, acked_tokens) restart from zero in each incarnation, so
    totals are sums over incarnations of each one's last line; only `step` of an incarnation resumed from a
    checkpoint starts at the checkpoint's step, given as `resumed_from_step` (see `steps_in_incarnation`).
    """
    if not starts:
        return [records] if records else []
    groups: list[list] = [[] for _ in starts]
    for rec in records:
        t = rec.time if isinstance(rec, MetricsRecord) else float(rec.get("time", 0.0))
        k = max((i for i, s in enumerate(starts) if s <= t), default=0)
        groups[k].append(rec)
    return groups


def steps_in_incarnation(rec: dict | MetricsRecord) -> int:
    """Steps a metrics line's incarnation has trained: its step less the checkpoint step it resumed from."""
    return as_record(rec).steps_in_incarnation


def learner_totals(records: list, starts: list[float]) -> dict:
    """Totals over all incarnations of one learner: steps, tokens, acked tokens/steps, sent, rejected, adoptions and
    the fragment-steps they discarded."""
    keys = ("step", "tokens", "acked_tokens", "acked_steps", "sent", "acked", "rejected", "adoptions", "steps_discarded")
    total = {k: 0 for k in keys}
    for group in split_incarnations(records, starts):
        if group:
            last = as_record(group[-1])
            for k in keys:
                total[k] += last.steps_in_incarnation if k == "step" else int(getattr(last, k))
    total["incarnations"] = max(1, len(starts)) if records else len(starts)
    return total


def metrics_records(path: Path) -> list[MetricsRecord]:
    """A metrics.jsonl as typed records (lines that are not a record, e.g. from a damaged file, are skipped)."""
    out = []
    for line in read_jsonl(path):
        try:
            out.append(MetricsRecord.model_validate(line))
        except ValueError:
            continue
    return out


def learner_slots(run_dir: Path, steps_merged: dict[str, int] | None, fragments: int = 1,
                  after_startup: bool = False) -> dict[str, Slot]:
    """Every learner slot of a run directory, for `goodput.goodput` (see goodput.py for the definition).

    `steps_merged` (per learner, from the syncer) makes useful steps steps_merged / fragments (Decoupled); None
    means a synchronous job, whose useful steps are those its last line says the final model holds
    (resumed_from_step + acked_steps). `after_startup` counts each slot from its first training report.
    """
    events = read_events(run_dir)
    names = {e.name for e in events if e.role == "learner"}
    if (run_dir / "learners").is_dir():
        names |= {p.name for p in (run_dir / "learners").iterdir() if p.is_dir()}
    slots = {}
    for name in sorted(names):
        mine = [e for e in events if e.name == name]
        starts = [e.time for e in mine if e.event == "start"]
        if not starts:
            continue
        exits = [e.time for e in mine if e.event == "exit"]
        records = metrics_records(run_dir / "learners" / name / "metrics.jsonl")
        if steps_merged is not None:
            useful = steps_merged.get(name, 0) / fragments
        else:
            useful = records[-1].resumed_from_step + records[-1].acked_steps if records else 0
        if after_startup:
            starts = [min((r.time for r in records), default=starts[0]), *starts[1:]]
        slots[name] = slot(split_incarnations(records, starts), starts, exits, useful)
    return slots
