"""The syncer's HTTP plumbing apart from its API: protocol models as JSON answers, the 413 refusal, whole-body
reads with a limit and a pace (the 408 refusal), and aiohttp's server log (client mistakes as one WARNING line)."""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from diloco_trainer.syncer.state import Rejected


def json_answer(doc, status: int = 200) -> web.Response:
    """A protocol model as a JSON answer."""
    return web.Response(body=doc.model_dump_json().encode(), status=status, content_type="application/json")


def too_large(size: int | None, limit: int, fragment: int | None = None) -> Rejected:
    got = "" if size is None else f" ({size} bytes)"
    where = "(--max-body-mb)" if fragment is None else \
        f"for fragment {fragment} (its parameters under outer.compression and outer.block_size)"
    return Rejected(413, f"body too large{got}: the limit is {limit} bytes {where}", "too_large")


class ServerLog(logging.LoggerAdapter):
    """aiohttp's server logger for the syncer's runner (`app.setup_runner`): a request that
    aiohttp's HTTP parser refuses with a 4xx (a header line over its limit, a garbled request line or header), or
    a client that hangs up before its body arrived, is the client's doing, so it is one WARNING line without a
    traceback instead of an ERROR with one. Anything else keeps aiohttp's ERROR and traceback."""

    def __init__(self, logger: logging.Logger | None = None):
        super().__init__(logger or logging.getLogger("aiohttp.server"), {})

    def exception(self, msg, *args, exc_info=True, **kwargs) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500:
            reason = " ".join(str(exc.message or exc).split())[:200]
            self.warning(msg + ": %d %s (%s)", *args, exc.code, reason, type(exc).__name__, **kwargs)
            return
        if isinstance(exc, ConnectionResetError):  # the client went away mid-request (aiohttp: "Connection lost")
            self.warning(msg + ": the client closed the connection before the request was read (%s)", *args,
                         str(exc) or type(exc).__name__, **kwargs)
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


@dataclass(frozen=True)
class BodyPace:
    """How fast a request body must arrive: byte n within `base_s + n / min_bytes_per_s` seconds of the start of
    the read, so a body of L bytes within base_s + L / min_bytes_per_s, and a sender that stalls (or declared a
    Content-Length longer than what it sends) is cut there instead of holding its connection and what it reserved."""

    base_s: float
    min_bytes_per_s: float

    def deadline_s(self, nbytes: int) -> float:
        """Seconds after the read began by which `nbytes` bytes must have arrived."""
        return self.base_s + nbytes / self.min_bytes_per_s


def too_slow(got: int, length: int | None, elapsed: float, pace: BodyPace) -> Rejected:
    of = f" of {length}" if length is not None else ""
    return Rejected(408, f"request body too slow: {got}{of} bytes arrived in {elapsed:.1f} s; a body must arrive at "
                         f"{pace.min_bytes_per_s / 1024:g} KiB/s or faster after its first {pace.base_s:g} s "
                         "(--body-min-rate-kbs, --body-base-s)", "body_timeout")


async def read_at_most(request: web.Request, limit: int, pace: BodyPace | None = None) -> bytes:
    """The request's whole body, or its first `limit` bytes if it is longer: read until the end, since one read
    returns only what has arrived (a body split over two TCP segments would otherwise be cut short). With `pace`,
    Rejected (408 body_timeout) as soon as the bytes fall behind it."""
    body = bytearray()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while len(body) < limit:
        if pace is None:
            chunk = await request.content.read(limit - len(body))
        else:
            try:
                async with asyncio.timeout_at(t0 + pace.deadline_s(len(body) + 1)):  # the next byte is due then
                    chunk = await request.content.read(limit - len(body))
            except TimeoutError:
                raise too_slow(len(body), request.content_length, loop.time() - t0, pace) from None
        if not chunk:
            break
        body += chunk
    return bytes(body)
