"""Hostile input against a real `diloco syncer` process over a real socket (property-based, hypothesis).

Whatever arrives — garbled or oversized bodies, headers, paths and query parameters, near-valid documents with
one field wrong — the syncer answers below 500, within a timeout, and a refused request changes nothing: the
versions, counters, pending work, learners and Θ stay as they were. Valid submissions interleaved still merge.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import time
from urllib.parse import urlencode

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from diloco_trainer.protocol.wire import SubmissionMeta, decode_tensors, encode_submission, quantize
from learner_kit import TOKEN, SyncerProcess

pytestmark = pytest.mark.slow  # a real syncer process

# The suite's profile keeps this file under a minute on a busy 2-core machine; DILOCO_FUZZ_PROFILE=syncer-fuzz-long
# digs deeper (minutes).
# No shrinking in the suite: a failure prints its whole step list, and shrinking a stateful run against a real
# process can take minutes.
# database=None: no .hypothesis/ example store in the checkout (a real process's state is not replayable anyway).
settings.register_profile("syncer-fuzz", max_examples=12, stateful_step_count=25, deadline=None, database=None,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate],
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.register_profile("syncer-fuzz-long", max_examples=300, stateful_step_count=40, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
ANSWER_TIMEOUT_S = 15.0  # a request the syncer does not answer (or close) within this long is a hang
AUTH = f"Bearer {TOKEN}"
FRAGMENTS = 2
MAX_BODY_MB = 1  # small, so "oversized" is cheap to send


# ------------------------------------------------------------------------------------------ raw HTTP


def http(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes, read until the server closes: (status, headers, body). Fails on a hang."""
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_TIMEOUT_S) as s:
        try:
            s.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer (413, 400) and close before reading everything
        chunks = []
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while True:
            assert time.monotonic() < deadline, f"no answer within {ANSWER_TIMEOUT_S} s to {raw[:120]!r}"
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            except TimeoutError:
                raise AssertionError(f"the syncer hung on {raw[:120]!r}") from None
            if not chunk:
                break
            chunks.append(chunk)
            if _complete(b"".join(chunks)):  # a keep-alive answer: the server rightly keeps the connection
                break
    data = b"".join(chunks)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    if not lines[0].startswith(b"HTTP/1."):
        return 0, {}, data  # closed without an answer: allowed for garbage, never a 5xx
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, body


