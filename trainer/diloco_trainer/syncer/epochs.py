"""Retired learner tokens: the operator's file of each learner id's current token epoch (a ConfigMap mounted into
the syncer pod), re-read when it changes. The syncer checks tokens against it without calling any API."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
EPOCHS_KEY = "epochs.json"  # {"learners": {"<id>": {"epoch": N, "live": true|false}}}


@dataclass(frozen=True)
class Epoch:
    epoch: int
    live: bool


def parse_epochs(text: str) -> dict[str, Epoch]:
    """The learners of an epochs document; ValueError naming what is wrong."""
    doc = json.loads(text)
    learners = doc.get("learners") if isinstance(doc, dict) else None
    if not isinstance(learners, dict):
        raise ValueError("an epochs document is {\"learners\": {id: {\"epoch\": N, \"live\": bool}}}")
    out = {}
    for lid, entry in learners.items():
        if not (isinstance(entry, dict) and type(entry.get("epoch")) is int and type(entry.get("live")) is bool):
            raise ValueError(f"learners[{lid!r}] must be {{\"epoch\": int, \"live\": bool}}")
        out[lid] = Epoch(entry["epoch"], entry["live"])
    return out


def refusal(known: dict[str, Epoch], learner_id: str, epoch: int) -> str | None:
    """Why the token of `learner_id` at `epoch` is retired, or None if it may act. A learner or epoch the file does
    not know yet is accepted: the operator gives a new unit a higher epoch before the file reaches the syncer, so a
    new unit never waits on it, and a removed or replaced one is refused once it does."""
    entry = known.get(learner_id)
    if entry is None or epoch > entry.epoch or (epoch == entry.epoch and entry.live):
        return None
    why = "its unit was removed" if epoch == entry.epoch else f"its unit was replaced (current epoch {entry.epoch})"
    return f"the token of learner {learner_id!r} (epoch {epoch}) was retired: {why}"


class EpochFile:
    """The epochs file at `path`, re-read whenever it changes (a ConfigMap update swaps it atomically). A missing
    file retires nothing (no operator, e.g. `diloco local`); an unreadable one keeps the last good contents."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self.known: dict[str, Epoch] = {}
        self._stamp: tuple | None = None

    def current(self) -> dict[str, Epoch]:
        if self.path is None:
            return self.known
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self.known, self._stamp = {}, None
            return self.known
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            try:
                self.known = parse_epochs(self.path.read_text())
                self._stamp = stamp
            except (OSError, ValueError) as exc:
                log.error("cannot use the learner epochs file %s (keeping the last good one): %s", self.path, exc)
        return self.known

    def refusal(self, learner_id: str, epoch: int) -> str | None:
        return refusal(self.current(), learner_id, epoch)
