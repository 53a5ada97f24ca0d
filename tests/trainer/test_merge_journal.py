"""The merge journal's own durability: a line is written whole even when the kernel takes it in pieces."""

from __future__ import annotations

import os

import pytest

from diloco_trainer.syncer import journal as journal_mod
from diloco_trainer.syncer.journal import JournalEntry, MergeJournal

pytestmark = pytest.mark.fast


def test_a_line_the_kernel_takes_a_few_bytes_at_a_time_is_written_whole(tmp_path, monkeypatch):
    real_write = os.write
    monkeypatch.setattr(journal_mod.os, "write", lambda fd, data: real_write(fd, bytes(data[:5])))
    entries = [JournalEntry(0, 1, ("a.st", "b.st")), JournalEntry(1, 1, ("c.st",))]
    journal = MergeJournal(tmp_path)
    for entry in entries:
        journal.append(entry)
    monkeypatch.undo()
    assert MergeJournal(tmp_path).entries() == entries