def _complete(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length" and v.strip().isdigit():
            return len(body) >= int(v.strip())
    return False


def request(port: int, method: str, target: str, body: bytes = b"", headers: dict | None = None,
            auth: str | None = AUTH) -> tuple[int, dict[str, str], bytes]:
    hdrs = {"Host": "127.0.0.1", "Connection": "close", "Content-Length": str(len(body))}
    if auth is not None:
        hdrs["Authorization"] = auth
    hdrs.update(headers or {})
    head = f"{method} {target} HTTP/1.1\r\n".encode("latin-1", "replace")
    head += b"".join(f"{k}: {v}\r\n".encode("latin-1", "replace") for k, v in hdrs.items())
    return http(port, head + b"\r\n" + body)


def get_json(port: int, target: str) -> dict:
    status, _, body = request(port, "GET", target)
    assert status == 200, (target, status, body[:300])
    return json.loads(body)


# ------------------------------------------------------------------------------------------ hostile inputs

ENDPOINTS = ["/v1/register", "/v1/heartbeat", "/v1/fragments/0/outer-gradient", "/v1/fragments/1/outer-gradient",
             "/v1/fragments/0", "/v1/state", "/v1/versions", "/v1/status", "/healthz", "/metrics"]
json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
weird_ints = st.sampled_from([-1, 0, 2**31, 2**62, 2**63, 2**64, 10**30, -(2**63) - 1])
weird_values = (weird_ints | json_scalars | st.just(float("nan")) | st.just(float("inf"))
                | st.lists(st.integers(), max_size=3) | st.text(alphabet="0123456789", min_size=1, max_size=30))
learner_ids = st.sampled_from(["fuzz-a", "", "../etc", "a" * 129, "a b", "é", "-a", "a\x00"]) | st.text(max_size=20)
# Number literals json.loads refuses to turn into an int (over 4300 digits), deep nesting: raw JSON text.
RAW_JSON_TEXTS = [
    b'{"learner_id": "fuzz-a", "unit": ' + b"9" * 5000 + b', "world_size": 1, "device": "cpu"}',
    b'{"learner_id": "fuzz-a", "step": 1e999, "tokens": 0}',
    b'{"learner_id": "fuzz-a", "step": 1, "tokens": 0, "step_time_s": NaN}',
    b'{"learner_id": "fuzz-a", "step": 1, "tokens": 0, "step_time_s": -Infinity}',
    b"[" * 20000 + b"]" * 20000,
    b'{"a":' * 3000 + b"1" + b"}" * 3000,
    b"\xff\xfe{}", b"", b"null", b'"str"', b"{" + b'"k": 1,' * 20000 + b'"z": 2}',
]


def near_valid(kind: str):
    """A document of `kind` with one field replaced, dropped or of the wrong type."""
    base = ({"learner_id": "fuzz-a", "unit": 0, "world_size": 1, "device": "cpu"} if kind == "register"
            else {"learner_id": "fuzz-a", "step": 1, "tokens": 64, "step_time_s": 0.1})

    @st.composite
    def build(draw):
        doc = dict(base)
        field = draw(st.sampled_from(sorted(base)))
        how = draw(st.sampled_from(["replace", "drop"]))
        if how == "drop":
            doc.pop(field)
        else:
            doc[field] = draw(learner_ids) if field == "learner_id" else draw(weird_values)
        return doc
    return build()


WEIRD_META = ["", "-1", "1e3", " 7 ", "9" * 5000, "０", "²", "\x00", "[" * 3000, "nan", "none", "int4", "int8", "{}",
              '{"x": [1]}', json.dumps({"a": [10**30]}), "[" * 5000 + "]" * 5000, '{"x": ' + "9" * 5000 + "}"]


def _weird_meta(i: int) -> str:
    return WEIRD_META[i]


def submission_meta_strings():
    ok = {"learner_id": "fuzz-a", "submission_id": "s-1", "fragment": "0", "base_version": "0", "c_steps": "1",
          "c_tokens": "64", "compression": "none", "block_size": "64", "shapes": "{}"}
    weird = st.integers(0, len(WEIRD_META) - 1).map(_weird_meta)  # by index: a small repr for every field
    return st.fixed_dictionaries({k: st.just(v) | weird | st.text(max_size=20) for k, v in ok.items()})


def raw_safetensors(meta: dict, tensors: dict | None = None) -> bytes:
    """A safetensors file by hand, so hostile headers (lying offsets, odd dtypes) are possible."""
    header: dict = {"__metadata__": meta}
    payload = b""
    for name, (dtype, shape, data) in (tensors or {}).items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(payload), len(payload) + len(data)]}
        payload += data
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + payload


tensor_entries = st.dictionaries(
    st.text(max_size=20),
    st.tuples(st.sampled_from(["F32", "BF16", "U8", "I8", "F64", "XX", ""]),
              st.lists(st.integers(min_value=-1, max_value=2**40), max_size=3),
              st.binary(max_size=64)),
    max_size=3)


# ------------------------------------------------------------------------------------------ the machine


def digest(port: int) -> dict:
    """What a refused request must leave unchanged (liveness and uptime move with the clock, so not those)."""
    s = get_json(port, "/v1/status")
    learners = {lid: {k: v for k, v in info.items() if k not in ("last_seen", "live")}
                for lid, info in s["learners"].items()}
    return {k: s[k] for k in ("versions", "outer_steps", "contributions_merged", "tokens_merged", "pending",
                              "outer_steps_per_fragment")} | {"learners": learners}


