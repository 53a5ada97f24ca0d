"""Reads a syncer's /v1/status (docs/protocol.md) for the job's status: typed as the syncer sent it, with the time
it was read (jobstatus.SyncerReading, from which jobstatus derives the job's progress); where the syncer is."""

from __future__ import annotations

import asyncio
import ssl
import time

import aiohttp
from diloco_trainer.protocol.messages import SyncerStatus
from pydantic import ValidationError

from diloco_operator.plan.jobstatus import SyncerReading

URL_ANNOTATION = "diloco.dev/syncer-url"  # overrides the in-cluster address (an operator outside the cluster)
# The syncer runs the job author's image: its answer is read up to this size. A status of 1,024 learners, each with
# its last 4 lives, is 1.2-1.5 MiB (measured, ids of 10-70 characters), so 8 MiB holds some 5,000 learners.
MAX_STATUS_BYTES = 8 * 2**20
FETCH_TIMEOUT_S = 3.0  # connection, answer and body all told: a syncer that trickles holds no poll longer
CHUNK_BYTES = 64 * 2**10


def annotated_urls(job: dict) -> list[str]:
    """The URLs of the job's diloco.dev/syncer-url annotation (one per shard), or []."""
    annotation = (job["metadata"].get("annotations") or {}).get(URL_ANNOTATION) or ""
    return [u.strip().rstrip("/") for u in annotation.split(",") if u.strip()]


def annotation_problem(job: dict, tls: bool, trust_annotation: bool) -> str | None:
    """Why a trusted diloco.dev/syncer-url annotation is not followed, naming it: a plain http:// URL while the
    job's TLS is on (the operator would send the job's master token in clear). None if it is fine or not used."""
    plain = [u for u in annotated_urls(job) if not u.lower().startswith("https://")]
    if not (trust_annotation and tls and plain):
        return None
    return (f"annotation {URL_ANNOTATION}: {plain[0][:200]!r} is not https:// while the job's TLS is on; the operator "
            "never sends the job's token over plain HTTP, so it reads the syncer through its Service instead (use "
            "https://, or spec.syncer.tls.mode Disabled)")


def syncer_address(job: dict, port: int, tls: bool = False, shard: int = 0, shards: int = 1,
                   trust_annotation: bool = False) -> str:
    """Where the operator reaches one syncer shard: the shard's in-cluster Service (https with TLS). The annotation
    (one URL per shard, comma-separated, in shard order) is followed only when the operator trusts it
    (`diloco operator --trust-syncer-url-annotation`, for an operator outside the cluster): the operator sends the
    job's token there, so a job's author alone must not pick where; and with TLS only if every URL is https://
    (annotation_problem)."""
    meta = job["metadata"]
    override = annotated_urls(job)
    if trust_annotation and len(override) == shards and annotation_problem(job, tls, trust_annotation) is None:
        return override[shard]
    service = f"{meta['name']}-syncer" if shards == 1 else f"{meta['name']}-syncer-{shard}"
    return f"{'https' if tls else 'http'}://{service}.{meta['namespace']}.svc:{port}"


class StatusUnread(Exception):
    """The syncer's status could not be read now; str() is a short single-line reason, never the answer's body.
    `refused`: the syncer answered, but what it sent is no status the operator takes (too large, not a status), as
    opposed to a syncer that cannot answer now (restarting, an error code, too slow)."""

    def __init__(self, reason: str, refused: bool = False):
        super().__init__(reason)
        self.refused = refused


async def read_bounded(resp: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The answer's body, a chunk at a time; StatusUnread as soon as it passes `max_bytes` (never held whole)."""
    if resp.content_length is not None and resp.content_length > max_bytes:
        raise StatusUnread(f"syncer status answer of {resp.content_length} bytes is over {max_bytes} bytes", True)
    chunks, size = [], 0
    async for chunk in resp.content.iter_chunked(CHUNK_BYTES):
        size += len(chunk)
        if size > max_bytes:
            raise StatusUnread(f"syncer status answer over {max_bytes} bytes", True)
        chunks.append(chunk)
    return b"".join(chunks)


async def fetch(url: str, token: str, timeout_s: float = FETCH_TIMEOUT_S, ca_pem: str | None = None,
                server_hostname: str | None = None, max_bytes: int = MAX_STATUS_BYTES) -> SyncerReading:
    """The syncer's status as read now, within `timeout_s` all told and at most `max_bytes`; StatusUnread (a short
    reason) if the syncer cannot be reached (it may be restarting) or answers badly. An https syncer is verified
    against `ca_pem` under the name `server_hostname` (the Service's, whatever address `url` dials)."""
    tls: dict = {}
    if url.startswith("https://"):
        tls = {"ssl": ssl.create_default_context(cadata=ca_pem) if ca_pem else True}
        if server_hostname:
            tls["server_hostname"] = server_hostname
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {token}"}, **tls) as resp:
                if resp.status != 200:  # its body is not read: a reason is the status code
                    raise StatusUnread(f"syncer status answer: HTTP {resp.status}")
                body = await read_bounded(resp, max_bytes)
        return SyncerReading(SyncerStatus.model_validate_json(body), time.time())
    except asyncio.TimeoutError:
        raise StatusUnread(f"syncer status answer not complete within {timeout_s:g} s") from None
    except ValidationError as exc:
        raise StatusUnread(f"syncer status answer is not a status ({exc.error_count()} errors)", True) from None
    except (aiohttp.ClientError, ValueError, TypeError, ssl.SSLError) as exc:
        raise StatusUnread(f"syncer status not read: {type(exc).__name__}") from None
