"""Per-learner bearer tokens: `<learner id>.<HMAC-SHA256 of the id under the job's token>`. The syncer checks
one without a list of tokens (it holds the job's token), and a learner holding one can act only under its own
id: a leaked learner credential cannot submit, register or heartbeat as another learner. The job's own token
(the syncer's and the operator's) still acts as anyone. Torch-free."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from pathlib import Path

_CONTEXT = b"diloco learner token v1:"
_CONTEXT_EPOCH = b"diloco learner token v2:"  # with an epoch: `<id>.e<epoch>.<mac>`
MAX_EPOCH = 10**12


def _mac(job_token: str, learner_id: str, epoch: int = 0) -> str:
    message = _CONTEXT + learner_id.encode() if not epoch else _CONTEXT_EPOCH + f"{epoch}:".encode() + learner_id.encode()
    digest = hmac.new(job_token.encode(), message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def learner_token(job_token: str, learner_id: str, epoch: int = 0) -> str:
    """The token that lets `learner_id` (and only it) talk to a syncer holding `job_token`. `epoch` (>= 1) is the
    unit's incarnation of that id: a syncer told that the epoch was retired (syncer/epochs.py) refuses it, while
    a later unit of the same name gets a token of its own. Epoch 0 is the token without one (before epochs)."""
    if not job_token or not learner_id:
        raise ValueError("a learner token needs the job's token and a learner id")
    if not 0 <= epoch <= MAX_EPOCH:
        raise ValueError(f"a token epoch is 0..{MAX_EPOCH}, got {epoch}")
    if not epoch:
        return f"{learner_id}.{_mac(job_token, learner_id)}"
    return f"{learner_id}.e{epoch}.{_mac(job_token, learner_id, epoch)}"


def token_identity(job_token: str, presented: str) -> tuple[str, int] | None:
    """(learner id, epoch) a presented per-learner token was issued for, or None if it is not one of `job_token`'s."""
    rest, dot, mac = presented.rpartition(".")
    if not dot or not rest:
        return None
    learner_id, dot, tag = rest.rpartition(".")
    if dot and learner_id and tag[:1] == "e" and tag[1:].isascii() and tag[1:].isdigit() and len(tag) <= 14:
        epoch = int(tag[1:])
        if epoch and hmac.compare_digest(mac.encode(), _mac(job_token, learner_id, epoch).encode()):
            return learner_id, epoch
    return (rest, 0) if hmac.compare_digest(mac.encode(), _mac(job_token, rest).encode()) else None


def token_learner(job_token: str, presented: str) -> str | None:
    """The learner id a presented per-learner token was issued to, or None if it is not one of `job_token`'s."""
    identity = token_identity(job_token, presented)
    return identity[0] if identity else None


def read_bearer_token(token_file: str | None, token_env: str) -> str:
    """The token a learner or syncer presents or checks: from `token_file` (--token-file, read once, surrounding
    whitespace stripped) when given, else from the environment variable `token_env` (--token-env). Missing or
    empty raises ValueError naming the flag."""
    if token_file:
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--token-file {token_file}: cannot read the token: {exc}") from None
        if not token:
            raise ValueError(f"--token-file {token_file}: the file is empty")
        return token
    token = os.environ.get(token_env, "")
    if not token:
        raise ValueError(f"set the shared token in the environment variable {token_env} (--token-env), or give "
                         "--token-file")
    return token