def theta_digest(port: int) -> str:
    status, _, body = request(port, "GET", "/v1/state")
    assert status == 200
    return hashlib.sha256(body).hexdigest()


@pytest.fixture(scope="module")
def syncer(tmp_path_factory):
    """A real syncer process (1 MiB body limit, so oversized bodies stay cheap) and its fragments' shapes."""
    root = tmp_path_factory.mktemp("fuzz")
    config = root / "run.yaml"
    config.write_text(f"model: tiny\nseed: 5\nouter:\n  fragments: {FRAGMENTS}\n  compression: none\n"
                      "  quorum: 1\n  grace: 0.0\n")
    proc = SyncerProcess(config, root / "state", root / "syncer.log", args=("--max-body-mb", str(MAX_BODY_MB)))
    proc.start()
    reg = get_json_post(proc.port, "/v1/register", {"learner_id": "fuzz-valid", "unit": 0, "world_size": 1,
                                                    "device": "cpu"})
    proc.shapes = {}
    for p, names in reg["plan"].items():
        status, _, body = request(proc.port, "GET", f"/v1/fragments/{p}")
        tensors, _ = decode_tensors(body)
        proc.shapes[int(p)] = {n: tuple(tensors[n].shape) for n in names}
    yield proc
    proc.stop()


def get_json_post(port: int, target: str, doc: dict) -> dict:
    status, _, body = request(port, "POST", target, json.dumps(doc).encode(), {"Content-Type": "application/json"})
    assert status == 200, (status, body[:300])
    return json.loads(body)


