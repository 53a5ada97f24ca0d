"""Reads a syncer's /v1/status (docs/protocol.md) for the job's status: typed as the syncer sent it, with the time
it was read; jobstatus derives the job's progress from it."""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass
from datetime import datetime, timezone

import aiohttp
from diloco_trainer.protocol.messages import SyncerStatus
from diloco_trainer.runtime.shards import merge_statuses

from diloco_operator import conditions as C

URL_ANNOTATION = "diloco.dev/syncer-url"  # overrides the in-cluster address (an operator outside the cluster)


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


@dataclass(frozen=True)
class SyncerReading:
    """One syncer shard's /v1/status (typed, as the syncer sent it) and when the operator read it (unix seconds)."""

    status: SyncerStatus
    at: float

    @property
    def learners_seen(self) -> dict[str, str]:
        """Learner id -> when the syncer last heard from it (RFC 3339), for those it heard from."""
        return {lid: C.now_iso(datetime.fromtimestamp(info.last_seen, timezone.utc))
                for lid, info in self.status.learners.items() if info.last_seen}

    @property
    def last_checkpoint(self) -> str | None:
        """When the syncer last wrote a checkpoint (RFC 3339), when it reports one."""
        at = self.status.last_checkpoint
        return C.now_iso(datetime.fromtimestamp(at, timezone.utc)) if at else None


def combine(readings: list[SyncerReading]) -> SyncerReading | None:
    """The job's view over its shards' readings (runtime.shards.merge_statuses: merges and merged work add up,
    each shard merging only its own fragments; a learner live if any shard sees it), read when the oldest was;
    its last checkpoint is the oldest shard's, and none until every shard has one (what a restart of every
    shard would resume from at least). None if no shard answered yet."""
    if not readings:
        return None
    merged = merge_statuses([r.status for r in readings])
    checkpoints = [r.status.last_checkpoint for r in readings]
    merged = merged.model_copy(update={"last_checkpoint": min(checkpoints) if all(checkpoints) else None})
    return SyncerReading(status=merged, at=min(r.at for r in readings))


async def fetch(url: str, token: str, timeout_s: float = 3.0, ca_pem: str | None = None,
                server_hostname: str | None = None) -> SyncerReading | None:
    """The syncer's status as read now, or None if the syncer cannot be reached or answers badly (it may be restarting).
    An https syncer is verified against `ca_pem` under the name `server_hostname` (the Service's, whatever
    address `url` dials)."""
    tls: dict = {}
    if url.startswith("https://"):
        tls = {"ssl": ssl.create_default_context(cadata=ca_pem) if ca_pem else True}
        if server_hostname:
            tls["server_hostname"] = server_hostname
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {token}"}, **tls) as resp:
                if resp.status != 200:
                    return None
                return SyncerReading(SyncerStatus.model_validate(await resp.json()), time.time())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, TypeError, ssl.SSLError):
        return None
