"""The syncer's state on disk: atomic, checksummed checkpoints (the latest and the previous one, its fallback), the
spool of acknowledged submissions, and the version reservation that keeps version ids unique across crashes.
safetensors and JSON only; never pickle.
"""

from __future__ import annotations

import hashlib
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

LATEST, PREVIOUS, DAMAGED = "checkpoint", "checkpoint.old", "checkpoint.corrupt"
RESIDUAL_FILE = "downlink-residual.safetensors"
CHECKPOINT_FILES = ("theta.safetensors", "momentum.safetensors", RESIDUAL_FILE)


@dataclass
class Checkpoint:
    theta: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    state: dict  # state.json
    residual: dict[str, torch.Tensor] = field(default_factory=dict)  # the quantized down-link's (downlink.py)


class CheckpointDamaged(ValueError):
    """A checkpoint directory that cannot be trusted: a file missing, truncated, unparsable or not its checksum."""


@dataclass
class LoadedCheckpoint:
    checkpoint: Checkpoint
    path: Path  # the directory it was read from
    damaged: list[str]  # why each newer directory was passed over (non-empty: a fallback to the previous one)


def write_checkpoint(root: Path, ckpt: Checkpoint) -> None:
    """Write ROOT/checkpoint/ and keep the one it replaces as ROOT/checkpoint.old/, the fallback should the new one
    be found damaged. Each file is fsynced and its sha256 recorded in state.json (itself checksummed); the
    directories are swapped by renames (checkpoint.tmp/ -> checkpoint/), the root fsynced after them."""
    final, tmp, old = root / LATEST, root / "checkpoint.tmp", root / PREVIOUS
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sums: dict[str, str] = {}
    parts = {"theta.safetensors": ckpt.theta, "momentum.safetensors": ckpt.momentum}
    if ckpt.residual:
        parts[RESIDUAL_FILE] = ckpt.residual
    for name, tensors in parts.items():  # one file's bytes in memory at a time
        data = tensors_to_bytes(tensors)
        write_synced(tmp / name, data)
        sums[name] = hashlib.sha256(data).hexdigest()
    write_synced(tmp / "state.json", _sealed({"format": CHECKPOINT_FORMAT, **ckpt.state, "files": sums}))
    fsync_dir(tmp)
    if final.exists():  # absent after a fallback set it aside: checkpoint.old/ then stays the previous one
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(root)


def load_checkpoint(root: Path) -> LoadedCheckpoint | None:
    """The newest checkpoint under ROOT that is whole, or None if there is none. A damaged checkpoint/ is logged
    and passed over for checkpoint.old/; ValueError (naming each directory and what is wrong) if none is usable."""
    damaged: list[str] = []
    for d in (root / LATEST, root / PREVIOUS):
        if not d.exists():
            continue
        try:
            return LoadedCheckpoint(read_checkpoint_dir(d), d, damaged)
        except CheckpointDamaged as exc:
            damaged.append(str(exc))
            log.error("checkpoint %s is damaged: %s", d, exc)
    if damaged:
        raise ValueError(f"no usable checkpoint in {root}: " + "; ".join(damaged) + " (nothing to fall back to). "
                         "Restore checkpoint/ from a backup, or start the run anew on a fresh --state-dir")
    return None


def read_checkpoint(root: Path) -> Checkpoint | None:
    """The newest whole checkpoint under ROOT (see load_checkpoint), or None if there is none."""
    loaded = load_checkpoint(root)
    return loaded.checkpoint if loaded else None


def read_checkpoint_dir(d: Path) -> Checkpoint:
    """One checkpoint directory, checked against its checksums (a checkpoint written before they existed is read
    unchecked). CheckpointDamaged if anything is missing or wrong; plain ValueError for another format."""
    try:
        state = _unsealed((d / "state.json").read_bytes())
    except (OSError, ValueError) as exc:
        raise CheckpointDamaged(f"{d / 'state.json'}: {exc}") from None
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{d}/state.json has format {state.get('format')!r}; "
                         f"this syncer reads format {CHECKPOINT_FORMAT}")
    sums = state.pop("files", None)
    if sums is None:  # before checksums: the residual file exists only with a quantized down-link
        names = [n for n in CHECKPOINT_FILES if n != RESIDUAL_FILE or (d / n).exists()]
    elif not isinstance(sums, dict) or not set(CHECKPOINT_FILES[:2]) <= set(sums) <= set(CHECKPOINT_FILES):
        raise CheckpointDamaged(f"{d / 'state.json'}: its list of files is {sums!r}")
    else:
        names = list(sums)
    tensors = {}
    for name in names:
        path = d / name
        try:
            if sums is not None:
                with open(path, "rb") as f:
                    got = hashlib.file_digest(f, "sha256").hexdigest()
                if got != sums[name]:
                    raise CheckpointDamaged(f"{path}: its sha256 is {got[:16]}..., state.json recorded "
                                            f"{str(sums[name])[:16]}...")
            tensors[name] = read_safetensors(path)[0]
        except CheckpointDamaged:
            raise
        except Exception as exc:  # noqa: BLE001 - a missing, truncated or garbled file
            raise CheckpointDamaged(f"{path}: {exc}") from None
    return Checkpoint(tensors["theta.safetensors"], tensors["momentum.safetensors"], state,
                      tensors.get(RESIDUAL_FILE, {}))


def set_aside_damaged(root: Path) -> Path:
    """After a fallback: move the damaged checkpoint/ to checkpoint.corrupt/ (kept for a look; an older one there is
    replaced), so the next write keeps checkpoint.old/ as the previous checkpoint instead of the damaged one."""
    aside = root / DAMAGED
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(root / LATEST, aside)
    fsync_dir(root)
    return aside


def previous_versions(root: Path) -> dict[str, int] | None:
    """The fragment versions checkpoint.old/ holds (from its state.json), or None if there is none or it is
    unreadable: what the merge journal and the spool must reach back to."""
    try:
        return dict(_unsealed((root / PREVIOUS / "state.json").read_bytes())["versions"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _sealed(doc: dict) -> bytes:
    """state.json bytes with a sha256 of the rest of the document (keys sorted) in "sha256"."""
    return json.dumps({**doc, "sha256": _doc_sha256(doc)}).encode()


def _unsealed(raw: bytes) -> dict:
    doc = json.loads(raw)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    want = doc.pop("sha256", None)  # absent in checkpoints written before checksums
    if want is not None and want != _doc_sha256(doc):
        raise ValueError("its content does not match its sha256")
    return doc


def _doc_sha256(doc: dict) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


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
