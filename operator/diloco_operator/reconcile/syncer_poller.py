"""Polls each ready syncer shard's /v1/status in the background (at most one poll in flight per shard, at most every
poll_s); reconciles read the last answer from the job's JobState, so a slow syncer never delays healing."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Callable

from diloco_kube.client import SECRETS, ApiError, Kube
from diloco_operator.api import models as api
from diloco_operator.objects import builders as O
from diloco_operator.reconcile import syncer_status
from diloco_operator.reconcile.jobstate import JobState, JobStates, SyncerTls

log = logging.getLogger("diloco_operator")


class SyncerPoller:
    """Keeps each job's `syncer_readings` fresh; a changed reading re-queues the job (`enqueue`)."""

    def __init__(self, kube: Kube, jobs: JobStates, enqueue: Callable[..., None], trust_syncer_url: bool = False,
                 poll_s: float = 10.0):
        self.kube = kube
        self.jobs = jobs
        self.enqueue = enqueue
        self.trust_syncer_url = trust_syncer_url  # follow the diloco.dev/syncer-url annotation (syncer_address)
        self.poll_s = poll_s
        self.background: set[asyncio.Task] = set()

    def poll(self, job: dict, tls: SyncerTls, shard: int = 0, shards: int = 1) -> None:
        """Start a background poll of one syncer shard (at most one in flight, at most every poll_s);
        reconciles read the cached answer, so a slow or unreachable syncer never delays healing."""
        url = syncer_status.syncer_address(job, api.SYNCER_PORT, tls=tls.secret is not None, shard=shard,
                                           shards=shards, trust_annotation=self.trust_syncer_url)
        state = self.jobs.of(job)
        last = state.syncer_polled.get(url)
        if last is not None and time.monotonic() - last < self.poll_s:
            return
        state.syncer_polled[url] = time.monotonic()
        task = asyncio.create_task(self._fetch(state, url, tls.ca, shard, shards))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def job_token(self, state: JobState) -> str:
        """The job's token (the syncer's), read once: created once, never changed ("" while it does not exist)."""
        if (token := state.token) is None:
            secret = await self.kube.get(SECRETS, state.namespace, O.secret_name(state.name))
            token = base64.b64decode((secret or {}).get("data", {}).get(O.TOKEN_KEY, "")).decode()
            if token:
                state.token = token
        return token

    async def _fetch(self, state: JobState, url: str, ca: str | None = None, shard: int = 0, shards: int = 1) -> None:
        ns, name = state.namespace, state.name
        try:
            token = await self.job_token(state)
            info = await syncer_status.fetch(url, token, ca_pem=ca,
                                             server_hostname=O.syncer_name(name, shard, shards))
        except ApiError as exc:
            log.warning("cannot read the token of job %s/%s: %s", ns, name, exc)
            return
        except syncer_status.StatusUnread as exc:  # restarting, or a bad answer: the last reading stays
            log.log(logging.WARNING if exc.refused else logging.DEBUG, "job %s/%s: %s", ns, name, exc)
            return
        before = state.syncer_readings.get(shard)
        changed = before is None or before.status != info.status  # not just read again
        state.syncer_readings[shard] = info
        if changed:
            self.enqueue(("job", ns, name))
        self.enqueue(("job", ns, name), self.poll_s)  # keep the numbers fresh while it answers
