"""The learner's background client against a real `diloco syncer` process: start-up pull, acknowledgements,
stale bases, idempotent ids, superseding and retries."""

import shutil
import socket
import signal
import threading
import time
import urllib.request

import pytest
import torch

from diloco_trainer.learner.client import SyncerClient
from diloco_trainer.learner.link import Submission, SyncerRefused
from diloco_trainer.config import TrainConfig
from diloco_trainer.model.gpt import build_model
from diloco_trainer.protocol.wire import ErrorFeedback, SubmissionMeta, encode_submission

from polling import wait_for
from learner_kit import TOKEN, SyncerProcess, free_port, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # a real syncer process


@pytest.fixture(scope="module")
def syncer(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("client")
    proc = SyncerProcess(write_config(tmp / "run.yaml", versions_kept=2, grace=0.0, compression="none"), tmp / "syncer",
                         tmp / "syncer.log")
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture
def client(syncer, request):
    c = SyncerClient(syncer.url, TOKEN, request.node.name[:40].replace("[", "-").rstrip("]"), poll_s=0.05)
    yield c
    c.close()


def _body(c: SyncerClient, plan, theta, p: int, base: int, sid: str, scale: float = 1e-3, c_steps: int = 4):
    deltas = {n: torch.full_like(theta[n], scale) for n in plan[p]}
    parts = ErrorFeedback().compress(deltas, "none", 64)
    meta = SubmissionMeta(c.learner_id, sid, p, base, c_steps, c_steps * 512)
    body = encode_submission(meta, parts, "none", 64, {n: tuple(theta[n].shape) for n in plan[p]})
    return Submission(p, base, sid, body, c_steps, c_steps * 512)


def _answers(c: SyncerClient, n: int = 1):
    got = []
    wait_for(lambda: got.extend(c.take_answers()) or len(got) >= n, 30, f"{n} answer(s) from the syncer")
    return got


def _newest(c: SyncerClient, p: int, after: int):
    """Wait until the client hands over a version of fragment p newer than `after`."""
    seen = {}
    wait_for(lambda: seen.update({u.fragment: u for u in c.take_updates()}) or
             (p in seen and seen[p].version > after), 30, f"a version of fragment {p} newer than {after}")
    return seen[p]


def test_bootstrap_pulls_the_run_config_the_plan_and_the_initial_theta(client):
    boot = client.bootstrap()
    cfg = TrainConfig.model_validate(boot.config)
    assert cfg.outer.fragments == len(boot.plan) == 4 and cfg.model.d_model == 64
    model = build_model(cfg.model, cfg.seed)
    names = [n for frag in boot.plan for n in frag]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert set(boot.versions) == {0, 1, 2, 3}
    if all(v == 0 for v in boot.versions.values()):  # first test against this syncer: Θ is still Θ₀
        assert all(torch.equal(boot.theta[n], p.detach()) for n, p in model.named_parameters())
    assert client.snapshot()["syncer_up"] and client.snapshot()["bytes_down"] > 0


def test_an_acknowledged_submission_is_merged_and_the_new_version_comes_back(client):
    boot = client.bootstrap()
    base = boot.versions[0]
    client.submit(_body(client, boot.plan, boot.theta, 0, base, f"{client.learner_id}.a.p0.v{base}"))
    (answer,) = _answers(client)
    assert answer.accepted and not answer.duplicate and answer.c_tokens == 4 * 512
    update = _newest(client, 0, base)
    assert set(update.tensors) == set(boot.plan[0])
    moved = [n for n in boot.plan[0] if not torch.equal(update.tensors[n], boot.theta[n])]
    assert moved, "the merged version must differ from the base"
    snap = client.snapshot()
    counters = ("sent", "acked", "acked_tokens", "acked_steps", "pending")
    assert tuple(snap[k] for k in counters) == (1, 1, 2048, 4, 0)


def test_a_retried_id_is_counted_once(client, syncer):
    boot = client.bootstrap()
    base = boot.versions[2]
    sid = f"{client.learner_id}.b.p2.v{base}"
    client.submit(_body(client, boot.plan, boot.theta, 2, base, sid))
    assert _answers(client)[0].accepted
    client.submit(_body(client, boot.plan, boot.theta, 2, base, sid))  # already acknowledged: never sent again
    assert client.pending() == 0
    # Another client with the same id (as if the first 202 had been lost on the wire) gets "duplicate".
    other = SyncerClient(syncer.url, TOKEN, client.learner_id)
    try:
        other.bootstrap()
        other.submit(_body(other, boot.plan, boot.theta, 2, base, sid, scale=5e-3, c_steps=9))
        (answer,) = _answers(other)
        assert answer.accepted and answer.duplicate
    finally:
        other.close()
    wait_for(lambda: not any(syncer.status()["pending"].values()), 30, "the merge")
    mine = syncer.status()["learners"][client.learner_id]
    assert mine["submissions_merged"] == 1 and mine["tokens_merged"] == 2048, "the duplicate must not be merged"


def test_a_base_older_than_the_syncer_keeps_is_answered_409_and_counted_stale(client):
    boot = client.bootstrap()
    p, first = 1, boot.versions[1]
    base = first
    for i in range(3):  # versions_kept=2: after three merges the first base is gone
        client.submit(_body(client, boot.plan, boot.theta, p, base, f"{client.learner_id}.c{i}.p{p}.v{base}"))
        assert _answers(client)[0].accepted
        base = _newest(client, p, base).version
    client.submit(_body(client, boot.plan, boot.theta, p, first, f"{client.learner_id}.old.p{p}.v{first}"))
    (answer,) = _answers(client)
    assert answer.status == 409 and not answer.accepted and str(first) in answer.reason
    snap = client.snapshot()
    assert snap["rejected"] == snap["stale"] == 1 and snap["acked"] == 3 and snap["pending"] == 0


def test_a_malformed_submission_is_rejected_and_dropped_not_retried(client):
    boot = client.bootstrap()
    sub = _body(client, boot.plan, boot.theta, 3, boot.versions[3], f"{client.learner_id}.bad.p3")
    sub.body = sub.body[:-7]  # truncated safetensors
    client.submit(sub)
    (answer,) = _answers(client)
    assert answer.status == 400 and "safetensors" in answer.reason
    assert client.snapshot()["rejected"] == 1 and client.pending() == 0


def test_a_queued_submission_is_superseded_by_a_fresh_one_with_the_same_id():
    c = SyncerClient(f"http://127.0.0.1:{free_port()}", TOKEN, "nobody")  # never bootstrapped: nothing is sent
    try:
        old = Submission(0, 3, "nobody.x.p0.v3", b"old", 2, 100)
        new = Submission(0, 3, "nobody.x.p0.v3", b"new", 5, 250)
        assert c.submit(old) and c.submit(new)
        c.submit(Submission(1, 3, "nobody.x.p1.v3", b"other", 1, 50))
        assert c.pending() == 2 and c.snapshot()["superseded"] == 1
        assert c._outbox["nobody.x.p0.v3"] is new
    finally:
        c.close()


def test_a_submission_on_its_way_to_the_syncer_is_never_superseded(client, syncer):
    """Once the sender has taken a Δ, a fresh Δ with its id is refused until the answer is booked: the syncer merges
    one Δ per id, so replacing it would drop the steps only the fresh one covers when the first is merged."""
    boot = client.bootstrap()
    p, base = 1, boot.versions[1]
    sid = f"{client.learner_id}.x.p{p}.v{base}"
    first = _body(client, boot.plan, boot.theta, p, base, sid, c_steps=2)
    syncer.send(signal.SIGSTOP)  # the request reaches its socket, the answer waits
    try:
        assert client.submit(first)
        wait_for(lambda: client._posting == sid, 30, "the sender to take the first Δ")
        assert not client.submit(_body(client, boot.plan, boot.theta, p, base, sid, c_steps=6))
        assert client._outbox[sid] is first and client.snapshot()["superseded"] == 0
    finally:
        syncer.send(signal.SIGCONT)
    (answer,) = _answers(client)
    assert answer.accepted and (answer.c_steps, answer.c_tokens) == (2, 2 * 512)
    assert not client.submit(_body(client, boot.plan, boot.theta, p, base, sid, c_steps=6)), "acknowledged"
    assert client.pending() == 0


def test_bootstrap_keeps_retrying_while_no_syncer_answers_until_stopped():
    c = SyncerClient(f"http://127.0.0.1:{free_port()}", TOKEN, "early", backoff_s=0.05, backoff_max_s=0.2)
    stop = threading.Event()
    threading.Timer(1.5, stop.set).start()
    started = time.monotonic()
    try:
        with pytest.raises(InterruptedError):
            c.bootstrap(stop)
        assert 1.4 < time.monotonic() - started < 10
        assert not c.snapshot()["syncer_up"]
    finally:
        c.close()


def test_a_wrong_token_is_refused_at_registration(syncer):
    c = SyncerClient(syncer.url, "not-the-token", "intruder")
    try:
        with pytest.raises(SyncerRefused, match="401"):
            c.bootstrap()
    finally:
        c.close()


def test_a_syncer_that_lost_the_version_held_hands_its_current_one_over_as_a_rewind(tmp_path):
    proc = SyncerProcess(write_config(tmp_path / "run.yaml", grace=0.0, compression="none"), tmp_path / "syncer",
                         tmp_path / "syncer.log", free_port())
    proc.start()
    c = SyncerClient(proc.url, TOKEN, "rewound", poll_s=0.05, backoff_s=0.05, backoff_max_s=0.2)
    try:
        boot = c.bootstrap()
        p, base = 1, boot.versions[1]
        c.submit(_body(c, boot.plan, boot.theta, p, base, f"rewound.a.p{p}.v{base}"))
        assert _answers(c)[0].accepted
        held = _newest(c, p, base).version
        proc.stop(signal.SIGKILL)
        shutil.rmtree(proc.state_dir)  # it comes back without the version the client holds
        proc.start()
        back = wait_for(lambda: next((u for u in c.take_updates() if u.fragment == p), None), 60,
                        "the restarted syncer's version of the fragment")
        assert back.rewind and back.version < held
        # A Δ based on the lost version is refused here, as stale, and never sent.
        c.submit(_body(c, boot.plan, boot.theta, p, held, f"rewound.b.p{p}.v{held}"))
        (answer,) = _answers(c)
        assert answer.status == 409 and "unknown to the syncer" in answer.reason
        snap = c.snapshot()
        assert snap["stale"] == snap["rejected"] == 1 and snap["sent"] == 1 and snap["pending"] == 0
    finally:
        c.close()
        proc.stop()


def test_a_second_submission_for_a_fragment_with_one_pending_is_retried_after_429_until_taken(tmp_path):
    """One pending submission per learner and fragment at the syncer: the client's second one (a fresh id, as after a
    restart) gets 429 while the first waits for quorum, is retried, and is taken once the first is merged; neither
    is dropped nor counted rejected."""
    proc = SyncerProcess(write_config(tmp_path / "run.yaml", grace=0.0, compression="none", quorum=2),
                         tmp_path / "syncer", tmp_path / "syncer.log", args=("--heartbeat-s", "30"))
    proc.start()
    c = SyncerClient(proc.url, TOKEN, "twice", poll_s=0.05, backoff_s=0.05, backoff_max_s=0.2)
    other = SyncerClient(proc.url, TOKEN, "other", poll_s=0.05)
    try:
        boot, _ = c.bootstrap(), other.bootstrap()
        p, base = 0, boot.versions[0]
        c.submit(_body(c, boot.plan, boot.theta, p, base, f"twice.first.p{p}.v{base}"))
        assert _answers(c)[0].accepted
        c.submit(_body(c, boot.plan, boot.theta, p, base, f"twice.second.p{p}.v{base}"))
        wait_for(lambda: _rejected_429(proc) > 0, 30, "the syncer's 429 for the second one")
        assert c.pending() == 1 and proc.status()["pending"]["0"] == 1
        other.submit(_body(other, boot.plan, boot.theta, p, base, f"other.a.p{p}.v{base}"))
        (answer,) = _answers(c)
        assert answer.accepted and not answer.duplicate and answer.submission_id == f"twice.second.p{p}.v{base}"
        assert c.snapshot()["rejected"] == 0 and c.snapshot()["acked"] == 2
    finally:
        c.close()
        other.close()
        proc.stop()


def _metric_sum(proc: SyncerProcess, prefix: str) -> float:
    """The sum of the syncer's /metrics samples whose line starts with `prefix` (a name and some of its labels)."""
    with urllib.request.urlopen(f"{proc.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def _rejected_429(proc: SyncerProcess) -> float:
    return _metric_sum(proc, 'diloco_syncer_submissions_rejected_total{reason="pending_limit"} ')


class StallingRelay:
    """A real TCP relay in front of the syncer that holds back the last byte of the first submission upload, as a
    link that stalls mid-body would: the syncer cuts that upload with 408 once its pace runs out. Every other byte,
    and every later connection, passes through unchanged."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.stalled = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.server.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _relay(self, conn: socket.socket) -> None:
        up = socket.create_connection(("127.0.0.1", self.target_port))
        threading.Thread(target=self._pipe, args=(up, conn), daemon=True).start()  # the syncer's answers
        buf = b""
        try:
            while True:  # one request at a time (aiohttp sends a Content-Length, never chunks, for bytes)
                while b"\r\n\r\n" not in buf:
                    if not (data := conn.recv(65536)):
                        return
                    buf += data
                head, _, rest = buf.partition(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                               if line.lower().startswith(b"content-length:")), 0)
                while len(rest) < length:
                    if not (data := conn.recv(65536)):
                        return
                    rest += data
                request, buf = head + b"\r\n\r\n" + rest[:length], rest[length:]
                if not self.stalled.is_set() and b"/outer-gradient" in head.split(b"\r\n", 1)[0]:
                    self.stalled.set()
                    up.sendall(request[:-1])  # the last byte never comes: the syncer answers 408 and closes
                    return
                up.sendall(request)
        except OSError:
            return


def test_an_upload_cut_with_408_on_a_stalling_link_is_retried_not_dropped(tmp_path):
    """A body that arrives slower than the syncer's pace is cut with 408 (issue 38's slowloris guard); an honest
    learner on a link that stalled gets its submission back in the outbox and sends it again, instead of booking
    the round's work as refused."""
    proc = SyncerProcess(write_config(tmp_path / "run.yaml", grace=0.0, compression="none"), tmp_path / "syncer",
                         tmp_path / "syncer.log", args=("--body-base-s", "2", "--body-min-rate-kbs", "1024"))
    proc.start()
    relay = StallingRelay(proc.port)
    c = SyncerClient(f"http://127.0.0.1:{relay.port}", TOKEN, "stalled", poll_s=0.05, backoff_s=0.05,
                     backoff_max_s=0.2)
    try:
        boot = c.bootstrap()
        p, base = 2, boot.versions[2]
        c.submit(_body(c, boot.plan, boot.theta, p, base, f"stalled.a.p{p}.v{base}"))
        (answer,) = _answers(c)
        assert relay.stalled.is_set() and _body_timeouts(proc) == 1, "the first upload was not cut with 408"
        assert answer.accepted and answer.status == 202 and not answer.duplicate, answer
        snap = c.snapshot()
        assert snap["rejected"] == 0 and snap["acked"] == 1 and snap["pending"] == 0, snap
        assert _newest(c, p, base).version > base  # and it was merged
    finally:
        c.close()
        relay.close()
        proc.stop()


def _body_timeouts(proc: SyncerProcess) -> float:
    return _metric_sum(proc, "diloco_syncer_body_timeouts_total{")
