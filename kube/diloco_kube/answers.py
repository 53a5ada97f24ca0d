"""Bounded answers: an API server's answer is read in chunks up to a size and a time bound (a remote cluster's
apiserver is whatever a job's kubeconfig names, docs/security.md), and of an error's text only a short single-line
excerpt is ever kept."""

from __future__ import annotations

import time
import unicodedata

# The largest answer read from an API server. A remote cluster's answers are lists of one job's pods, Services,
# Secrets, ConfigMaps, claims and Workloads, and that cluster's Nodes and learner pods (the autoscaler's room): a pod
# of a job is 6-10 KiB, so 1,024 pods are 6-10 MiB, and 32 MiB leaves room for a few thousand Nodes or pods. Parsed,
# an answer takes ~7x its size in memory (~220 MiB at the bound), under the operator's 512 MiB limit.
MAX_ANSWER_BYTES = 32 * 2**20
CHUNK_BYTES = 256 * 2**10
EXCERPT_CHARS = 200  # of an answer's text in an error: a reason, never the body


class AnswerRefused(Exception):
    """An answer over its size bound or slower than its time bound (nothing of it is kept); str() says which."""


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """At most `limit` characters of `text` on one line: control and format characters (newlines, escapes,
    bidirectional overrides) become spaces, runs of spaces one; cut text ends in '…'."""
    head = "".join(" " if unicodedata.category(c)[0] == "C" else c for c in text[:2 * limit + 2])
    line = " ".join(head.split())
    return line if len(line) <= limit and len(text) <= 2 * limit + 2 else line[:limit - 1].rstrip() + "…"


def read_capped(resp, max_bytes: int, deadline: float) -> bytes:
    """The body of urllib3 response `resp`, read a chunk at a time (each chunk one socket read, so a trickle cannot
    stretch one); AnswerRefused as soon as it passes `max_bytes` or time.monotonic() passes `deadline`."""
    declared = resp.headers.get("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise AnswerRefused(f"answer of {int(declared)} bytes is over the {max_bytes}-byte bound")
    chunks, size = [], 0
    while chunk := resp.read1(CHUNK_BYTES):
        size += len(chunk)
        if size > max_bytes:
            raise AnswerRefused(f"answer over the {max_bytes}-byte bound")
        if time.monotonic() > deadline:
            raise AnswerRefused(f"answer still arriving after its time bound ({size} bytes read)")
        chunks.append(chunk)
    return b"".join(chunks)


class ReadAnswer:
    """An answer read whole (bounded), in the shape the official client reads a urllib3 response in (its connection
    already back in the pool)."""

    def __init__(self, status: int, reason: str | None, headers, data: bytes):
        self.status, self.reason, self.headers, self.data = status, reason, headers, data

    def getheaders(self):
        return self.headers


class CappedPool:
    """Stands in for the urllib3 pool manager the official client sends through: each answer is read here, bounded
    (`read_capped`), before the client sees it; the client's own error path would read an error's body whole."""

    def __init__(self, pool, max_bytes: int, total_s: float):
        self.pool, self.max_bytes, self.total_s = pool, max_bytes, total_s

    def request(self, method: str, url: str, **kw) -> ReadAnswer:
        deadline = time.monotonic() + self.total_s
        resp = self.pool.request(method, url, **{**kw, "preload_content": False})
        try:
            data = read_capped(resp, self.max_bytes, deadline)
        except BaseException:
            resp.close()  # never back to the pool with an answer half read
            raise
        finally:
            resp.release_conn()
        return ReadAnswer(resp.status, resp.reason, resp.headers, data)

    def __getattr__(self, name: str):
        return getattr(self.pool, name)  # clear(), connection_pool_kw, ...
