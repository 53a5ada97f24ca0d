"""Per-rank checkpoints of the synchronous baselines: tensors in safetensors, the rest in JSON, never pickle.

Layout: <state_dir>/checkpoint/step-<S>/{tensors.safetensors,state.json}, one directory per step swapped in whole;
<run_dir>/checkpoint.json = {"step": S, ...} names the committed step, written only once every rank wrote S.
A rank keeps the committed step's directory until a later step is committed (`prune`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from diloco_trainer.fsutil import atomic_write_json, fsync_dir, write_synced

COMMIT_FILE = "checkpoint.json"
TENSORS, STATE = "tensors.safetensors", "state.json"


def step_dir(state_dir: Path, step: int) -> Path:
    return Path(state_dir) / "checkpoint" / f"step-{step:08d}"


def save(state_dir: Path, step: int, tensors: dict[str, torch.Tensor], state: dict) -> Path:
    """Write this rank's checkpoint of `step`: complete or absent, never half (temp dir, fsync, rename)."""
    final = step_dir(state_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_synced(tmp / TENSORS, save_tensors({k: t.detach().contiguous().clone() for k, t in tensors.items()}))
    write_synced(tmp / STATE, json.dumps(state).encode())
    fsync_dir(tmp)
    if final.exists():  # written by an incarnation that died before the commit: replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


def load(state_dir: Path, step: int) -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's checkpoint of `step` as (tensors, state); FileNotFoundError if it never wrote one."""
    path = step_dir(state_dir, step)
    return load_tensors((path / TENSORS).read_bytes()), json.loads((path / STATE).read_text())


def commit(run_dir: Path, step: int, **info) -> None:
    """Declare `step` the checkpoint to resume from; only once every rank's `save(step)` returned."""
    atomic_write_json(Path(run_dir) / COMMIT_FILE, {"step": step, "time": time.time(), **info}, indent=1)


def committed(run_dir: Path) -> dict | None:
    """The committed checkpoint's record ({"step", ...}), or None before the first commit."""
    path = Path(run_dir) / COMMIT_FILE
    return json.loads(path.read_text()) if path.exists() else None


def prune(state_dir: Path, keep: int) -> None:
    """Delete this rank's checkpoint directories other than step `keep` (leftover temp dirs included)."""
    root = Path(state_dir) / "checkpoint"
    for path in root.glob("step-*") if root.exists() else []:
        if path != step_dir(state_dir, keep):
            shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------- state ↔ tensors + JSON


def optimizer_tensors(opt: torch.optim.Optimizer, prefix: str = "opt.") -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state (AdamW: step, exp_avg, exp_avg_sq) as flat named tensors."""
    out = {}
    for idx, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            out[f"{prefix}{idx}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return out


def load_optimizer_tensors(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], prefix: str = "opt.") -> None:
    """Restore what `optimizer_tensors` saved; hyper-parameters stay as this optimizer was built."""
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith(prefix):
            idx, key = name[len(prefix):].split(".", 1)
            state.setdefault(int(idx), {})[key] = value
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})


def rng_to_json(rng: random.Random) -> list:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def rng_from_json(rng: random.Random, saved: list) -> None:
    version, internal, gauss = saved
    rng.setstate((version, tuple(internal), gauss))
