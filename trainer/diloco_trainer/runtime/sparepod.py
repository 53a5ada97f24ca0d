"""A spare pod's wait for its assignment (protocol/assignment.py): the kubelet rewrites the pod's downward-API file
when the operator annotates the pod, so reading that file is the whole channel (no API access, no open port)."""

from __future__ import annotations

from pathlib import Path

from diloco_trainer.protocol.assignment import Assignment, AssignmentError, decode_key, unseal


class AssignmentWait:
    """Reads `path` on each `poll` until it holds an assignment for `pod`; the spare key is read once, up front, so
    a spare pod without its key fails at start, not at its takeover."""

    def __init__(self, path: Path, key_file: Path, pod: str):
        self.path, self.pod = path, pod
        try:
            self.key = decode_key(key_file.read_text())
        except OSError as exc:
            raise AssignmentError(f"cannot read the spare key {key_file}: {exc}") from None

    def poll(self) -> Assignment | None:
        """The assignment once the file holds one; None while it is missing or empty (no annotation yet)."""
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            return None
        return unseal(self.key, self.pod, text) if text else None
