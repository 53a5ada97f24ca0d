"""The operator's writes: create-or-patch by hash annotation (`ensure`, each write also into the watch cache),
Events, and bounded parallel writes; an object of the job's name it does not control is never touched."""

from __future__ import annotations

import asyncio
import logging
import time

from diloco_kube.client import ApiError, Kube, Resource
from diloco_operator.objects import builders as O
from diloco_operator.reconcile.cache import Cache
from diloco_operator.remote.clusters import Remote

log = logging.getLogger("diloco_operator")
PARALLEL_WRITES = 16  # the client's thread pool: more in flight would only queue there


async def bounded(coros: list) -> None:
    """Await `coros` at most PARALLEL_WRITES at a time; the first error is raised once all have ended."""
    sem = asyncio.Semaphore(PARALLEL_WRITES)

    async def one(c):
        async with sem:
            return await c
    results = await asyncio.gather(*(one(c) for c in coros), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


class NotControlled(Exception):
    """An object the job needs exists under its name and is not the job's (another job's, or the user's): never
    used, patched or adopted. The message names it."""

    def __init__(self, kind: str, namespace: str, name: str, owner: str | None):
        by = f"controlled by uid {owner}" if owner else "controlled by nothing"
        super().__init__(f"{kind} {namespace}/{name} exists and is not this job's ({by}): rename the job, or remove "
                         "that object if it is a leftover")


def check_controller(res: Resource, desired: dict, current: dict | None) -> None:
    if current is not None and not O.same_controller(desired, current):
        meta = desired["metadata"]
        raise NotControlled(desired.get("kind") or res.plural, meta["namespace"], meta["name"],
                            O.controller_uid(current))


class Writer:
    """Writes through `kube`, remembering what unwatched kinds were ensured (read back at most every ensure_ttl_s)."""

    def __init__(self, kube: Kube, cache: Cache, ensure_ttl_s: float = 300.0):
        self.kube = kube
        self.cache = cache
        # Objects that are not watched (Secret, ConfigMap, PVCs, Services) are read back at most every
        # ensure_ttl_s: (plural, namespace, name, owner uid[, cluster]) -> (hash ensured, when). The owner's UID is
        # in the key: a job re-created under its old name owns none of what was ensured for the old one.
        self.ensured: dict[tuple[str, ...], tuple[str, float]] = {}
        self.ensure_ttl_s = ensure_ttl_s

    def prune(self) -> None:
        """Forget entries past their TTL (they would be read back anyway): deleted owners' go this way."""
        now = time.monotonic()
        self.ensured = {k: v for k, v in self.ensured.items() if now - v[1] < self.ensure_ttl_s}

    async def events(self, obj: dict, events: list[tuple[str, str, str]]) -> None:
        async def post(type_: str, reason: str, message: str) -> None:
            log.info("%s/%s %s: %s", obj["kind"], obj["metadata"]["name"], reason, message)
            try:
                await self.kube.event(obj, type_, reason, message)
            except ApiError as exc:  # an Event is best effort; the status holds the truth
                log.warning("could not post event %s on %s: %s", reason, obj["metadata"]["name"], exc)
        await bounded([post(*e) for e in events])

    async def ensure(self, res: Resource, desired: dict, *, update: bool = True,
                     cached: dict | None | bool = False, remote: Remote | None = None) -> dict:
        """Create `desired` if missing; if it exists and its hash annotation differs, merge-patch it. `cached` is
        the watched copy (None: not there); unwatched kinds are read back only every ensure_ttl_s. With `remote`:
        in that cluster (never watched), as O.in_remote_cluster makes it."""
        kube = self.kube
        owner = O.controller_uid(desired) or ""
        if remote is not None:
            desired, kube, cached = O.in_remote_cluster(desired, remote.namespace), remote.kube, False
        want = O.spec_hash({k: v for k, v in desired.items() if k != "metadata"})
        desired["metadata"].setdefault("annotations", {})["diloco.dev/hash"] = want
        meta = desired["metadata"]
        key = (res.plural, meta["namespace"], meta["name"], owner) + ((remote.cluster,) if remote else ())
        if cached is False:
            done = self.ensured.get(key)
            # Create-only objects (update=False, e.g. the random token) are never compared, only re-created if gone.
            if done and (done[0] == want or not update) and time.monotonic() - done[1] < self.ensure_ttl_s:
                return desired
            if not update:  # create-only: one POST instead of a GET first; who holds an existing one is checked
                current = await kube.create(res, desired)
                if current is None:
                    current = await kube.get(res, meta["namespace"], meta["name"])
                    check_controller(res, desired, current)
                self.ensured[key] = (want, time.monotonic())
                return current or desired
            current = await kube.get(res, meta["namespace"], meta["name"])
        else:
            current = cached
        written = None
        if current is None:
            written = await kube.create(res, desired)
            if written is None:  # there, but not in the watch (e.g. a Deployment without our labels)
                current = await kube.get(res, meta["namespace"], meta["name"])
            current = written or current or desired
        check_controller(res, desired, current)
        if update and current["metadata"].get("annotations", {}).get("diloco.dev/hash") != want:
            patch = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}
            current = written = await kube.merge_patch(res, meta["namespace"], meta["name"], patch)
        if cached is False:
            self.ensured[key] = (want, time.monotonic())
        elif written is not None:
            self.cache.wrote(res.plural, written)
        return current
