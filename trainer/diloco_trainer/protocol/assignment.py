"""A spare pod's assignment: which learner unit a warm spare pod becomes, and that unit's learner token.

The operator writes it into the spare pod's annotation `diloco.dev/assignment` in the same patch that relabels the
pod as the unit's; the kubelet shows it to the pod through a downward-API file, and `diloco pod-learner
--assignment-file` starts the unit's learner from its warm process. An annotation is readable by anyone who may read
pods, so the token inside is sealed (AES-256-GCM) under the job's spare key, which only the operator (it derives it
from the job's token) and the job's spare pods (a Secret they mount) hold, and bound to the pod's name and to the
identity beside it: a copy pasted onto another pod does not open, nor does one whose learner id or data shard was
edited. Torch-free; JSON only.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

ANNOTATION = "diloco.dev/assignment"
POD_NAME_ENV = "DILOCO_POD_NAME"  # a spare pod's own name (downward API): assignments are sealed for one pod
_KEY_CONTEXT = b"diloco spare key v1:"
_AAD_CONTEXT = "diloco assignment v2:"
MAX_TEXT = 8192  # an assignment is ~300 bytes; anything far larger is not one


class AssignmentError(ValueError):
    """An assignment that cannot be read: malformed, or sealed under another key or for another pod."""


@dataclass(frozen=True)
class Assignment:
    """What a spare pod becomes: the learner id (the unit's name), its data shard (`--unit`) out of `units`, and the
    unit's own learner token (tokens.py)."""

    learner_id: str
    unit: int
    units: int
    token: str

    def learner_args(self, token_file: str) -> list[str]:
        """The `diloco learner` arguments this assignment adds to a spare's (the token read from `token_file`)."""
        return ["--learner-id", self.learner_id, "--unit", str(self.unit), "--units", str(self.units),
                "--token-file", token_file]


def spare_key(job_token: str, job: str) -> bytes:
    """The job's spare key (32 bytes): derived from the job's token, so the operator keeps no extra secret."""
    if not job_token or not job:
        raise ValueError("a spare key needs the job's token and name")
    return hmac.new(job_token.encode(), _KEY_CONTEXT + job.encode(), hashlib.sha256).digest()


def encode_key(key: bytes) -> str:
    return base64.b64encode(key).decode()


def decode_key(text: str) -> bytes:
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except ValueError as exc:
        raise AssignmentError(f"the spare key is not base64: {exc}") from None
    if len(key) != 32:
        raise AssignmentError(f"the spare key must be 32 bytes, got {len(key)}")
    return key


def _aad(pod: str, learner_id: str, unit: int, units: int) -> bytes:
    """What the seal binds the token to: the pod's name and the identity in the clear."""
    return _AAD_CONTEXT.encode() + json.dumps([pod, learner_id, unit, units], separators=(",", ":")).encode()


def seal(key: bytes, pod: str, assignment: Assignment) -> str:
    """The annotation's value: the identity in the clear (a person reading the pod sees what it became), the token
    sealed for `pod` alone."""
    nonce = os.urandom(12)
    a = assignment
    sealed = AESGCM(key).encrypt(nonce, a.token.encode(), _aad(pod, a.learner_id, a.unit, a.units))
    return json.dumps({"learnerId": assignment.learner_id, "unit": assignment.unit, "units": assignment.units,
                       "token": base64.b64encode(nonce + sealed).decode()}, sort_keys=True, separators=(",", ":"))


def unseal(key: bytes, pod: str, text: str) -> Assignment:
    """The assignment in `text` (the annotation's value) for pod `pod`; AssignmentError says why it is not one."""
    if len(text) > MAX_TEXT:
        raise AssignmentError(f"an assignment is at most {MAX_TEXT} characters, got {len(text)}")
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise AssignmentError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise AssignmentError("not a JSON object")
    learner_id, unit, units, token = (doc.get(k) for k in ("learnerId", "unit", "units", "token"))
    if not isinstance(learner_id, str) or not learner_id:
        raise AssignmentError("learnerId must be a non-empty string")
    if not isinstance(unit, int) or not isinstance(units, int) or not 0 <= unit < units:
        raise AssignmentError(f"unit and units must be integers with 0 <= unit < units, got {unit!r}, {units!r}")
    if not isinstance(token, str):
        raise AssignmentError("token must be a string")
    try:
        raw = base64.b64decode(token, validate=True)
        plain = AESGCM(key).decrypt(raw[:12], raw[12:], _aad(pod, learner_id, unit, units))
    except (ValueError, InvalidTag):
        raise AssignmentError(f"its token does not open under this job's spare key for pod {pod} as learner "
                              f"{learner_id} (unit {unit} of {units}): sealed under another key, for another pod, "
                              "or its identity was edited") from None
    return Assignment(learner_id, unit, units, plain.decode())
