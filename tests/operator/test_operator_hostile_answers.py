"""Answers a job author controls, against the shared operator (issue 38, Medium 4): a syncer's /v1/status (the
author's image) and a remote cluster's apiserver (the author's kubeconfig). A real aiohttp server on a loopback
socket stands for the hostile side and answers too much, too slowly, or an error whose body is long and full of
control characters; the operator's own readers (syncer_status.fetch, the Kube client) must stop at their size and
time bounds, and keep a short single-line reason only. Every wait is for the reader's answer, bounded by a hang
guard; memory is measured with tracemalloc while the answer arrives."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
import unicodedata

import pytest
from aiohttp import web

from diloco_kube.answers import MAX_ANSWER_BYTES
from diloco_kube.client import PODS, ApiError, Kube
from diloco_operator.reconcile import syncer_status
from diloco_operator.remote.clusters import RemoteClusters

HANG_S = 30.0  # a reader that has not given up within this long is stuck (the test fails)
HUGE = 100 * 2**20  # what the hostile side offers: far past every bound
MIB = b"x" * 2**20
MARKER = "END-OF-THE-HOSTILE-BODY"
# Newlines, a terminal escape, a carriage return, a NUL, a right-to-left override: none may reach a status line.
NASTY = "line one\nline two\r\n\x1b[31mred\x1b[0m \x00 \u202eevil\u202c \t tab "
ERROR_TEXT = NASTY * 40_000 + MARKER  # ~1.8 MB


def one_short_line(text: str, limit: int) -> bool:
    return len(text) <= limit and not any(unicodedata.category(c)[0] == "C" for c in text)


@pytest.fixture
async def hostile():
    """hostile(handler): a server on 127.0.0.1 answering every path with `handler`; its base URL."""
    runners = []

    async def start(handler) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def oversized(request: web.Request) -> web.StreamResponse:
    """A 200 whose body never stops growing (chunked, no Content-Length): valid JSON if anyone read it all."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    try:
        await resp.write(b'{"kind": "PodList", "items": [], "padding": "')
        for _ in range(HUGE // len(MIB)):
            await resp.write(MIB)
        await resp.write(b'"}')
    except ConnectionError:  # the reader stopped at its bound and hung up
        pass
    return resp


async def trickle(request: web.Request) -> web.StreamResponse:
    """A 200 whose body comes one byte at a time, forever (each byte well within any socket read timeout)."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    try:
        await resp.write(b"{")
        while True:
            await asyncio.sleep(0.05)
            await resp.write(b" ")
    except ConnectionError:
        pass
    return resp


async def error_answer(request: web.Request) -> web.Response:
    return web.Response(status=500, text=ERROR_TEXT)


async def outcome(coro) -> object:
    """What `coro` returned or raised; the test fails if it is still waiting after HANG_S (a hang, not an answer)."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=HANG_S)
    if not done:
        task.cancel()
        pytest.fail(f"still waiting for an answer after {HANG_S:g} s")
    return task.exception() or task.result()


async def read_traced(coro) -> tuple[object, int]:
    """outcome(coro), and the peak of memory allocated meanwhile (bytes)."""
    tracemalloc.start()
    try:
        result = await outcome(coro)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return result, peak


# The syncer's /v1/status (syncer_status.fetch, as the poller calls it)

async def test_an_oversized_syncer_status_is_refused_at_its_bound_and_never_held_whole(hostile):
    url = await hostile(oversized)
    result, peak = await read_traced(syncer_status.fetch(url, "token"))
    assert peak < syncer_status.MAX_STATUS_BYTES + 8 * 2**20, f"{peak} bytes allocated while reading"
    assert isinstance(result, syncer_status.StatusUnread) and result.refused, result
    assert str(result) == f"syncer status answer over {syncer_status.MAX_STATUS_BYTES} bytes"


async def test_a_syncer_status_that_trickles_is_given_up_within_the_fetch_timeout(hostile):
    result = await outcome(syncer_status.fetch(await hostile(trickle), "token", timeout_s=1.0))
    assert isinstance(result, syncer_status.StatusUnread), result
    assert str(result) == "syncer status answer not complete within 1 s"


async def test_a_syncer_error_answer_gives_its_code_as_the_reason_never_its_body(hostile):
    result = await outcome(syncer_status.fetch(await hostile(error_answer), "token"))
    assert isinstance(result, syncer_status.StatusUnread), result
    assert str(result) == "syncer status answer: HTTP 500" and not result.refused


# A remote cluster's apiserver (the Kube client, as RemoteClusters builds it from a job's kubeconfig)

def kubeconfig(server: str) -> dict:
    return {"apiVersion": "v1", "kind": "Config", "current-context": "evil",
            "clusters": [{"name": "evil", "cluster": {"server": server}}],
            "users": [{"name": "author", "user": {"token": "t"}}],
            "contexts": [{"name": "evil", "context": {"cluster": "evil", "user": "author"}}]}


@pytest.fixture
async def remote_kube():
    """remote_kube(server, timeout_s): a Kube client of that server, as a remote cluster's is built."""
    clients = []

    async def build(server: str, timeout_s: float = 5.0) -> Kube:
        kube = await Kube.from_kubeconfig(kubeconfig(server), timeout_s=timeout_s, pool=4)
        clients.append(kube)
        return kube

    yield build
    for kube in clients:
        kube.close()


async def test_an_oversized_apiserver_answer_is_refused_at_the_clients_bound(hostile, remote_kube):
    kube = await remote_kube(await hostile(oversized))
    result, peak = await read_traced(kube.list(PODS, "ns", "diloco.dev/job=j"))
    assert peak < MAX_ANSWER_BYTES + 16 * 2**20, f"{peak} bytes allocated while reading"
    assert isinstance(result, ApiError) and result.status == 0, result
    assert f"answer over the {MAX_ANSWER_BYTES}-byte bound" in str(result)


async def test_an_apiserver_answer_that_trickles_is_given_up_within_the_clients_timeout(hostile, remote_kube):
    kube = await remote_kube(await hostile(trickle), timeout_s=1.0)
    result = await outcome(kube.list(PODS, "ns"))
    assert isinstance(result, ApiError) and result.status == 0, result
    assert "answer still arriving after its time bound" in str(result)


async def test_an_apiserver_that_trickles_its_headers_is_given_up_within_the_clients_timeout(remote_kube):
    """Before any body: the status line comes a byte at a time (each read is quick, the answer never complete)."""
    async def crawl(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                writer.write(b"H")
                await writer.drain()
                await asyncio.sleep(0.05)
        except ConnectionError:
            pass
    server = await asyncio.start_server(crawl, "127.0.0.1", 0)
    try:
        kube = await remote_kube(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", timeout_s=1.0)
        assert isinstance(await outcome(kube.list(PODS, "ns")), asyncio.TimeoutError)
    finally:
        server.close()


@pytest.mark.parametrize("body", [
    ERROR_TEXT,
    json.dumps({"kind": "Status", "status": "Failure", "reason": NASTY * 100, "code": "not a code",
                "message": ERROR_TEXT, "details": ["not", "a", "dict"]}),
], ids=["text", "status"])
async def test_an_apiserver_error_keeps_only_a_short_single_line_excerpt_of_its_body(hostile, remote_kube, body):
    async def error_503(request: web.Request) -> web.Response:
        return web.Response(status=503, text=body)
    kube = await remote_kube(await hostile(error_503))
    error = await outcome(kube.list(PODS, "ns"))
    assert isinstance(error, ApiError), error
    assert error.status == 503 and error.code == 503 and error.causes == []
    assert one_short_line(str(error), 300) and MARKER not in str(error), str(error)[:1000]
    assert one_short_line(repr(error), 320)


def test_a_remote_clusters_failure_is_kept_as_one_short_line():
    """What reaches the job's ClustersReachable condition and the unit's (RemoteClusters.failed is where every
    failure of a cluster is remembered): one line, cut short, whatever the client's error said."""
    remotes = RemoteClusters(home=None)
    remotes.failed("ns", "job", "west", f"cluster west did not answer: {ERROR_TEXT}")
    why = remotes.unreachable_clusters("ns", "job")["west"]
    assert why.startswith("cluster west did not answer: line one line two") and one_short_line(why, 400), why[:1000]
