"""The syncer's HTTP plumbing apart from its API: protocol models as JSON answers, the 413 refusal, whole-body
reads with a limit, and aiohttp's server log (client mistakes as one WARNING line)."""

from __future__ import annotations

import logging
import sys

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
    """aiohttp's server logger for the syncer's runner (`web.AppRunner(..., logger=ServerLog())`): a request that
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


async def read_at_most(request: web.Request, limit: int) -> bytes:
    """The request's whole body, or its first `limit` bytes if it is longer: read until the end, since one read
    returns only what has arrived (a body split over two TCP segments would otherwise be cut short)."""
    body = bytearray()
    while len(body) < limit and (chunk := await request.content.read(limit - len(body))):
        body += chunk
    return bytes(body)
