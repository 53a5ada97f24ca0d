"""The syncer's aiohttp application: the HTTP API of docs/protocol.md, one merge scheduler per fragment,
and periodic checkpoints. Merge math and file I/O run in worker threads so the event loop stays responsive.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from dataclasses import dataclass

import torch
from aiohttp import web

from diloco_trainer.protocol.downlink import encode_chain, fragment_digest, full_nbytes, is_quantized
from diloco_trainer.protocol.messages import (FragmentQuery, HeartbeatAnswer, HeartbeatRequest, LearnerStatus, ProtocolError,
                                     RegisterAnswer, RegisterRequest, SubmitAnswer, SyncerStatus, VersionsAnswer,
                                     parse)
from diloco_trainer.protocol.tokens import token_identity
from diloco_trainer.protocol.wire import WireError, decode_submission, encode_tensors

from diloco_trainer.syncer.epochs import EpochFile
from diloco_trainer.syncer.httpio import BodyPace, ServerLog, json_answer, read_at_most, too_large
from diloco_trainer.syncer.limits import SubmissionLimits
from diloco_trainer.syncer.merge import NotFinite, bound_update
from diloco_trainer.syncer.metrics import SyncerMetrics
from diloco_trainer.syncer.state import Rejected, SyncerState

# GET /v1/fragments/{p}?dtype=...: how a fragment version travels to the learners (config outer.downlink).
DOWNLINK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

log = logging.getLogger(__name__)

MAX_JSON_BODY = 64 * 1024  # register and heartbeat documents are a few hundred bytes
STOP_FLUSH_S = 10.0  # a clean stop's merge of what is pending (Syncer.stop): within the syncer pod's grace period


@dataclass
class SyncerOptions:
    token: str
    max_body_bytes: int = 256 * 2**20
    max_unit_processes: int = 64  # the most processes a learner unit runs (bounds the tokens of an inner step)
    max_concurrent_uploads: int = 4  # submission bodies decoded at once (each holds ~2 bodies + fp32)
    # A request body must arrive at body_min_bytes_per_s or faster after its first body_base_s (408 otherwise).
    body_base_s: float = 30.0
    body_min_bytes_per_s: float = 256 * 1024
    # A connection idle this long after an answer, or without its request's headers this long after it opened or
    # its previous answer, is closed (aiohttp's keepalive_timeout; above the 15 s an aiohttp client keeps an idle
    # connection, so the client normally drops it first).
    keepalive_s: float = 20.0
    checkpoint_every_s: float = 30.0
    heartbeat_s: float = 2.0
    live_after_missed: float = 3.0  # a learner is live while seen within this many heartbeat intervals
    learner_epochs: str | None = None  # the operator's file of retired learner tokens (syncer/epochs.py)

    @property
    def live_timeout_s(self) -> float:
        return self.heartbeat_s * self.live_after_missed


class Syncer:
    """One running syncer: state + options + metrics + background tasks (fragment loops, checkpoints)."""

    def __init__(self, state: SyncerState, options: SyncerOptions):
        if not options.token:
            raise ValueError("the syncer needs a non-empty token")
        self.state, self.opt = state, options
        self.metrics = SyncerMetrics()
        self.started = time.monotonic()
        self.riders_merged: dict[str, int] = {}  # riders merged by this incarnation: "with_others" / "alone"
        self._kicks = [asyncio.Event() for _ in range(state.num_fragments)]
        self._inflight: dict[str, asyncio.Event] = {}
        self._ckpt_lock = asyncio.Lock()
        self._cache: dict[object, bytes] = {}
        self._tasks: list[asyncio.Task] = []
        self.merging: set[int] = set()
        self.limits = SubmissionLimits.from_config(
            state.config, [state.fragment_shapes(p) for p in range(state.num_fragments)], options.max_unit_processes)
        self._upload_slots = asyncio.Semaphore(options.max_concurrent_uploads)
        self.pace = BodyPace(options.body_base_s, options.body_min_bytes_per_s)
        self.server: web.Server | None = None  # set by setup_runner: its connections are counted in /metrics
        self._uploading: set[str] = set()  # learners (by their own token) with a submission request in progress
        self._claims: set[tuple[str, int]] = set()  # (learner, fragment) with a submission being spooled
        self.metrics.shard.labels(str(state.shard), str(state.shards)).set(1)
        self.metrics.owned_fragments.set(len(state.owned))
        self.metrics.quorum.set(state.config.outer.quorum)
        self.metrics.checkpoint_fallbacks.inc(1 if state.checkpoint_fallback else 0)
        for p in state.owned:
            self.metrics.fragment_version.labels(str(p)).set(state.versions[p])
            self.metrics.outer_steps.labels(str(p))  # export zero before the first merge
        for kind in ("delta", "chain", "full"):
            self.metrics.downlink_bytes.labels(kind)
            self.metrics.downlink_answers.labels(kind)

    # --- background work ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._fragment_loop(p), name=f"merge-{p}") for p in self.state.owned]
        self._tasks.append(asyncio.create_task(self._checkpoint_loop(), name="checkpoint"))

    async def stop(self) -> None:
        """Stop merging, merge what is acknowledged and still pending, then write a final checkpoint.

        The flush: the checkpoint a clean stop writes is also a finished job's final model (`diloco export`), and a
        finished job never starts its syncer again to replay the spool; so contributions waiting for their quorum
        or grace window are merged now, below the quorum if need be, within STOP_FLUSH_S. A merge that fails or
        is cut short is simply not committed: its contributions stay pending and spooled, and a next start
        merges them, as after a crash."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self._flush_pending()
        await self.checkpoint()
        # Every published version is in that checkpoint: a clean restart needs no jump in version ids.
        await asyncio.to_thread(self.state.reservation.release, list(self.state.versions))

    async def _flush_pending(self) -> None:
        deadline = time.monotonic() + STOP_FLUSH_S
        for p, pending in enumerate(self.state.pending):
            if not pending:
                continue
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                version = await asyncio.wait_for(self.merge(p), left)
                log.info("stopping: fragment %d's pending contributions merged -> version %d", p, version)
            except Exception as exc:  # noqa: BLE001 - they stay spooled: the next start merges them
                log.warning("stopping: fragment %d's %d pending contribution(s) left to the next start (%r)", p,
                            len(pending), exc)

    async def _fragment_loop(self, p: int) -> None:
        kick = self._kicks[p]
        while True:
            wait = self.state.decide(p, self.opt.live_timeout_s)
            if wait == 0.0:
                try:
                    await self.merge(p)
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - keep serving; the contributions stay pending and spooled
                    log.exception("merge of fragment %d failed; retrying in 1 s", p)
                    await asyncio.sleep(1.0)
                continue
            # None: wait for a contribution, but re-check liveness now and then (a dead learner lowers the
            # effective quorum). Otherwise wait out the grace window unless something arrives first.
            timeout = self.opt.heartbeat_s if wait is None else wait
            try:
                await asyncio.wait_for(kick.wait(), timeout)
            except TimeoutError:
                pass
            kick.clear()

    async def merge(self, p: int) -> int:
        """Merge every pending contribution of fragment p and publish the new version."""
        st, m = self.state, self.metrics
        t0 = time.perf_counter()
        contribs, current, outer = st.prepare_merge(p)
        self.merging.add(p)
        try:
            result = await asyncio.to_thread(st.compute_merge, p, contribs, current, outer)
            await asyncio.to_thread(st.journal_merge, result)  # durable before any learner can see the version
        except NotFinite as exc:
            st.refuse_merge(p, contribs)
            m.merges_refused.labels("not_finite").inc()
            log.error("fragment %d: the merge of %d contributions from %s is not finite (%s): refused, the fragment "
                      "stays at version %d and its contributions are dropped", p, len(contribs),
                      sorted({c.learner_id for c in contribs}), exc, st.versions[p])
            return st.versions[p]
        finally:
            self.merging.discard(p)
        staleness = [st.staleness(c) for c in contribs]
        version = st.commit_merge(result)
        for key in [k for k in self._cache if isinstance(k, tuple) and k[1] == p]:  # fragment, delta, digest
            del self._cache[key]
        self._cache.pop("state", None)
        seconds = time.perf_counter() - t0
        st.policy.observe_sync_time(seconds)
        m.outer_steps.labels(str(p)).inc()
        m.fragment_version.labels(str(p)).set(version)
        m.contributions_per_merge.observe(len(contribs))
        for s in staleness:
            m.staleness.observe(s)
        m.merge_seconds.observe(seconds)
        m.tokens_merged.inc(sum(c.c_tokens for c in contribs))
        if riders := sum(1 for c in contribs if c.rides):
            alone = riders == len(contribs)
            m.riders_merged.labels("true" if alone else "false").inc(riders)
            key = "alone" if alone else "with_others"
            self.riders_merged[key] = self.riders_merged.get(key, 0) + riders
        log.info("fragment %d: merged %d contributions from %s -> version %d (%.3f s)", p, len(contribs),
                 sorted({c.learner_id for c in contribs}), version, seconds)
        return version

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(self.opt.checkpoint_every_s)
            if self.state.dirty:
                try:
                    await self.checkpoint()
                except Exception:  # noqa: BLE001 - a full disk must not stop merging; retried next period
                    log.exception("checkpoint failed")

    async def checkpoint(self) -> None:
        """Write a checkpoint of the current state (off the event loop) and drop the spool files it covers."""
        async with self._ckpt_lock:
            t0 = time.perf_counter()
            job = self.state.checkpoint_job()
            write = asyncio.ensure_future(asyncio.to_thread(self.state.write, job))
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                # stop() cancels the periodic checkpoint, but not its thread, which writes checkpoint.tmp on:
                # hold the lock until that write is done, or the final checkpoint would write the same files beside it.
                self.state.dirty = True
                await asyncio.wait([write])
                if not write.cancelled() and write.exception() is not None:
                    log.warning("the checkpoint interrupted by the stop failed: %s", write.exception())
                raise
            except BaseException:
                self.state.dirty = True
                raise
            self.state.checkpoint_written(job)
            self.metrics.checkpoint_seconds.observe(time.perf_counter() - t0)
            self.metrics.checkpoints.inc()

    # --- helpers -----------------------------------------------------------------------------------

    def _fragment_param(self, request: web.Request) -> int:
        raw = request.match_info["p"]
        # isascii: str.isdigit() is true for "²" and "١", which int() refuses or reads (found by the fuzz test).
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 9) or int(raw) >= self.state.num_fragments:
            raise Rejected(404, f"unknown fragment {raw[:40]!r}; fragments are 0..{self.state.num_fragments - 1}",
                           "unknown_fragment")
        p, st = int(raw), self.state
        if p not in st.owned:
            # 421 Misdirected Request: the right fragment at the wrong server; the reason names the right one.
            raise Rejected(421, f"fragment {p} is owned by syncer shard {st.owner(p)} of {st.shards}; this is shard "
                                f"{st.shard}, owning fragments {st.owned}", "wrong_shard")
        return p

    def _versions(self) -> dict[str, int]:
        return {str(p): self.state.versions[p] for p in self.state.owned}

    def _bytes(self, endpoint: str, body: bytes, headers: dict | None = None) -> web.Response:
        self.metrics.bytes_out.labels(endpoint).inc(len(body))
        return web.Response(body=body, content_type="application/octet-stream", headers=headers)

    async def _json_body(self, request: web.Request, model):
        """The request's JSON body validated as `model`; Rejected (400 naming the field, 413 too large) if not."""
        if request.content_length is not None and request.content_length > MAX_JSON_BODY:
            raise too_large(request.content_length, MAX_JSON_BODY)
        body = await self._read_body(request, MAX_JSON_BODY + 1)
        if len(body) > MAX_JSON_BODY:
            raise too_large(None, MAX_JSON_BODY)
        self.metrics.bytes_in.labels(request.path.rsplit("/", 1)[-1]).inc(len(body))
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise Rejected(400, f"body is not JSON: {exc}", "malformed") from None
        except RecursionError:  # the stdlib parser recurses per nesting level
            raise Rejected(400, "body nests too deeply to be a register or heartbeat document", "malformed") from None
        except ValueError as exc:  # found by the fuzz test: an integer literal over Python's 4300-digit limit
            raise Rejected(400, f"body is not a usable JSON document: {str(exc)[:120]}", "malformed") from None
        if not isinstance(data, dict):
            raise Rejected(400, "body must be a JSON object", "malformed")
        try:
            return parse(model, data)
        except ProtocolError as exc:
            raise Rejected(400, exc.reason, "malformed") from None

    @staticmethod
    def _as_learner(request: web.Request, learner_id: str) -> None:
        """A per-learner token acts only as its own learner (403 otherwise); the job's token acts as anyone."""
        holder = request.get(AUTH_LEARNER)
        if holder is not None and holder != learner_id:
            raise Rejected(403, f"the token of learner {holder!r} cannot act as learner {learner_id!r}", "forbidden")

    # --- handlers ----------------------------------------------------------------------------------

    async def register(self, request: web.Request) -> web.Response:
        req: RegisterRequest = await self._json_body(request, RegisterRequest)
        self._as_learner(request, req.learner_id)
        info = self.state.seen(req.learner_id)
        info.unit, info.world_size, info.device = req.unit, req.world_size, req.device
        log.info("learner %s registered (unit %s, world size %s, device %s)", req.learner_id, req.unit,
                 req.world_size, req.device)
        st = self.state
        return json_answer(RegisterAnswer(config=st.config.model_dump(mode="json"),
                                    plan={str(p): names for p, names in enumerate(st.plan)},
                                    versions=self._versions(), heartbeat_s=self.opt.heartbeat_s,
                                    shard=st.shard, shards=st.shards, owned=st.owned,
                                    version_age_s={str(p): age for p, age in st.version_ages().items()},
                                    step_s=st.policy.step_time.value))

    async def heartbeat(self, request: web.Request) -> web.Response:
        req: HeartbeatRequest = await self._json_body(request, HeartbeatRequest)
        self._as_learner(request, req.learner_id)
        self.state.heartbeat(req.learner_id, req.step, req.step_time_s, req.tokens, req.incarnation,
                             req.steps_discarded)
        return json_answer(HeartbeatAnswer(versions=self._versions()))

    async def submit(self, request: web.Request) -> web.Response:
        p = self._fragment_param(request)
        holder = request.get(AUTH_LEARNER)
        if request.content_length is not None and request.content_length > self._body_limit(p):
            raise self._body_too_large(p, request.content_length)
        if holder is None:  # the job's token (the operator, diloco local): trusted, checked after decoding
            return await self._submit(request, p, None)
        # A learner's own token: who it is, and that it reads one body at a time, is checked before one body byte is
        # read (whether it has one pending for p is checked after decoding: a retry of that one is a duplicate).
        if holder in self._uploading:
            raise Rejected(429, f"learner {holder!r} already has a submission request in progress: one at a time",
                           "upload_limit")
        self._uploading.add(holder)
        try:
            return await self._submit(request, p, holder)
        finally:
            self._uploading.discard(holder)

    async def _read_body(self, request: web.Request, limit: int) -> bytes:
        """The request's body (its first `limit` bytes), at the syncer's pace; Rejected (408) when it falls behind."""
        try:
            return await read_at_most(request, limit, self.pace)
        except Rejected as r:
            if r.status == 408:
                self.metrics.body_timeouts.labels(request.path.rsplit("/", 1)[-1]).inc()
                log.warning("%s %s from %s (learner %s): %s", request.method, request.path, request.remote,
                            request.get(AUTH_LEARNER, "with the job's token"), r.reason)
            raise

    async def _read_submission(self, request: web.Request, p: int):
        """Read a submission body, then decode it under the upload slots (bounded memory); Rejected if malformed or
        too slow. The body takes a slot only once it is in, so a learner that sends slowly (or less than its
        Content-Length) holds nobody else's slot, only its own upload, until its pace runs out (408)."""
        limit, m = self._body_limit(p), self.metrics
        m.uploads_receiving.inc()
        try:
            body = await self._read_body(request, limit + 1)
        finally:
            m.uploads_receiving.dec()
        if len(body) > limit:
            raise self._body_too_large(p)
        m.bytes_in.labels("outer-gradient").inc(len(body))
        async with self._upload_slots:
            m.uploads_in_progress.inc()
            try:
                return await asyncio.to_thread(decode_submission, body, self.state.fragment_shapes(p),
                                               max_header=self.limits.header_bytes[p], require=self.limits.compression)
            except WireError as exc:
                raise Rejected(400, exc.reason, exc.label) from None
            finally:
                m.uploads_in_progress.dec()

    def _body_limit(self, p: int) -> int:
        """The longest submission body for fragment p: a valid one's size under the run's compression, and at most
        --max-body-mb."""
        return min(self.limits.body_bytes[p], self.opt.max_body_bytes)

    def _body_too_large(self, p: int, size: int | None = None) -> Rejected:
        if self.limits.body_bytes[p] > self.opt.max_body_bytes:
            return too_large(size, self.opt.max_body_bytes)
        return too_large(size, self.limits.body_bytes[p], p)

    async def _submit(self, request: web.Request, p: int, holder: str | None) -> web.Response:
        st, m = self.state, self.metrics
        meta, deltas = await self._read_submission(request, p)
        self._as_learner(request, meta.learner_id)
        sid = meta.submission_id
        if holder is not None and not sid.startswith(holder + "."):
            raise Rejected(403, f"submission_id must start with {holder + '.'!r} (the learner's own id and a dot), got "
                                f"{sid!r}", "foreign_submission_id")
        if (why := self.limits.counts_error(meta.c_steps, meta.c_tokens)) is not None:
            raise Rejected(400, why, "tokens_over_config")
        bounded, note = await self._bound(p, meta.learner_id, deltas)
        deltas = bounded.deltas
        while sid in self._inflight:  # the same id is being spooled by a concurrent request
            await self._inflight[sid].wait()
        if st.is_known(sid):
            m.duplicates.inc()
            st.seen(meta.learner_id)
            return _accepted(SubmitAnswer(accepted=True, duplicate=True, pending=len(st.pending[p])))
        claim = (meta.learner_id, p)
        if claim in self._claims or st.has_pending(*claim):
            raise Rejected(429, f"learner {meta.learner_id!r} already has a submission pending for fragment {p}: "
                                "retry after it is merged", "pending_limit")
        c = st.new_contribution(p, meta, deltas)  # Rejected: nothing changed
        c.norms = bounded.norms
        done = self._inflight[sid] = asyncio.Event()
        self._claims.add(claim)
        try:
            await asyncio.to_thread(lambda: st.spool.write(c.spool_name, c.learner_params(), c.spool_meta()))
        except OSError as exc:
            raise Rejected(503, f"could not persist the submission ({exc}); retry later", "persist_failed") from None
        finally:
            del self._inflight[sid]
            self._claims.discard(claim)
            done.set()
        # Durable now: from here on the submission is acknowledged and will be merged exactly once.
        st.add_pending(c)
        st.seen(meta.learner_id)
        m.accepted.inc()
        if c.rides:
            m.riders.inc()
        self._kicks[p].set()
        if note is not None:
            m.updates_bounded.labels(bounded.kind(), "clipped").inc()
        return _accepted(SubmitAnswer(accepted=True, duplicate=False, pending=len(st.pending[p]), note=note))

    async def _bound(self, p: int, learner_id: str, deltas: dict):
        """The norm bound (outer.update_bound, merge.bound_update) on a decoded update: (Bounded, the note for the
        learner or None). Rejected (400 update_norm) in "reject" mode when a tensor is over its bound."""
        st, out = self.state, self.state.config.outer
        history = {} if out.update_bound == "none" else st.norms[p].snapshot()
        ratio = float("inf") if out.update_bound == "none" else out.max_norm_ratio
        bounded = await asyncio.to_thread(bound_update, deltas, st.fragment(p), history, ratio,
                                          clip=out.update_bound == "clip")
        if not bounded.over or out.update_bound == "none":
            bounded.over = []
            return bounded, None
        why = bounded.reason()
        if out.update_bound == "reject":
            self.metrics.updates_bounded.labels(bounded.kind(), "rejected").inc()
            log.warning("learner %s: fragment %d submission refused: %s", learner_id, p, why)
            raise Rejected(400, f"{why}: refused (outer.update_bound reject)", "update_norm")
        log.warning("learner %s: fragment %d submission clipped: %s", learner_id, p, why)
        return bounded, f"clipped: {why}"

    async def get_fragment(self, request: web.Request) -> web.Response:
        st = self.state
        p = self._fragment_param(request)
        try:
            query = FragmentQuery.from_query(request.query)
        except ProtocolError as exc:
            raise Rejected(400, exc.reason, "malformed") from None
        if query.after is not None and st.versions[p] <= query.after:
            return web.Response(status=304)
        version = st.versions[p]
        if query.base is not None and is_quantized(st.config.outer.downlink):
            delta = await self._delta_answer(p, query.base, version)
            if delta is not None:
                return delta
        dtype = query.dtype
        cached = self._cache.get(("fragment", p, dtype))
        if cached is None or cached[0] != version:
            cast = DOWNLINK_DTYPES[dtype]
            tensors = {n: t.to(cast) for n, t in st.fragment(p).items()}
            body = await asyncio.to_thread(encode_tensors, tensors, {"fragment": str(p), "version": str(version),
                                                                     "dtype": dtype, "encoding": "full"})
            cached = self._cache[("fragment", p, dtype)] = (version, body)
        self.metrics.downlink_answers.labels("full").inc()
        self.metrics.downlink_bytes.labels("full").inc(len(cached[1]))
        return self._bytes("fragment", cached[1])

    async def _delta_answer(self, p: int, base: int, version: int) -> web.Response | None:
        """The updates from `base` to the current version of fragment p, if they are all kept and smaller than
        the full fragment; None otherwise (the caller answers with the full fragment)."""
        st = self.state
        chain = st.updates[p].chain(base, version)
        if chain is None or sum(u.nbytes for u in chain) >= full_nbytes(st.fragment_shapes(p)):
            return None
        key = ("delta", p, base, version)
        body = self._cache.get(key)
        if body is None:
            digest = chain[-1].digest if chain else await self._digest(p, version)
            out = st.config.outer
            body = await asyncio.to_thread(encode_chain, p, base, version, chain, out.downlink, out.block_size,
                                           digest)
            if st.versions[p] == version:  # a merge meanwhile dropped this fragment's entries: do not resurrect
                self._cache[key] = body
        kind = "chain" if len(chain) > 1 else "delta"
        self.metrics.downlink_answers.labels(kind).inc()
        self.metrics.downlink_bytes.labels(kind).inc(len(body))
        return self._bytes("fragment", body)

    async def _digest(self, p: int, version: int) -> str:
        """fragment_digest of the current Θ_p (version `version`), hashed once per version off the event loop."""
        key = ("digest", p, version)
        digest = self._cache.get(key)
        if digest is None:
            digest = await asyncio.to_thread(fragment_digest, self.state.fragment(p))
            if self.state.versions[p] == version:
                self._cache[key] = digest
        return digest

    async def get_state(self, request: web.Request) -> web.Response:
        st = self.state
        versions = tuple(st.versions)
        cached = self._cache.get("state")
        if cached is None or cached[0] != versions:
            meta = {"versions": json.dumps(self._versions())}
            body = await asyncio.to_thread(encode_tensors, dict(st.theta), meta)
            cached = self._cache["state"] = (versions, body)
        return self._bytes("state", cached[1])

    async def get_versions(self, request: web.Request) -> web.Response:
        st = self.state
        return json_answer(VersionsAnswer(versions=self._versions(), outer_steps=sum(st.outer_steps),
                                    tokens_merged=st.tokens_merged))

    async def get_status(self, request: web.Request) -> web.Response:
        return json_answer(self.status())

    def status(self) -> SyncerStatus:
        """The /v1/status document (see docs/protocol.md)."""
        st = self.state
        live = st.live_ids(self.opt.live_timeout_s)
        learners = {lid: LearnerStatus(last_seen=i.last_seen_unix, step=i.step, tokens=i.tokens,
                                       step_time_s=i.step_time_s, tokens_merged=i.tokens_merged,
                                       steps_merged=i.steps_merged, submissions_merged=i.submissions_merged,
                                       live=lid in live, unit=i.unit, world_size=i.world_size, device=i.device,
                                       incarnations=i.lives.listed())
                    for lid, i in sorted(st.learners.items())}
        return SyncerStatus(
            versions=self._versions(),
            outer_steps=sum(st.outer_steps),
            outer_steps_per_fragment={str(p): st.outer_steps[p] for p in st.owned},
            merges=sum(st.outer_steps),
            contributions_merged=st.contributions_merged,
            tokens_merged=st.tokens_merged,
            riders_merged=dict(self.riders_merged),
            learners=learners,
            live_learners=len(live),
            pending={str(p): len(st.pending[p]) for p in st.owned},
            grace_s=st.policy.grace_seconds(),
            quorum=st.config.outer.quorum,
            fragments=st.num_fragments,
            shard=st.shard,
            shards=st.shards,
            owned=st.owned,
            uptime_s=time.monotonic() - self.started,
            last_checkpoint=st.last_checkpoint,
        )

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def get_metrics(self, request: web.Request) -> web.Response:
        st, m = self.state, self.metrics
        m.live_learners.set(len(st.live_ids(self.opt.live_timeout_s)))
        m.grace_window.set(st.policy.grace_seconds())
        if self.server is not None:
            m.connections.set(len(self.server.connections))
        for p in st.owned:
            m.pending.labels(str(p)).set(len(st.pending[p]))
        return web.Response(body=m.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


SYNCER = web.AppKey("syncer", Syncer)
# The only paths served without a token: the kubelet's readiness probe and Prometheus's scrape (no secrets in
# either). An allow-list, so a route added later is authenticated unless it is added here on purpose.
PUBLIC_PATHS = frozenset({"/healthz", "/metrics"})
AUTH_LEARNER = web.RequestKey("learner", str)  # the learner a per-learner token belongs to (absent: the job's token)


def _accepted(answer: SubmitAnswer) -> web.Response:
    """The 202 to a submission; `note` only when there is one (answers are otherwise as before it existed)."""
    return web.Response(body=answer.model_dump_json(exclude_none=True).encode(), status=202,
                        content_type="application/json")


def make_app(syncer: Syncer) -> web.Application:
    """The aiohttp application serving `syncer`; starting it starts merging, cleaning it up checkpoints."""
    expected = f"Bearer {syncer.opt.token}".encode()
    epochs = EpochFile(syncer.opt.learner_epochs)

    @web.middleware
    async def guard(request: web.Request, handler):
        try:
            if request.path not in PUBLIC_PATHS:
                given = request.headers.get("Authorization", "")
                if not given.isascii():  # tokens are ASCII; other bytes arrive as surrogates and cannot be compared
                    raise Rejected(401, "missing or wrong bearer token", "unauthorized")
                if not hmac.compare_digest(given.encode(), expected):
                    identity = given.startswith("Bearer ") and token_identity(syncer.opt.token, given[7:])
                    if not identity:
                        raise Rejected(401, "missing or wrong bearer token", "unauthorized")
                    if retired := epochs.refusal(*identity):
                        raise Rejected(403, retired, "token_retired")
                    request[AUTH_LEARNER] = identity[0]
            return await handler(request)
        except Rejected as r:
            if request.path.endswith("/outer-gradient"):
                syncer.metrics.rejected.labels(r.label).inc()
            answer = web.json_response({"error": r.reason}, status=r.status)
            if r.status == 408:  # the rest of a body too slow to wait for is not read: close after the answer
                answer.force_close()
            return answer
        except web.HTTPRequestEntityTooLarge as exc:
            r = too_large(None, syncer.opt.max_body_bytes)
            if request.path.endswith("/outer-gradient"):
                syncer.metrics.rejected.labels(r.label).inc()
            return web.json_response({"error": r.reason + f" ({exc.text})"}, status=413)

    app = web.Application(middlewares=[guard], client_max_size=syncer.opt.max_body_bytes)
    app[SYNCER] = syncer
    app.router.add_post("/v1/register", syncer.register)
    app.router.add_post("/v1/heartbeat", syncer.heartbeat)
    app.router.add_post("/v1/fragments/{p}/outer-gradient", syncer.submit)
    app.router.add_get("/v1/fragments/{p}", syncer.get_fragment)
    app.router.add_get("/v1/state", syncer.get_state)
    app.router.add_get("/v1/versions", syncer.get_versions)
    app.router.add_get("/v1/status", syncer.get_status)
    app.router.add_get("/healthz", syncer.healthz)
    app.router.add_get("/metrics", syncer.get_metrics)

    async def lifecycle(app: web.Application):
        await syncer.start()
        yield
        await syncer.stop()

    app.cleanup_ctx.append(lifecycle)
    return app


async def setup_runner(syncer: Syncer) -> web.AppRunner:
    """The runner serving make_app(syncer), set up (add a web.TCPSite and start it to listen): idle connections,
    and connections whose request headers have not all arrived, are closed after --keepalive-s (aiohttp runs that
    timer from a connection's opening and from each answer, and closes the connection when it fires while no
    complete request has arrived), and client mistakes are logged as one line (httpio.ServerLog)."""
    runner = web.AppRunner(make_app(syncer), handle_signals=False, access_log=None, logger=ServerLog(),
                           keepalive_timeout=syncer.opt.keepalive_s)
    await runner.setup()
    syncer.server = runner.server
    return runner

