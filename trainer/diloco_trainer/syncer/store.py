"""The syncer's state on disk: atomic checkpoints, the spool of acknowledged submissions, and the version
reservation that keeps version ids unique across crashes. safetensors and JSON only; never pickle.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from diloco_trainer.fsutil import atomic_write, fsync_dir, write_synced

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
RESERVE_STEP = 1000  # version ids reserved per durable write (one tiny fsync per 1000 merges)




def tensors_to_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """safetensors bytes of contiguous CPU copies (safetensors refuses views and shared storage)."""
    return st_save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, metadata=metadata)


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and string metadata of a safetensors file."""
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


# --- spool -------------------------------------------------------------------------------------------

@dataclass
class SpoolEntry:
    name: str  # file name inside the spool directory
    meta: dict  # submission metadata (JSON)
    tensors: dict[str, torch.Tensor]


class Spool:
    """One safetensors file per acknowledged submission, named by acceptance order, fsynced before the 202."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        seqs = [int(p.stem) for p in self.dir.glob("*.safetensors") if p.stem.isdigit()]
        self.next_seq = max(seqs, default=0) + 1

    def reserve_name(self) -> str:
        """A fresh file name; called on the event loop so acceptance order is file order."""
        name = f"{self.next_seq:012d}.safetensors"
        self.next_seq += 1
        return name

    def write(self, name: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Durably store one submission (temp file, fsync, rename, fsync dir)."""
        atomic_write(self.dir / name, tensors_to_bytes(tensors, {"submission": json.dumps(meta)}))

    def remove(self, names: list[str]) -> None:
        for name in names:
            (self.dir / name).unlink(missing_ok=True)
        if names:
            fsync_dir(self.dir)

    def load_all(self) -> list[SpoolEntry]:
        """Every spooled submission in acceptance order. Unreadable files are moved aside, loudly."""
        entries = []
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink()  # never acknowledged: the 202 is sent only after the rename
        for path in sorted(self.dir.glob("*.safetensors")):
            try:
                tensors, raw = read_safetensors(path)
                meta = json.loads(raw["submission"])
            except Exception as exc:  # noqa: BLE001 - a damaged file must not stop the syncer from starting
                log.error("spool file %s is unreadable (%s); moved to %s.bad", path, exc, path.name)
                os.replace(path, path.with_name(path.name + ".bad"))
                continue
            entries.append(SpoolEntry(path.name, meta, tensors))
        return entries


# --- checkpoint --------------------------------------------------------------------------------------

@dataclass
class Checkpoint:
    theta: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    state: dict  # state.json
    residual: dict[str, torch.Tensor] = field(default_factory=dict)  # the quantized down-link's (downlink.py)


def write_checkpoint(root: Path, ckpt: Checkpoint) -> None:
    """Replace ROOT/checkpoint/ atomically: build checkpoint.tmp/, then swap directories.

    A crash between the two renames leaves checkpoint.old/, which `read_checkpoint` falls back to.
    """
    final, tmp, old = root / "checkpoint", root / "checkpoint.tmp", root / "checkpoint.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_synced(tmp / "theta.safetensors", tensors_to_bytes(ckpt.theta))
    write_synced(tmp / "momentum.safetensors", tensors_to_bytes(ckpt.momentum))
    if ckpt.residual:
        write_synced(tmp / "downlink-residual.safetensors", tensors_to_bytes(ckpt.residual))
    write_synced(tmp / "state.json", json.dumps({"format": CHECKPOINT_FORMAT, **ckpt.state}).encode())
    fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def read_checkpoint(root: Path) -> Checkpoint | None:
    """The last complete checkpoint under ROOT, or None if there is none."""
    for d in (root / "checkpoint", root / "checkpoint.old"):
        if (d / "state.json").exists():
            state = json.loads((d / "state.json").read_text())
            if state.get("format") != CHECKPOINT_FORMAT:
                raise ValueError(f"{d}/state.json has format {state.get('format')!r}; "
                                 f"this syncer reads format {CHECKPOINT_FORMAT}")
            theta, _ = read_safetensors(d / "theta.safetensors")
            momentum, _ = read_safetensors(d / "momentum.safetensors")
            residual_path = d / "downlink-residual.safetensors"
            residual = read_safetensors(residual_path)[0] if residual_path.exists() else {}
            return Checkpoint(theta, momentum, state, residual)
    return None


# --- version reservation -----------------------------------------------------------------------------

class VersionReservation:
    """Durable bound per fragment: every version id of fragment p ever published is below `below[p]`.

    Versions published after the last checkpoint are lost in a crash; learners may hold them. A restarted
    syncer publishes fragment p's next version from `floor[p]` (the old bound) upward, so one version id
    never names two contents. A clean shutdown lowers the bounds to what the final checkpoint holds.
    """

    def __init__(self, root: Path, num_fragments: int):
        self.path = root / "versions-reserved.json"
        saved = json.loads(self.path.read_text())["below"] if self.path.exists() else {}
        self.below = [int(saved.get(str(p), 0)) for p in range(num_fragments)]
        self.floor = list(self.below)  # first id of each fragment this incarnation may publish

    def ensure(self, p: int, version: int) -> None:
        """Make `version` of fragment p publishable: extend the durable bound before it is handed out."""
        if version >= self.below[p]:
            self.below[p] = version + RESERVE_STEP
            self._write()

    def release(self, versions: list[int]) -> None:
        """After a final checkpoint: nothing beyond `versions` was published, so no gap is needed."""
        self.below = [v + 1 for v in versions]
        self._write()

    def _write(self) -> None:
        atomic_write(self.path, json.dumps({"below": {str(p): b for p, b in enumerate(self.below)}}).encode())
