"""Slow senders against a real syncer over real sockets (issue 38, Medium 3): learners whose tokens are valid send
half a submission body (a Content-Length longer than what they send) and stall. They hold only their own upload,
never the decoding slots, so an honest learner's submission is answered while they hang; each is cut with a 408
naming the reason once its body falls behind the pace (--body-base-s, --body-min-rate-kbs), counted in the
metrics, and changes nothing. A connection that stays idle, or never completes its request headers, is closed
after --keepalive-s. The syncer is the production one (app.setup_runner, as `diloco syncer` serves it) on a
loopback TCP socket; every wait is for an answer, a closed socket or a metric, bounded only by a hang guard."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web

from diloco_trainer.protocol.tokens import learner_token
from diloco_trainer.syncer.app import setup_runner
from polling import wait_for_async
from syncer_kit import TOKEN, assert_unchanged, body, deltas_for, make_syncer, snapshot

HANG_S = 15.0  # an answer or a close that has not come within this long is a hang (the test fails)
SLOW = 4  # as many slow learners as decoding slots (--max-concurrent-uploads 4)


@pytest.fixture
async def serve(tmp_path):
    """serve(**options): a syncer with these SyncerOptions listening on 127.0.0.1: (syncer, port)."""
    runners = []

    async def start(**options):
        syncer = make_syncer(tmp_path / f"state{len(runners)}", max_concurrent_uploads=SLOW, **options)
        runner = await setup_runner(syncer)
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return syncer, runner.addresses[0][1]

    yield start
    for runner in runners:
        await runner.cleanup()


def bearer(learner: str) -> str:
    return f"Bearer {learner_token(TOKEN, learner)}"


async def send(port: int, raw: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    return reader, writer


def post(path: str, learner: str, length: int, keep_alive: bool = False) -> bytes:
    connection = "keep-alive" if keep_alive else "close"
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: {bearer(learner)}\r\nConnection: {connection}\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """The next answer on a connection (status, headers with lower-case names, body); fails on a hang."""
    async def read():
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:] if line)
        headers = {k.lower(): v for k, v in headers.items()}
        return int(lines[0].split()[1]), headers, await reader.readexactly(int(headers.get("content-length", 0)))
    return await asyncio.wait_for(read(), HANG_S)


async def closed(reader: asyncio.StreamReader) -> bytes:
    """What arrives until the syncer closes the connection; fails on a hang."""
    return await asyncio.wait_for(reader.read(), HANG_S)


async def stall(port: int, syncer, n: int, p: int = 0, wait: bool = True):
    """n learners (slow-0...) each sending the first half of a valid submission body and nothing more: their
    (reader, writer) pairs (with `wait`, once the syncer is receiving all n bodies) and the half's length."""
    st = syncer.state
    conns, half = [], 0
    for i in range(n):
        learner = f"slow-{i}"
        full = body(st, p, deltas_for(st, p, 10 + i), learner=learner, sid=f"{learner}.1")
        half = len(full) // 2
        conns.append(await send(port, post(f"/v1/fragments/{p}/outer-gradient", learner, len(full)) + full[:half]))
    if wait:
        await wait_for_async(lambda: syncer.metrics.uploads_receiving._value.get() == n, HANG_S,
                             f"the syncer receiving the {n} slow bodies")
    return conns, half


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def test_an_honest_submission_is_answered_while_slow_learners_hold_half_sent_bodies(serve):
    syncer, port = await serve(body_base_s=3600.0)  # the slow ones are not cut during this test
    st = syncer.state
    conns, _ = await stall(port, syncer, SLOW)
    try:
        honest = body(st, 0, deltas_for(st, 0, 1), learner="honest", sid="honest.1")
        reader, writer = await send(port, post("/v1/fragments/0/outer-gradient", "honest", len(honest),
                                               keep_alive=True) + honest)
        status, _, text = await answer(reader)  # before the fix: never (all four slots held by the slow ones)
        assert status == 202, text
        assert st.is_known("honest.1")
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, text = await answer(reader)
        assert status == 200
        exported = text.decode()
        # The slow ones are still being received, unanswered, and hold no decoding slot.
        assert metric(exported, "diloco_syncer_uploads_receiving ") == SLOW
        assert metric(exported, "diloco_syncer_uploads_in_progress ") == 0
        assert metric(exported, "diloco_syncer_connections ") >= SLOW + 1
        assert metric(exported, "diloco_syncer_submissions_rejected_total") == 0
        writer.close()
    finally:
        for _, w in conns:
            w.close()
    await wait_for_async(lambda: syncer.metrics.uploads_receiving._value.get() == 0, HANG_S,
                         "the hung-up slow uploads to end")
    assert not any(st.is_known(f"slow-{i}.1") for i in range(SLOW))
    assert syncer.metrics.accepted._value.get() == 1


