"""The learner's network side: a background thread with its own asyncio loop and aiohttp session that registers,
heartbeats, submits outer gradients with retries, and fetches newer fragments into mailboxes the compute loop reads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import random
import threading
import time
from collections import OrderedDict
from pathlib import Path

import aiohttp
from torch import Tensor

from diloco_trainer.protocol.messages import (ErrorAnswer, HeartbeatAnswer, HeartbeatRequest, LinkCounters,
                                              RegisterAnswer, RegisterRequest, SubmitAnswer, VersionsAnswer)
from diloco_trainer.config import TrainConfig
from diloco_trainer.protocol.downlink import decode_answer, initial_theta, is_quantized, reconstruct
from diloco_trainer.protocol.tls import client_context, warn_if_plain
from diloco_trainer.protocol.wire import WireError, decode_tensors
from diloco_trainer.learner.link import Answer, Bootstrap, FragmentUpdate, HeldFn, Submission, SyncerRefused
from diloco_trainer.learner.stop_flag import StopFlag

log = logging.getLogger(__name__)


class SyncerClient:
    """Network client of one learner unit (rank 0 only). All public methods are thread-safe and never block,
    except `bootstrap`, which retries until the syncer answers (or `stop_flag` is set)."""

    def __init__(self, url: str, token: str, learner_id: str, *, unit: int = 0, world_size: int = 1,
                 device: str = "cpu", poll_s: float = 0.25, timeout_s: float = 30.0,
                 backoff_s: float = 0.2, backoff_max_s: float = 1.0, ca: Path | None = None, shard: int = 0,
                 shards: int = 1):
        self.url = url.rstrip("/")
        self.shard, self.shards = shard, shards  # which syncer shard `url` must be, of how many (shardmap.py)
        # https: the syncer's certificate is verified against `ca` (else the system's CAs); see tls.py.
        self._ssl = client_context(ca) if self.url.startswith("https://") else None
        warn_if_plain(self.url, f"learner {learner_id}")
        self.learner_id = learner_id
        self._headers = {"Authorization": f"Bearer {token}"}
        self._register_body = RegisterRequest(learner_id=learner_id, unit=unit, world_size=world_size,
                                              device=device).model_dump()
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.downlink = "fp32"  # how fragment versions come: the run's outer.downlink, taken from the registration
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.heartbeat_s = 5.0
        self.stats = LinkCounters()  # `pending` is counted when asked (snapshot)
        self._lock = threading.Lock()
        self._outbox: OrderedDict[str, Submission] = OrderedDict()  # submission id -> latest body
        self._maybe_delivered: dict[str, Submission] = {}  # first attempt whose fate is unknown, per id
        self._posting: str | None = None  # the id the sender is sending now, until its answer is booked
        self._acked_ids: set[str] = set()
        self._updates: dict[int, FragmentUpdate] = {}  # fragment -> newest fetched, not yet adopted
        self._answers: list[Answer] = []
        self._have: dict[int, int] = {}  # fragment -> newest version fetched (handed to the learner)
        self._held: dict[int, dict[str, Tensor]] = {}  # fragment -> exact fp32 values of version _have[p]
        self._report = HeartbeatRequest(learner_id=learner_id, step=0, tokens=0, step_time_s=0.0)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="syncer-client", daemon=True)
        self._session: aiohttp.ClientSession | None = None
        self._wake_sender = asyncio.Event()
        self._wake_poller = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._booting: list[concurrent.futures.Future] = []  # bootstraps under way (cancelled by close)
        self.bootstrap_failures = 0  # attempts to reach the syncer at start-up that failed
        self._booted = False  # the bootstrap has completed (versions known)
        self._saved_versions: dict[int, int] | None = None  # see hold()
        self._draining = False
        self._thread.start()

    # ------------------------------------------------------------------ compute-thread API

    def bootstrap(self, stop_flag: StopFlag | threading.Event | None = None, held: HeldFn | None = None) -> Bootstrap:
        """Register and pull all of Θ, retrying with backoff until the syncer answers; then start syncing.
        From a syncer shard: the fragments it owns (Bootstrap.theta and versions hold only those). `held` is not
        used: one syncer away means no Θ to train from (a sharded link starts without a shard: sharded_client.py)."""
        return self.start_bootstrap(stop_flag).result()

    def start_bootstrap(self, stop_flag: StopFlag | threading.Event | None = None) -> concurrent.futures.Future:
        """`bootstrap` without waiting: a future of its Bootstrap (several shards are bootstrapped at once)."""
        future = asyncio.run_coroutine_threadsafe(self._bootstrap(stop_flag or threading.Event()), self._loop)
        self._booting.append(future)
        return future

    def hold(self, versions: dict[int, int] | None) -> bool:
        """Before its bootstrap completes: the learner trains these fragments from saved versions (None: not any
        more), so the bootstrap hands each fragment whose version differs over as an update (a rewind when lower:
        the syncer lost the saved one). False when the bootstrap has completed already."""
        with self._lock:
            if self._booted:
                return False
            self._saved_versions = None if versions is None else dict(versions)
            return True

    def submit(self, sub: Submission) -> bool:
        """Queue a submission; a queued, unsent one with the same id is replaced (it is superseded). False, and
        nothing queued, when one with that id may have reached the syncer already (being sent, or sent without an
        answer) or was acknowledged: the syncer merges one Δ per id, so the earlier one stands."""
        with self._lock:
            sid = sub.submission_id
            if sid in self._acked_ids or sid == self._posting or sid in self._maybe_delivered:
                return False
            if sid in self._outbox:
                self.stats.superseded += 1
            self._outbox[sid] = sub
        self._loop.call_soon_threadsafe(self._wake_sender.set)
        return True

    def take_updates(self) -> list[FragmentUpdate]:
        """Newer fragment versions fetched since the last call (one per fragment, the newest)."""
        with self._lock:
            updates, self._updates = list(self._updates.values()), {}
        return sorted(updates, key=lambda u: u.fragment)

    def take_answers(self) -> list[Answer]:
        """The syncer's answers (acknowledgements and rejections) received since the last call."""
        with self._lock:
            answers, self._answers = self._answers, []
        return answers

    def report(self, step: int, step_time_s: float, tokens: int, incarnation: str | None = None,
               steps_discarded: int = 0) -> None:
        """Progress the next heartbeat carries (the latest values win): this life's steps, step time, tokens, id and
        the fragment-steps its adoptions discarded."""
        with self._lock:
            self._report = self._report.model_copy(update={"step": step, "step_time_s": step_time_s,
                                                           "tokens": tokens, "incarnation": incarnation,
                                                           "steps_discarded": steps_discarded})

    def pending(self) -> int:
        """Submissions not yet answered by the syncer."""
        with self._lock:
            return len(self._outbox)

    def snapshot(self) -> dict:
        """Counters for metrics.jsonl and /metrics: the fields of LinkCounters."""
        with self._lock:
            return self.stats.model_dump() | {"pending": len(self._outbox)}

    def close(self, drain_s: float = 0.0) -> bool:
        """Wait up to `drain_s` for queued submissions to be answered, then stop; True if nothing was left."""
        deadline = time.monotonic() + drain_s
        self._draining = True  # the learner adopts nothing more: fetching new versions would be wasted bytes
        for future in self._booting:  # a shard still away when the learner stops: stop waiting for it
            future.cancel()
        while self.pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        drained = not self.pending()
        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=15)
            except TimeoutError:
                # Seen once on a loaded machine (CI): the network tasks did not wind down in time. Nothing is lost
                # by leaving them (the answers received are booked by the caller); a crash here would lose the
                # learner's final metrics line.
                log.warning("the syncer client's network tasks did not stop within 15 s; leaving them")
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        return drained

    # ------------------------------------------------------------------ loop plumbing

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        self._loop.close()

    async def _last_heartbeat(self) -> None:
        """The learner's final figures (best effort, 2 s at most): the syncer's ledger of this life is then exact
        for a clean stop, adoptions of the hand-over included."""
        with self._lock:
            body = self._report.model_dump()
        try:
            async with self._get_session().post(f"{self.url}/v1/heartbeat", json=body,
                                                timeout=aiohttp.ClientTimeout(total=2.0)):
                pass
        except Exception:  # noqa: BLE001 - the syncer away: it keeps the last heartbeat it had
            pass

    async def _shutdown(self) -> None:
        if self._booted:
            await self._last_heartbeat()
        # Every task of this loop: the network tasks, and a bootstrap still waiting for a shard that is away (its
        # future was cancelled from the learner's thread; the task must still run to its end before the loop stops).
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=10)
            for task in stuck:  # for the log: where a task ignored its cancellation
                log.warning("syncer client task %s did not stop: %s", task.get_name(), task.get_stack(limit=3))
        if self._session is not None:
            await asyncio.wait_for(self._session.close(), timeout=5)

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers,
                                                  connector=aiohttp.TCPConnector(ssl=self._ssl or True),
                                                  timeout=aiohttp.ClientTimeout(total=None, connect=10.0,
                                                                                sock_read=self.timeout_s))
        return self._session

    def _set_up(self, up: bool, error: str = "") -> None:
        with self._lock:
            if up != self.stats.syncer_up:
                which = "syncer" if self.shards == 1 else f"syncer shard {self.shard} ({self.url})"
                log.info("%s %s%s", which, "reachable" if up else "unreachable", f": {error}" if error else "")
            self.stats.syncer_up = up

    def _delay(self, attempt: int) -> float:
        """Exponential backoff with full jitter (spreads retries of many learners after a syncer restart). Capped at
        1 s: a warm standby serves again well within a second or two, and a learner still waiting out a 5 s back-off
        then would leave its work unmerged that long (a refused connection costs the syncer nothing)."""
        return random.uniform(0.5, 1.0) * min(self.backoff_max_s, self.backoff_s * 2 ** min(attempt, 16))

    # ------------------------------------------------------------------ start-up

    async def _bootstrap(self, stop_flag: StopFlag | threading.Event) -> Bootstrap:
        attempt = 0
        while True:
            if stop_flag.is_set():
                raise InterruptedError("stopped while waiting for the syncer")
            try:
                reg = await self._register()
                registered_at = time.monotonic()
                theta, versions = await self._fetch_state(reg)
                break
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                self._set_up(False, str(exc) or type(exc).__name__)
                self.bootstrap_failures += 1
                if attempt % 10 == 0:
                    log.info("waiting for the syncer at %s (%s)", self.url, str(exc) or type(exc).__name__)
                await asyncio.sleep(self._delay(attempt))
                attempt += 1
        plan = reg.plan_lists()
        self.downlink = reg.config.get("outer", {}).get("downlink", "fp32")  # the run's, as the syncer serves it
        with self._lock:
            self._have = dict(versions)
            self._held = {p: {n: theta[n] for n in plan[p]} for p in versions}
            self._booted = True
            saved = self._saved_versions
            if saved is not None:  # the learner started from saved values: what differs here is an update
                for p, v in versions.items():
                    if v != saved.get(p, -1):
                        self._updates[p] = FragmentUpdate(p, v, self._held[p], rewind=v < saved.get(p, -1))
        if saved is not None:
            log.info("syncer shard %d (%s) is back: registered; fragment versions %s there, %s held here%s",
                     self.shard, self.url, dict(sorted(versions.items())), dict(sorted(saved.items())),
                     "" if versions == saved else f"; adopting {sorted(p for p in versions if versions[p] != saved.get(p))}")
        if not self._tasks:  # a second bootstrap (re-pull of Θ) must not start a second set of tasks
            self._tasks = [asyncio.create_task(c) for c in (self._sender(), self._poller(), self._heartbeat())]
        published = {int(p): registered_at - age for p, age in reg.version_age_s.items() if int(p) in versions}
        return Bootstrap(reg.config, plan, versions, self.heartbeat_s, theta, published, reg.step_s)

    async def _register(self) -> RegisterAnswer:
        async with self._get_session().post(f"{self.url}/v1/register", json=self._register_body) as resp:
            if 400 <= resp.status < 500 and resp.status != 408:  # a wrong token (401) or a refused id won't fix itself
                raise SyncerRefused(f"syncer refused registration ({resp.status}): {await resp.text()}")
            if resp.status != 200:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status,
                                                  message=await resp.text())
            reg = RegisterAnswer.model_validate(await resp.json())
        if (reg.shard, reg.shards) != (self.shard, self.shards):
            urls = "one URL" if self.shards == 1 else f"{self.shards} URLs"
            raise SyncerRefused(f"{self.url} is syncer shard {reg.shard} of {reg.shards}, but was given as shard "
                                f"{self.shard} of {self.shards} ({urls} in --syncer): give every shard's URL, in "
                                "shard order, separated by commas")
        self._set_up(True)
        self.heartbeat_s = reg.heartbeat_s or self.heartbeat_s
        return reg

    async def _fetch_state(self, reg: RegisterAnswer) -> tuple[dict[str, Tensor], dict[int, int]]:
        """All of Θ and its versions. With a quantized down-link, each fragment as the updates from the initial
        version 0 (built here from the run's seed) while the syncer keeps them all, else whole."""
        if is_quantized(reg.config.get("outer", {}).get("downlink", "fp32")):
            return await self._fetch_from_initial(reg)
        async with self._get_session().get(f"{self.url}/v1/state") as resp:
            resp.raise_for_status()
            body = await resp.read()
        tensors, meta = decode_tensors(body)
        with self._lock:
            self.stats.bytes_down += len(body)
            self.stats.bytes_down_full += len(body)
        versions = {int(p): int(v) for p, v in json.loads(meta["versions"]).items()}
        return tensors, versions

    async def _fetch_from_initial(self, reg: RegisterAnswer) -> tuple[dict[str, Tensor], dict[int, int]]:
        cfg = TrainConfig.model_validate(reg.config)
        initial = await asyncio.to_thread(initial_theta, cfg)
        theta: dict[str, Tensor] = {}
        versions: dict[int, int] = {}
        plan = reg.plan_lists()
        for p in (reg.owned if reg.owned is not None else range(len(plan))):
            names = plan[p]
            version, tensors = await self._download(p, None, 0, {n: initial[n] for n in names})
            theta |= tensors
            versions[p] = version
        return theta, versions

    # ------------------------------------------------------------------ background tasks

    async def _sender(self) -> None:
        """Send queued submissions one at a time, oldest first; retry connection errors, 408 (the body arrived too
        slowly: the syncer read none of it as a submission), 429 and 5xx with backoff."""
        attempt = 0
        while True:
            with self._lock:
                sub = next(iter(self._outbox.values()), None)
                self._posting = None if sub is None else sub.submission_id  # from now on it is not superseded
            if sub is None:
                self._wake_sender.clear()
                await self._wake_sender.wait()
                continue
            if sub.base_version > self._have.get(sub.fragment, sub.base_version):
                # Its base is newer than anything the syncer has now: it lost that version (restarted without it)
                # while this Δ waited. Never sent; refused here as stale, so the learner re-adopts and carries the work.
                self._settle(sub, 409, ErrorAnswer(error=f"base version {sub.base_version} is unknown to the syncer "
                                                         f"(now at {self._have[sub.fragment]})"), delivered=False)
                continue
            try:
                status, answer = await self._post_submission(sub)
            except Exception as exc:  # noqa: BLE001 - network errors (and any surprise) are retried, never fatal
                if not isinstance(exc, (aiohttp.ClientError, asyncio.TimeoutError, OSError)):
                    log.exception("unexpected error sending a submission; retrying")
                # The body may or may not have reached the syncer: remember the first such attempt, so a
                # later "duplicate" answer is accounted with the counters the syncer actually holds.
                with self._lock:
                    self._maybe_delivered.setdefault(sub.submission_id, sub)
                    self._posting = None
                self._set_up(False, str(exc) or type(exc).__name__)
                await asyncio.sleep(self._delay(attempt))
                attempt += 1
                continue
            if status in (408, 429) or status >= 500:  # not taken: a fresher Δ may replace it while this one waits
                with self._lock:
                    self._posting = None
            if status == 429:  # one of ours for this fragment still waits for its merge (or is being read): later
                await asyncio.sleep(self._delay(attempt))
                attempt += 1
                continue
            if status == 408 or status >= 500:  # 408: a slow link cut mid-body, not a refusal of the work
                self._set_up(False, f"HTTP {status}: {answer.error}")
                await asyncio.sleep(self._delay(attempt))
                attempt += 1
                continue
            attempt = 0
            self._set_up(True)
            self._settle(sub, status, answer)

    async def _post_submission(self, sub: Submission) -> tuple[int, SubmitAnswer | ErrorAnswer]:
        url = f"{self.url}/v1/fragments/{sub.fragment}/outer-gradient"
        headers = {"Content-Type": "application/octet-stream"}
        async with self._get_session().post(url, data=sub.body, headers=headers) as resp:
            text = await resp.text()
            with self._lock:
                self.stats.bytes_up += len(sub.body)
        model = SubmitAnswer if 200 <= resp.status < 300 else ErrorAnswer
        try:
            return resp.status, model.model_validate_json(text)
        except ValueError:  # not the syncer's JSON (a proxy's error page, an empty body): keep the status
            return resp.status, SubmitAnswer(accepted=True) if model is SubmitAnswer else ErrorAnswer(error=text[:200])

    def _settle(self, sub: Submission, status: int, answer: SubmitAnswer | ErrorAnswer, delivered: bool = True) -> None:
        """Book the syncer's answer to `sub` (or a refusal decided here, `delivered=False`) and drop its id from the
        outbox (`submit` queues no fresher Δ with the id being sent, so nothing else is dropped with it)."""
        reason = answer.error if isinstance(answer, ErrorAnswer) else ""
        duplicate = isinstance(answer, SubmitAnswer) and answer.duplicate
        with self._lock:
            self.stats.sent += delivered
            self._outbox.pop(sub.submission_id, None)
            self._posting = None
            held = sub
            if 200 <= status < 300:
                if duplicate:  # the syncer kept an earlier attempt whose answer we never saw
                    held = self._maybe_delivered.get(sub.submission_id, sub)
                    if sub.recovered and sub.submission_id not in self._maybe_delivered:
                        held = dataclasses.replace(sub, c_steps=0, c_tokens=0)
                self._acked_ids.add(sub.submission_id)
                self.stats.acked += 1
                self.stats.duplicates += duplicate
                self.stats.acked_tokens += held.c_tokens
                self.stats.acked_steps += held.c_steps
            else:
                self.stats.rejected += 1
                self.stats.stale += status == 409
            self._maybe_delivered.pop(sub.submission_id, None)
            self._answers.append(Answer(sub.fragment, sub.base_version, sub.submission_id, status, held.c_steps,
                                        held.c_tokens, duplicate, reason))
        if 200 <= status < 300 or status == 409:
            # After an ack a merge is likely soon; after 409 the learner must re-adopt: look for versions now.
            self._wake_poller.set()
        if status == 409:
            log.warning("fragment %d: the syncer refused base version %d as stale (%s); re-adopting its current one",
                        sub.fragment, sub.base_version, reason)
        elif not 200 <= status < 300:
            log.error("fragment %d: submission %s rejected with %d: %s", sub.fragment, sub.submission_id,
                      status, reason)

    async def _poller(self) -> None:
        """Fetch every fragment whose global version is newer than the one handed to the learner."""
        attempt = 0
        while True:
            try:
                async with self._get_session().get(f"{self.url}/v1/versions") as resp:
                    resp.raise_for_status()
                    answer = VersionsAnswer.model_validate(await resp.json())
                versions = {int(p): v for p, v in answer.versions.items()}
                for p, v in sorted(versions.items()):
                    if self._draining:
                        break
                    if v > self._have.get(p, -1):
                        await self._fetch_fragment(p)
                    elif v < self._have[p]:  # the syncer lost the version held (restarted before checkpointing it)
                        await self._fetch_fragment(p, rewind=True)
                self._set_up(True)
                attempt = 0
                delay = self.poll_s
            except Exception as exc:  # noqa: BLE001 - the poller must outlive any one bad answer
                if not isinstance(exc, (aiohttp.ClientError, asyncio.TimeoutError, OSError)):
                    log.warning("looking for new versions failed: %r", exc)
                self._set_up(False, str(exc) or type(exc).__name__)
                delay = self._delay(attempt)
                attempt += 1
            self._wake_poller.clear()
            try:
                await asyncio.wait_for(self._wake_poller.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass

    async def _fetch_fragment(self, p: int, rewind: bool = False) -> None:
        """Fetch the newest version of fragment p, if newer than the one held, for the learner to adopt; with
        `rewind`, whole and whatever its version (the syncer no longer has the one held: no Δ may be based on it)."""
        after = None if rewind else self._have.get(p)
        held = None if rewind else self._held.get(p)
        got = await self._download(p, after, after if is_quantized(self.downlink) else None, held)
        if got is None:
            return
        version, tensors = got
        with self._lock:
            if version > self._have.get(p, -1) or (rewind and version != self._have.get(p)):
                if rewind:
                    log.warning("fragment %d: the syncer no longer has version %d (now at %d); re-adopting its "
                                "version", p, self._have.get(p), version)
                self._have[p] = version
                unadopted = self._updates.get(p)  # a rewind not adopted yet: the newer version must rewind too
                self._updates[p] = FragmentUpdate(p, version, tensors,
                                                  rewind=rewind or (unadopted is not None and unadopted.rewind))
                if self.downlink != "bf16":
                    self._held[p] = tensors
                else:  # rounded values: no update can be applied to them
                    self._held.pop(p, None)

    async def _download(self, p: int, after: int | None, base: int | None,
                        held: dict[str, Tensor] | None) -> tuple[int, dict[str, Tensor]] | None:
        """GET fragment p (None: nothing newer than `after`). With `base` and `held` (its exact values) the syncer
        may answer with the updates from it: rebuilt here and checked against the syncer's digest, and on any
        mismatch fetched again whole. Counts the bytes; returns (version, values)."""
        params = {} if after is None else {"after": str(after)}
        if base is not None and held is not None:
            params["base"] = str(base)
        elif self.downlink == "bf16":
            params["dtype"] = self.downlink
        async with self._get_session().get(f"{self.url}/v1/fragments/{p}", params=params) as resp:
            if resp.status == 304:
                return None
            resp.raise_for_status()
            body = await resp.read()
        with self._lock:
            self.stats.bytes_down += len(body)
        answer = decode_answer(body)
        if answer.encoding == "full":
            with self._lock:
                self.stats.versions_full += 1
                self.stats.bytes_down_full += len(body)
            return answer.version, answer.tensors
        try:
            if "base" not in params or answer.base != base or answer.fragment != p:
                raise WireError(f"an update from version {answer.base} of fragment {answer.fragment}, but version "
                                f"{base} of fragment {p} is held")
            tensors = await asyncio.to_thread(reconstruct, held, answer)
        except WireError as exc:
            log.error("fragment %d: could not rebuild version %d (%s); fetching it whole", p, answer.version,
                      exc.reason)
            with self._lock:
                self.stats.digest_mismatches += 1
            return await self._download(p, after, None, None)
        with self._lock:
            self.stats.versions_rebuilt += 1
        return answer.version, tensors

    async def _heartbeat(self) -> None:
        """Tell the syncer this learner is alive (and its step time); re-register if the syncer forgot it."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            with self._lock:
                body = self._report.model_dump()
            try:
                async with self._get_session().post(f"{self.url}/v1/heartbeat", json=body) as resp:
                    if resp.status == 404:  # a syncer restarted without this learner in its state
                        await self._register()
                        continue
                    resp.raise_for_status()
                    versions = HeartbeatAnswer.model_validate(await resp.json()).versions
                self._set_up(True)
                if any(v != self._have.get(int(p), -1) for p, v in versions.items()):
                    self._wake_poller.set()
            except Exception as exc:  # noqa: BLE001 - a failed heartbeat only means "try again later"
                self._set_up(False, str(exc) or type(exc).__name__)
