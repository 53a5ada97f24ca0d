"""Fast syncer recovery: one serving syncer per state directory (a kernel lock), a warm standby that takes over a
syncer killed with -9 during merges, and the merge journal that publishes every version again after a crash."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from diloco_trainer.protocol.messages import RestartHold
from diloco_trainer.runtime.procs import Child, Supervisor, child_env, diloco_argv
from diloco_trainer.runtime.standby import SyncerStandby
from diloco_trainer.syncer.journal import JournalEntry, MergeJournal
from diloco_trainer.syncer.takeover import StateLock, read_incarnations, wait_out_hold
from diloco_trainer.protocol.wire import SubmissionMeta, decode_tensors, encode_submission, quantize
from polling import wait_for, wait_for_async
from syncer_kit import AUTH, TOKEN, body, deltas_for, make_syncer, serve, start, tiny_config


# --------------------------------------------------------------------------- the lock


def test_two_syncers_never_hold_one_state_directory_at_once(tmp_path):
    first, second = StateLock(tmp_path), StateLock(tmp_path)
    assert first.try_acquire()
    assert not second.try_acquire(), "a second holder while the first still holds the lock"
    assert first.holder() == os.getpid()
    first.release()
    assert second.try_acquire()
    second.release()


def test_the_lock_of_a_holder_killed_with_sigkill_is_free_at_once(tmp_path):
    trainer = Path(__file__).resolve().parents[2] / "trainer"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from diloco_trainer.syncer.takeover import StateLock; "
         f"assert StateLock(Path({str(tmp_path)!r})).try_acquire(); print('held', flush=True); time.sleep(600)"],
        env={**os.environ, "PYTHONPATH": str(trainer)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        waiter = StateLock(tmp_path)
        assert not waiter.try_acquire() and waiter.holder() == holder.pid
        got = threading.Event()
        threading.Thread(target=lambda: (waiter.acquire(), got.set()), daemon=True).start()
        assert not got.wait(0.5), "acquired while the holder lives"
        holder.kill()
        assert got.wait(30), "the lock stayed taken after its holder died"
        assert waiter.holder() == os.getpid()
    finally:
        holder.kill()
        holder.wait()


def test_a_standby_that_took_over_waits_out_a_restart_hold_before_serving(tmp_path):
    hold = tmp_path / "syncer.json"  # what `diloco chaos` writes for a downtime, before it kills the syncer
    hold.write_text(RestartHold(until=time.time() + 0.6, by="test").model_dump_json())
    assert wait_out_hold(hold) >= 0.5
    hold.write_text(RestartHold(until=time.time() + 600, by="test").model_dump_json())
    threading.Timer(0.3, hold.unlink).start()  # the downtime is lifted early: the file goes
    assert wait_out_hold(hold) < 60
    hold.write_text(RestartHold(until=time.time() - 1, by="test").model_dump_json())
    assert wait_out_hold(hold) < 0.5, "an expired hold held"
    hold.write_text("{not a hold")
    assert wait_out_hold(hold) < 0.5, "a broken hold file kept the syncer down"


# --------------------------------------------------------------------------- the merge journal


def test_a_torn_last_journal_line_is_dropped_and_the_next_merge_starts_a_line_of_its_own(tmp_path):
    journal = MergeJournal(tmp_path)
    journal.append(JournalEntry(0, 1, ("000000000001.safetensors",)))
    with open(journal.path, "a") as f:
        f.write('{"fragment": 1, "versi')  # a crash in the middle of an append
    again = MergeJournal(tmp_path)
    assert again.entries() == [JournalEntry(0, 1, ("000000000001.safetensors",))]
    again.append(JournalEntry(1, 1, ("000000000002.safetensors",)))
    assert [json.loads(line)["fragment"] for line in journal.path.read_text().splitlines()] == [0, 1]
    again.covered([1, 0])  # a checkpoint with fragment 0 at version 1: only fragment 1's merge is left
    assert MergeJournal(tmp_path).entries() == [JournalEntry(1, 1, ("000000000002.safetensors",))]


async def test_versions_published_before_a_crash_are_published_again_under_their_own_ids(aiohttp_client, tmp_path):
    cfg = tiny_config(quorum=1)
    live, crashed = tmp_path / "live", tmp_path / "crashed"
    syncer, client, st = await serve(aiohttp_client, live, cfg)
    for i, learner in enumerate(["learner-a", "learner-b"]):
        r = await client.post("/v1/fragments/0/outer-gradient", headers=AUTH,
                              data=body(st, 0, deltas_for(st, 0, seed=i), learner=learner, sid=f"s{i}", base=i,
                                        c_tokens=100 + i))
        assert r.status == 202
        await wait_for_async(lambda: st.versions[0] == i + 1)
    assert not (live / "checkpoint").exists()
    shutil.copytree(live, crashed)  # the disk as kill -9 leaves it: two merges published, no checkpoint

    revived = make_syncer(crashed, cfg)
    st2 = revived.state
    assert st2.versions == [2, 0] and st2.pending == [{}, {}]
    assert st2.tokens_merged == 201 and st2.contributions_merged == 2
    for n in st.plan[0]:  # redone from the spooled θ_m: the same version up to float rounding
        torch.testing.assert_close(st2.theta[n], st.theta[n], rtol=1e-5, atol=1e-6)
    client2 = await start(aiohttp_client, revived)
    for base in (1, 2):  # learners holding either published version keep their work (no 409 "base lost")
        r = await client2.post("/v1/fragments/0/outer-gradient", headers=AUTH,
                               data=body(st2, 0, deltas_for(st2, 0, seed=5 + base), learner="learner-c",
                                         sid=f"after-{base}", base=base))
        assert r.status == 202, await r.text()
        await wait_for_async(lambda: st2.pending[0] == {})
    retry = await client2.post("/v1/fragments/0/outer-gradient", headers=AUTH,
                               data=body(st, 0, deltas_for(st, 0, seed=0), learner="learner-a", sid="s0", base=0))
    assert (await retry.json())["duplicate"] is True  # merged once, before the crash; not again
    await client2.close()  # final checkpoint: it covers every journaled merge and spooled file
    assert MergeJournal(crashed).entries() == []
    assert list((crashed / "spool").glob("*.safetensors")) == []


# --------------------------------------------------------------------------- the warm standby, for real


def _http(method: str, url: str, data: bytes | None = None, json_body=None, timeout: float = 10.0):
    headers = {"Authorization": f"Bearer {TOKEN}"}
    if json_body is not None:
        data, headers["Content-Type"] = json.dumps(json_body).encode(), "application/json"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class _Learner(threading.Thread):
    """Sends outer gradients in a loop, as a learner does: each on the fragment's current version, retried through
    connection errors until the syncer answers; remembers every id acknowledged (202) and its body."""

    def __init__(self, url: str, plan: dict[str, list[str]], shapes: dict[str, tuple[int, ...]]):
        super().__init__(daemon=True)
        self.url, self.plan, self.shapes = url, plan, shapes
        self.acked: dict[str, tuple[int, bytes]] = {}  # id -> (fragment, body)
        self.stop = threading.Event()
        self.errors = 0

    def _body(self, i: int, p: int, base: int) -> bytes:
        g = torch.Generator().manual_seed(i)
        names = self.plan[str(p)]
        parts = {n: quantize(torch.randn(self.shapes[n], generator=g) * 1e-3, "int8", 64) for n in names}
        return encode_submission(SubmissionMeta("learner-0", f"learner-0:{i}", p, base, 2, 100), parts, "int8", 64,
                                 {n: self.shapes[n] for n in names})

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            p = i % 2
            try:
                status, raw = _http("GET", f"{self.url}/v1/versions")
                payload = self._body(i, p, json.loads(raw)["versions"][str(p)])
                while not self.stop.is_set():
                    try:
                        status, _ = _http("POST", f"{self.url}/v1/fragments/{p}/outer-gradient", data=payload)
                        break
                    except OSError:  # the syncer is down: the same body again, as the learner's outbox does
                        self.errors += 1
                        time.sleep(0.05)
                if status == 202:
                    self.acked[f"learner-0:{i}"] = (p, payload)
            except OSError:
                self.errors += 1
                time.sleep(0.05)
                continue
            i += 1


@pytest.mark.slow
def test_a_warm_standby_takes_over_a_syncer_killed_during_merges_and_nothing_acknowledged_is_lost(tmp_path):
    config, state_dir = tmp_path / "run.yaml", tmp_path / "syncer"
    config.write_text("model: tiny\nseed: 1\nouter:\n  fragments: 2\n  compression: int8\n  quorum: 1\n")
    argv = diloco_argv("syncer", "--config", str(config), "--host", "127.0.0.1", "--port", "0", "--state-dir",
                       str(state_dir), "--checkpoint-every-s", "3600", "--log-every-s", "0")
    env = child_env({"DILOCO_TOKEN": TOKEN})
    log = tmp_path / "syncer.log"
    with Supervisor(tmp_path / "processes.json", tmp_path / "events.jsonl") as sup:
        syncer = sup.add(Child("syncer", "syncer", argv, env, log, restart_delay=0.05))
        sup.start("syncer")
        endpoint = wait_for(lambda: (state_dir / "endpoint.json").exists() and json.loads(
            (state_dir / "endpoint.json").read_text()), 120, "the syncer to listen", 0.05)
        url, first_pid = endpoint["url"], syncer.proc.pid
        argv[argv.index("--port") + 1] = str(endpoint["port"])
        sup.syncer_standby = SyncerStandby(argv, env, log, sup.spawn, state_dir, respawn_after_s=30.0)
        sup.poll()
        standby_pid = sup.syncer_standby.proc.pid
        wait_for(lambda: f"syncer pid {first_pid} serves" in log.read_text(), 120, "the standby to wait", 0.05)
        assert json.loads((state_dir / "endpoint.json").read_text())["pid"] == first_pid, "the standby serves too"

        status, reply = _http("POST", f"{url}/v1/register", json_body={"learner_id": "learner-0", "unit": 0,
                                                                       "world_size": 1, "device": "cpu"})
        assert status == 200
        shapes = {n: tuple(t.shape) for p in (0, 1)
                  for n, t in decode_tensors(_http("GET", f"{url}/v1/fragments/{p}")[1])[0].items()}
        learner = _Learner(url, json.loads(reply)["plan"], shapes)
        learner.start()
        wait_for(lambda: len(learner.acked) >= 6, 60, "acknowledged submissions before the kill", 0.05)
        os.kill(first_pid, signal.SIGKILL)  # in the middle of merging: a merge follows every submission
        wait_for(lambda: [e for e in sup.poll() if e.event == "start"] or syncer.restarts, 60, "the restart", 0.05)
        assert syncer.proc.pid == standby_pid and sup.events[-1].standby is True
        wait_for(lambda: json.loads((state_dir / "endpoint.json").read_text())["pid"] == standby_pid, 60, "the standby to serve", 0.05)
        acked_before = len(learner.acked)
        wait_for(lambda: len(learner.acked) >= acked_before + 6, 60, "acknowledged submissions after the takeover", 0.05)
        learner.stop.set()
        learner.join(timeout=60)

        def settled():
            s = json.loads(_http("GET", f"{url}/v1/status")[1])
            return s if s["pending"] == {"0": 0, "1": 0} else None

        s = wait_for(settled, 60, "the last merges", 0.05)
        assert s["contributions_merged"] == len(learner.acked), "an acknowledged submission was lost or doubled"
        assert s["learners"]["learner-0"]["submissions_merged"] == len(learner.acked)
        for p, payload in list(learner.acked.values())[-8:]:  # merged exactly once: a retry is only a duplicate
            status, reply = _http("POST", f"{url}/v1/fragments/{p}/outer-gradient", data=payload)
            assert status == 202 and json.loads(reply)["duplicate"] is True
        incarnations = read_incarnations(state_dir)
        assert [i["pid"] for i in incarnations] == [first_pid, standby_pid]
        assert incarnations[-1]["standby"] is True and incarnations[-1]["previous_pid"] == first_pid

        # The standby that took over forked the next one (no Python start, no import): adopted, not started anew.
        wait_for(lambda: (sup.poll(), sup.syncer_standby.proc is not None)[1], 60, "the next standby", 0.05)
        next_standby = sup.syncer_standby.proc
        assert sup.syncer_standby.adopted == 1 and sup.syncer_standby.started == 1
        assert next_standby.pid == json.loads((state_dir / "standby.json").read_text())["pid"]
        assert os.getpgid(next_standby.pid) == next_standby.pid, "the successor shares the serving syncer's group"
    assert syncer.proc.poll() is not None and next_standby.poll() is not None, "a syncer outlived the supervisor"


def _status_field(pid: int, field: str) -> str:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(f"{field}:"))
    return line.split(":", 1)[1].strip()


def _child_of(parent: int) -> int:
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and _status_field(int(entry.name), "PPid") == str(parent):
                return int(entry.name)
        except (OSError, StopIteration):
            continue
    raise AssertionError(f"no child of {parent}")


@pytest.mark.slow
def test_a_waiting_standby_that_is_pid_1_of_its_container_leaves_on_sigterm_instead_of_taking_over(tmp_path):
    """In the operator's syncer pod each syncer is PID 1 of its container, where the kernel drops signals that have
    no handler: a standby that ignored the pod's SIGTERM would take over from the syncer's clean stop."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        raise AssertionError("needs unshare(1) and root (as the container tests do) to run a PID namespace")
    config, state_dir = tmp_path / "run.yaml", tmp_path / "syncer"
    config.write_text("model: tiny\nseed: 1\nouter:\n  fragments: 2\n  quorum: 1\n")
    argv = diloco_argv("syncer", "--config", str(config), "--host", "127.0.0.1", "--port", "0", "--state-dir",
                       str(state_dir), "--log-every-s", "0")
    env = child_env({"DILOCO_TOKEN": TOKEN})
    serving = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    standby_log = tmp_path / "standby.log"
    standby = None
    try:
        endpoint = wait_for(lambda: (state_dir / "endpoint.json").exists() and json.loads(
            (state_dir / "endpoint.json").read_text()), 120, "the syncer to listen", 0.05)
        with open(standby_log, "w") as out:  # --fork: the syncer is the namespace's PID 1, as in a container
            standby = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", *argv, "--standby",
                                        "--no-fork-successor"], env=env, stdout=out, stderr=subprocess.STDOUT)
        wait_for(lambda: "standing by" in standby_log.read_text(), 120, "the standby to wait", 0.05)
        pid1 = _child_of(standby.pid)
        assert _status_field(pid1, "NSpid").split()[-1] == "1", "the standby is not PID 1 of its namespace"
        os.kill(pid1, signal.SIGTERM)
        assert standby.wait(timeout=30) == 0, standby_log.read_text()
        assert "stopped by signal 15 before serving" in standby_log.read_text()
        # The serving syncer was never disturbed, and a clean stop of it hands nothing to anyone.
        assert _http("GET", f"{endpoint['url']}/healthz")[0] == 200
        serving.send_signal(signal.SIGTERM)
        assert serving.wait(timeout=60) == 0
        assert [i["pid"] for i in read_incarnations(state_dir)] == [endpoint["pid"]]
    finally:
        for proc in (standby, serving):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