class HostileClients(RuleBasedStateMachine):
    """Hostile requests, one after another, with valid submissions interleaved."""

    syncer: SyncerProcess  # set by the test

    @initialize()
    def settle(self):
        self.port = self.syncer.port
        self.wait_merged()
        self.before = digest(self.port)
        self.theta = theta_digest(self.port)
        self.answers: list[int] = []
        self.sent = 0

    def wait_merged(self):
        deadline = time.monotonic() + 30
        while any(get_json(self.port, "/v1/status")["pending"].values()):
            assert time.monotonic() < deadline, "pending contributions were never merged"
            time.sleep(0.02)

    def refused(self, answer: tuple[int, dict, bytes], what) -> None:
        """The property: no 5xx; a 4xx of ours carries a reason; a refused request changed nothing."""
        status, headers, body = answer
        assert status < 500, f"{status} for {what!r}: {body[:300]!r}"
        self.answers.append(status)
        if 400 <= status < 500 and headers.get("content-type", "").startswith("application/json"):
            assert json.loads(body).get("error"), body[:300]
        if not 200 <= status < 300:
            assert digest(self.port) == self.before, f"{status} for {what!r} changed the syncer's state"
        else:
            self.wait_merged()  # something valid by chance (a fresh learner id): take the new state as the baseline
            self.before = digest(self.port)
            self.theta = theta_digest(self.port)

    @rule(path=st.sampled_from(["/v1/register", "/v1/heartbeat"]),
          body=json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=200))
    def json_endpoint_garbage(self, path, body):
        self.refused(request(self.port, "POST", path, body, {"Content-Type": "application/json"}), (path, body[:80]))

    @rule(path=st.sampled_from(["/v1/register", "/v1/heartbeat"]), i=st.integers(0, len(RAW_JSON_TEXTS) - 1))
    def json_endpoint_known_trap(self, path, i):
        """Drawn by index: hypothesis prints every step's arguments, and some of these bodies are 100 kB."""
        body = RAW_JSON_TEXTS[i]
        self.refused(request(self.port, "POST", path, body, {"Content-Type": "application/json"}), (path, body[:80]))

    @rule(doc=near_valid("register"))
    def register_with_one_field_wrong(self, doc):
        self.refused(request(self.port, "POST", "/v1/register", json.dumps(doc, allow_nan=True).encode()), doc)

    @rule(doc=near_valid("heartbeat"))
    def heartbeat_with_one_field_wrong(self, doc):
        self.refused(request(self.port, "POST", "/v1/heartbeat", json.dumps(doc, allow_nan=True).encode()), doc)

    @rule(p=st.sampled_from(["0", "1", "2", "-1", "²", "%C2%B2", "١", "9" * 40, "0x1", "+1", "%00", "", " 0"]),
          meta=submission_meta_strings(), tensors=tensor_entries)
    def submission_with_a_hand_made_header(self, p, meta, tensors):
        body = raw_safetensors(meta, tensors)
        self.refused(request(self.port, "POST", f"/v1/fragments/{p}/outer-gradient", body,
                             {"Content-Type": "application/octet-stream"}), (p, meta))

    @rule(data=st.data())
    def garbled_valid_submission(self, data):
        p = data.draw(st.integers(0, FRAGMENTS - 1))
        body = bytearray(self.valid_body(p, f"garbled-{self.sent}"))
        how = data.draw(st.sampled_from(["truncate", "flip", "header-length", "append"]))
        if how == "truncate":
            body = body[: data.draw(st.integers(0, len(body) - 1))]
        elif how == "flip":
            for _ in range(data.draw(st.integers(1, 8))):
                i = data.draw(st.integers(0, len(body) - 1))
                body[i] ^= 1 << data.draw(st.integers(0, 7))
        elif how == "header-length":
            body[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
        else:
            body += data.draw(st.binary(min_size=1, max_size=64))
        answer = request(self.port, "POST", f"/v1/fragments/{p}/outer-gradient", bytes(body))
        if how == "flip" and 200 <= answer[0] < 300:  # a flipped mantissa bit is still a valid submission
            self.sent += 1
        self.refused(answer, (how, p))

    @rule(p=st.sampled_from(["0", "1", "5", "x"]), after=st.none() | st.text(max_size=30) | weird_ints.map(str),
          dtype=st.none() | st.text(max_size=12) | st.sampled_from(["fp32", "bf16", "fp16", "FP32"]))
    def fragment_query(self, p, after, dtype):
        params = {k: v for k, v in (("after", after), ("dtype", dtype)) if v is not None}
        self.refused(request(self.port, "GET", f"/v1/fragments/{p}?{urlencode(params)}"), params)

    @rule(path=st.sampled_from(ENDPOINTS), method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
          auth=st.none() | st.sampled_from([AUTH, AUTH + "x", "Bearer", "Basic Zm9vOmJhcg==", AUTH.lower()]))
    def wrong_method_or_token(self, path, method, auth):
        self.refused(request(self.port, method, path, b"{}", auth=auth), (method, path, auth))

    @rule(kind=st.sampled_from(["long-header", "long-target", "many-headers", "bad-length", "negative-length",
                                "chunked-garbage", "not-http", "binary-request-line",
                                "oversized-body", "oversized-json"]))
    def garbled_http(self, kind):
        target = "/v1/heartbeat"
        raw = {
            "long-header": f"GET /v1/status HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH}\r\nX-Big: {'a' * 20000}"
                           "\r\n\r\n".encode(),
            "long-target": f"GET /v1/fragments/0?after={'1' * 20000} HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
            "many-headers": b"GET /v1/status HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 200 + b"\r\n",
            "bad-length": f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{{}}".encode(),
            "negative-length": f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{{}}".encode(),
            "chunked-garbage": f"POST {target} HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH}\r\n"
                               "Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n".encode(),
            "not-http": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)),
            "binary-request-line": b"G\x00T /\xff HTTP/1.1\r\n\r\n",
            "oversized-body": f"POST /v1/fragments/0/outer-gradient HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH}\r\n"
                              f"Content-Length: {MAX_BODY_MB * 2**20 + 1}\r\n\r\n".encode()
                              + b"\0" * (MAX_BODY_MB * 2**20 + 1),
            "oversized-json": f"POST /v1/register HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH}\r\n"
                              f"Content-Length: {200_000}\r\n\r\n".encode() + b" " * 200_000,
        }[kind]
        self.refused(http(self.port, raw), kind)

    @rule(path=st.sampled_from(["/v1/register", "/v1/fragments/0/outer-gradient"]))
    def a_stalled_body_does_not_stall_others(self, path):
        """A client that declares a body and never sends it holds only its own connection."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=ANSWER_TIMEOUT_S) as stalled:
            stalled.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH}\r\n"
                            "Content-Length: 100000\r\n\r\n{\"learner_id\"".encode())
            self.refused(request(self.port, "GET", "/v1/versions"), "a request beside a stalled one")
        assert digest(self.port) == self.before

    @rule()
    def valid_submission_merges(self):
        versions = get_json(self.port, "/v1/versions")["versions"]
        p = self.sent % FRAGMENTS
        status, _, body = request(self.port, "POST", f"/v1/fragments/{p}/outer-gradient",
                                  self.valid_body(p, f"valid-{time.time_ns()}", base=versions[str(p)]))
        assert status == 202, body[:300]
        self.sent += 1
        deadline = time.monotonic() + 30
        while get_json(self.port, "/v1/versions")["versions"][str(p)] <= versions[str(p)]:
            assert time.monotonic() < deadline, "a valid submission among hostile ones was never merged"
            time.sleep(0.02)
        self.wait_merged()
        self.before = digest(self.port)
        self.theta = theta_digest(self.port)

    def valid_body(self, p: int, sid: str, base: int | None = None) -> bytes:
        if base is None:
            base = get_json(self.port, "/v1/versions")["versions"][str(p)]
        shapes = self.syncer.shapes[p]
        g = torch.Generator().manual_seed(len(sid))
        parts = {n: quantize(torch.randn(s, generator=g) * 1e-3, "none", 64) for n, s in shapes.items()}
        return encode_submission(SubmissionMeta("fuzz-valid", sid, p, base, 4, 256), parts, "none", 64, shapes)

    @invariant()
    def still_serving(self):
        if hasattr(self, "port"):
            assert request(self.port, "GET", "/healthz", auth=None)[0] == 200

    def teardown(self):
        if hasattr(self, "port"):
            assert theta_digest(self.port) == self.theta, "Θ changed without a valid submission"


def test_hostile_requests_never_get_a_5xx_never_change_state_and_valid_submissions_still_merge(syncer):
    HostileClients.syncer = syncer
    name = os.environ.get("DILOCO_FUZZ_PROFILE", "syncer-fuzz")
    profile = settings.get_profile(name)
    HostileClients.TestCase.settings = profile
    started = time.monotonic()
    HostileClients.TestCase("runTest").runTest()
    log = syncer.log_path.read_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-4000:]
    assert name != "syncer-fuzz" or time.monotonic() - started < 120, "the suite's profile must stay quick"


def test_an_oversized_header_line_is_a_400_logged_as_one_warning_without_a_traceback(syncer):
    before = syncer.log_path.read_text()
    raw = f"GET /v1/status HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH}\r\nX-Big: {'a' * 20000}\r\n\r\n".encode()
    status, _, _ = http(syncer.port, raw)
    assert status == 400
    deadline = time.monotonic() + 5
    while "LineTooLong" not in syncer.log_path.read_text()[len(before):] and time.monotonic() < deadline:
        time.sleep(0.05)
    new = syncer.log_path.read_text()[len(before):]
    lines = [line for line in new.splitlines() if "LineTooLong" in line]
    assert len(lines) == 1 and " WARNING " in lines[0], new
    assert "Traceback" not in new and " ERROR " not in new, new