async def test_a_content_length_longer_than_the_body_ends_in_a_408_after_its_pace_runs_out(serve):
    syncer, port = await serve(body_base_s=0.2, body_min_bytes_per_s=1e6)
    st = syncer.state
    before = snapshot(st)
    t0 = time.monotonic()
    conns, half = await stall(port, syncer, SLOW, wait=False)  # their pace may run out before all four are in
    answers = await asyncio.gather(*(answer(r) for r, _ in conns))  # before the fix: none (held until the client left)
    elapsed = time.monotonic() - t0
    for status, headers, text in answers:
        assert status == 408, text
        assert headers.get("connection") == "close"
        reason = json.loads(text)["error"]
        assert reason.startswith(f"request body too slow: {half} of ") and "--body-min-rate-kbs" in reason, reason
    # The next byte after the half was due base + (half + 1) / rate after each read began, which is after t0.
    assert elapsed >= syncer.pace.deadline_s(half + 1)
    for _, w in conns:
        w.close()
    assert_unchanged(before, snapshot(st))
    m = syncer.metrics
    assert m.body_timeouts.labels("outer-gradient")._value.get() == SLOW
    assert m.rejected.labels("body_timeout")._value.get() == SLOW
    assert m.uploads_receiving._value.get() == 0 and m.uploads_in_progress._value.get() == 0
    # Nothing leaked: an honest submission is taken as usual.
    honest = body(st, 1, deltas_for(st, 1, 1), learner="honest", sid="honest.1")
    reader, writer = await send(port, post("/v1/fragments/1/outer-gradient", "honest", len(honest)) + honest)
    status, _, text = await answer(reader)
    writer.close()
    assert status == 202, text


async def test_a_register_body_shorter_than_its_content_length_ends_in_a_408(serve):
    syncer, port = await serve(body_base_s=0.2, body_min_bytes_per_s=1e6)
    doc = json.dumps({"learner_id": "slow-0", "unit": 0, "world_size": 1, "device": "cpu"}).encode()
    reader, writer = await send(port, post("/v1/register", "slow-0", len(doc) + 10) + doc)
    status, headers, text = await answer(reader)  # before the fix: none
    writer.close()
    assert status == 408 and headers.get("connection") == "close", text
    assert json.loads(text)["error"].startswith(f"request body too slow: {len(doc)} of {len(doc) + 10} bytes")
    assert syncer.metrics.body_timeouts.labels("register")._value.get() == 1
    assert "slow-0" not in syncer.state.learners


async def test_idle_connections_and_unfinished_request_headers_are_closed_after_the_keepalive(serve):
    syncer, port = await serve(keepalive_s=0.3)
    t0 = time.monotonic()
    silent = await send(port, b"")
    headers_half = await send(port, b"POST /v1/register HTTP/1.1\r\nHost: x\r\nContent-Le")
    # Before the fix aiohttp's default keep-alive, 3630 s: neither is closed (nor answered).
    assert await closed(silent[0]) == b""
    assert await closed(headers_half[0]) == b""
    assert time.monotonic() - t0 >= syncer.opt.keepalive_s
    # An answered keep-alive connection left idle is closed keepalive_s after its answer.
    reader, writer = await send(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    status, _, _ = await answer(reader)
    answered = time.monotonic()
    assert status == 200
    assert await closed(reader) == b""
    assert time.monotonic() - answered >= syncer.opt.keepalive_s
    for _, w in (silent, headers_half, (reader, writer)):
        w.close()
