"""Reads a syncer's /v1/status (docs/protocol.md) for the job's status: typed as the syncer sent it, with the time
it was read (jobstatus.SyncerReading, from which jobstatus derives the job's progress); where the syncer is."""

from __future__ import annotations

import asyncio
import ssl
import time

import aiohttp
from diloco_trainer.protocol.messages import SyncerStatus

from diloco_operator.plan.jobstatus import SyncerReading

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
