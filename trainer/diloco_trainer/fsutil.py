"""Crash-safe file writes: a reader, or a process restarted after a crash, sees the old file or the complete
new one, never half of one. Temporary files end in `.tmp` so their owners can sweep them."""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make renames and deletions inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it (no rename: for files inside a directory swapped as a whole)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path: Path, data: bytes, mode: int | None = None) -> None:
    """Replace `path` with `data` atomically and durably (unique temp file, fsync, rename, fsync dir). The file is
    private to its owner (0600) unless `mode` says otherwise (e.g. 0o644 for data other users' pods read)."""
    with atomic_open(path, mode) as f:
        f.write(data)


@contextmanager
def atomic_open(path: Path, mode: int | None = None):
    """A binary file to stream into that replaces `path` atomically and durably when the block ends without an
    exception (for files too large to hold in memory); on an exception `path` is left as it was. Private (0600)
    unless `mode` says otherwise."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp")
    if mode is not None:
        os.fchmod(fd, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj, indent: int | None = None) -> None:
    """`atomic_write` of `obj` as JSON."""
    atomic_write(path, json.dumps(obj, indent=indent).encode())


def read_jsonl(path: Path) -> list[dict]:
    """All complete JSON lines of a file (a torn last line, from a killed writer, is skipped)."""
    if not path.exists():
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
