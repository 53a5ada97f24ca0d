"""Per-learner bearer tokens: `<learner id>.<HMAC-SHA256 of the id under the job's token>`. The syncer checks
one without a list of tokens (it holds the job's token), and a learner holding one can act only under its own
id: a leaked learner credential cannot submit, register or heartbeat as another learner. The job's own token
(the syncer's and the operator's) still acts as anyone. Torch-free."""

from __future__ import annotations

import base64
import hashlib
import hmac

_CONTEXT = b"diloco learner token v1:"


def _mac(job_token: str, learner_id: str) -> str:
    digest = hmac.new(job_token.encode(), _CONTEXT + learner_id.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def learner_token(job_token: str, learner_id: str) -> str:
    """The token that lets `learner_id` (and only it) talk to a syncer holding `job_token`."""
    if not job_token or not learner_id:
        raise ValueError("a learner token needs the job's token and a learner id")
    return f"{learner_id}.{_mac(job_token, learner_id)}"


def token_learner(job_token: str, presented: str) -> str | None:
    """The learner id a presented per-learner token was issued to, or None if it is not one of `job_token`'s."""
    learner_id, dot, mac = presented.rpartition(".")
    if not dot or not learner_id:
        return None
    return learner_id if hmac.compare_digest(mac.encode(), _mac(job_token, learner_id).encode()) else None
