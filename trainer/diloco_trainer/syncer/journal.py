"""The merge journal: one fsynced JSON line per merge (fragment, version, the spool files merged, in order), written
before any learner can see the version. A restarted syncer replays the lines its checkpoint does not cover from the
spool, so every version a learner may hold is known again: a crash between two checkpoints costs no learner its work
(without it, a submission based on a version published after the last checkpoint was refused with 409, "base lost").
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from diloco_trainer.fsutil import atomic_write, fsync_dir

log = logging.getLogger(__name__)

JOURNAL_FILE = "merges.jsonl"


@dataclass(frozen=True)
class JournalEntry:
    fragment: int
    version: int
    spool: tuple[str, ...]  # spool file names of the merged contributions, in merge order

    def to_line(self) -> str:
        return json.dumps({"fragment": self.fragment, "version": self.version, "spool": list(self.spool)})


class MergeJournal:
    """STATE_DIR/merges.jsonl; appends and truncations may come from several worker threads."""

    def __init__(self, root: Path):
        self.path = root / JOURNAL_FILE
        self._lock = threading.Lock()
        self._entries = self._read()

    def _read(self) -> list[JournalEntry]:
        entries = []
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return entries
        if raw and not raw.endswith(b"\n"):
            # Only a crash mid-append tears the last line, and that merge was never published (the append returns
            # before the version is): drop it, so the next append starts on a line of its own.
            raw = raw[: raw.rfind(b"\n") + 1]
            atomic_write(self.path, raw)
        for i, line in enumerate(raw.decode().splitlines()):
            try:
                d = json.loads(line)
                entries.append(JournalEntry(int(d["fragment"]), int(d["version"]), tuple(d["spool"])))
            except (ValueError, KeyError, TypeError):
                log.error("merge journal %s line %d is unreadable; skipped", self.path, i + 1)
        return entries

    def entries(self) -> list[JournalEntry]:
        """Every journaled merge the previous checkpoint does not cover (as far as this file knows), oldest first."""
        with self._lock:
            return list(self._entries)

    def append(self, entry: JournalEntry) -> None:
        """Durably record one merge (the whole line written, fsync; the directory too when the file is new) before
        it is published."""
        line = memoryview((entry.to_line() + "\n").encode())
        with self._lock:
            created = not self.path.exists()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                while line:  # a write may take less than it was given (a signal, a full disk on the way)
                    line = line[os.write(fd, line):]
                os.fsync(fd)
            finally:
                os.close(fd)
            if created:  # the file's own name must survive a crash too
                fsync_dir(self.path.parent)
            self._entries.append(entry)

    def covered(self, versions: list[int]) -> list[JournalEntry]:
        """The checkpoints kept all hold fragment p at `versions[p]` or later: drop the lines they cover (atomic
        rewrite). Returns the lines dropped."""
        with self._lock:
            keep = [e for e in self._entries if e.version > versions[e.fragment]]
            if len(keep) == len(self._entries):
                return []
            dropped = [e for e in self._entries if e.version <= versions[e.fragment]]
            atomic_write(self.path, "".join(e.to_line() + "\n" for e in keep).encode())
            self._entries = keep
            return dropped
