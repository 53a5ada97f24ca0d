"""A damaged latest checkpoint: the syncer starts from the previous one and the merge journal redoes every merge
since, so nothing acknowledged is lost; with no whole checkpoint left it exits 2 naming them."""

import json
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch

from diloco_trainer.protocol.wire import decode_tensors
from diloco_trainer.syncer.journal import MergeJournal
from diloco_trainer.syncer.state import SyncerState
from learner_kit import ROOT, TOKEN, SyncerProcess, child_env
from polling import wait_for, wait_for_async
from syncer_kit import AUTH, body, deltas_for, make_syncer, start, tiny_config


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_byte(path):
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x40  # inside the tensor data: still a well-formed safetensors file
    path.write_bytes(bytes(raw))


def _edit_a_number(path):
    doc = json.loads(path.read_text())
    doc["tokens_merged"] += 1  # well-formed JSON, wrong content
    path.write_text(json.dumps(doc))


DAMAGE = {
    "truncated theta": ("theta.safetensors", _truncate),
    "state.json not JSON": ("state.json", lambda p: p.write_text('{"format": 1, "versi')),
    "a flipped byte in momentum": ("momentum.safetensors", _flip_a_byte),
    "an edited number in state.json": ("state.json", _edit_a_number),
}


async def _three_merges_two_checkpoints(aiohttp_client, state_dir):
    """Merges a (fragment 0), checkpoint, b (fragment 1), checkpoint, c (fragment 0): the latest checkpoint
    covers a and b, the previous one a; c is only journaled. Returns the live syncer's state."""
    syncer = make_syncer(state_dir, tiny_config(quorum=1))
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    for sid, learner, p, base, tokens in (("a", "learner-a", 0, 0, 100), ("b", "learner-b", 1, 0, 200),
                                          ("c", "learner-a", 0, 1, 400)):
        r = await client.post(f"/v1/fragments/{p}/outer-gradient", headers=AUTH,
                              data=body(st, p, deltas_for(st, p, seed=len(sid) + p + base), learner=learner,
                                        sid=sid, base=base, c_tokens=tokens))
        assert r.status == 202, await r.text()
        await wait_for_async(lambda: st.versions[p] == base + 1 and not st.pending[p])
        if sid != "c":
            await syncer.checkpoint()
    return st


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
async def test_a_damaged_latest_checkpoint_is_set_aside_and_the_previous_one_plus_the_journal_lose_nothing(
        aiohttp_client, tmp_path, damage):
    live, crashed = tmp_path / "live", tmp_path / "crashed"
    st = await _three_merges_two_checkpoints(aiohttp_client, live)
    shutil.copytree(live, crashed)  # the disk as kill -9 leaves it
    name, spoil = DAMAGE[damage]
    spoil(crashed / "checkpoint" / name)

    resumed = SyncerState(tiny_config(quorum=1), crashed)
    assert resumed.versions == st.versions == [2, 1]
    assert resumed.tokens_merged == 700 and resumed.contributions_merged == 3
    assert {lid: i.tokens_merged for lid, i in resumed.learners.items()} == {"learner-a": 500, "learner-b": 200}
    assert set(resumed.merged_ids) == {"a", "b", "c"} and resumed.pending == [{}, {}]
    for n in resumed.theta:  # redone from the spooled θ_m: the same versions up to float rounding
        torch.testing.assert_close(resumed.theta[n], st.theta[n], rtol=1e-5, atol=1e-6)
    assert str(crashed / "checkpoint" / name) in resumed.checkpoint_fallback
    assert (crashed / "checkpoint.corrupt" / name).exists() and not (crashed / "checkpoint").exists()
    # The next checkpoint keeps the one it fell back to as the previous one, not the damaged one.
    resumed.write(resumed.checkpoint_job())
    again = SyncerState(tiny_config(quorum=1), crashed)
    assert again.checkpoint_fallback is None and again.versions == [2, 1] and again.tokens_merged == 700
    assert json.loads((crashed / "checkpoint.old" / "state.json").read_text())["versions"] == {"0": 1, "1": 0}


async def test_the_journal_and_the_spool_reach_back_to_the_previous_checkpoint_and_no_further(
        aiohttp_client, tmp_path):
    st = await _three_merges_two_checkpoints(aiohttp_client, tmp_path)
    spooled = lambda: len(list((tmp_path / "spool").glob("*.safetensors")))  # noqa: E731
    # The previous checkpoint holds a: b (covered by the latest only) and c (by neither) stay.
    assert [(e.fragment, e.version) for e in st.journal.entries()] == [(1, 1), (0, 2)] and spooled() == 2
    st.write(st.checkpoint_job())  # the latest (a, b) becomes the previous one: b's line and file go
    assert [(e.fragment, e.version) for e in MergeJournal(tmp_path).entries()] == [(0, 2)] and spooled() == 1
    # A restart from the (whole) latest leaves what the previous one needs in place.
    SyncerState(tiny_config(quorum=1), tmp_path)
    assert [(e.fragment, e.version) for e in MergeJournal(tmp_path).entries()] == [(0, 2)] and spooled() == 1


def test_a_checkpoint_written_before_checksums_still_loads(tmp_path):
    syncer = make_syncer(tmp_path)
    syncer.state.write(syncer.state.checkpoint_job())
    path = tmp_path / "checkpoint" / "state.json"
    doc = json.loads(path.read_text())
    del doc["sha256"], doc["files"]
    path.write_text(json.dumps(doc))
    resumed = SyncerState(tiny_config(), tmp_path)
    assert resumed.checkpoint_fallback is None and resumed.versions == [0, 0]


def test_a_damaged_only_checkpoint_is_refused_naming_it_and_left_in_place(tmp_path):
    syncer = make_syncer(tmp_path)
    syncer.state.write(syncer.state.checkpoint_job())
    _truncate(tmp_path / "checkpoint" / "theta.safetensors")
    with pytest.raises(ValueError, match="nothing to fall back to") as refused:
        SyncerState(tiny_config(), tmp_path)
    assert str(tmp_path / "checkpoint" / "theta.safetensors") in str(refused.value)
    assert (tmp_path / "checkpoint").exists() and not (tmp_path / "checkpoint.corrupt").exists()


# --------------------------------------------------------------------------- real syncer processes


def _call(url: str, path: str, data: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url + path, data=data, method="POST" if data else "GET",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.slow
def test_a_syncer_killed_after_acknowledging_restarts_from_the_previous_checkpoint_when_the_latest_is_damaged(
        tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: tiny\nseed: 1\nouter:\n  fragments: 2\n  compression: none\n  quorum: 1\n")
    state_dir = tmp_path / "state"
    syncer = SyncerProcess(config, state_dir, tmp_path / "syncer.log", args=("--checkpoint-every-s", "0.3"))
    syncer.start()
    shapes = SyncerState(tiny_config(), tmp_path / "shapes")  # the tiny model's fragments, for bodies
    checkpoints = lambda: float(next(  # noqa: E731
        line.split()[-1] for line in _call(syncer.url, "/metrics")[1].decode().splitlines()
        if line.startswith("diloco_syncer_checkpoints_total")))
    acked = []
    try:
        for i, (learner, p, base, tokens) in enumerate([("learner-0", 0, 0, 4096), ("learner-1", 1, 0, 2048),
                                                        ("learner-0", 0, 1, 1024)]):
            payload = body(shapes, p, deltas_for(shapes, p, seed=i), learner=learner, sid=f"{learner}.s{i}",
                           base=base, c_tokens=tokens)
            status, reply = _call(syncer.url, f"/v1/fragments/{p}/outer-gradient", payload)
            assert status == 202, reply
            acked.append((p, payload))
            wait_for(lambda: syncer.status()["versions"][str(p)] == base + 1, 60, f"merge {i}", 0.05)
            wait_for(lambda: checkpoints() >= i + 1, 60, f"checkpoint {i + 1}", 0.05)
        before = syncer.status()
        _, raw = _call(syncer.url, "/v1/fragments/0")
        theta_before = decode_tensors(raw)[0]
        syncer.stop(signal.SIGKILL)
        _truncate(state_dir / "checkpoint" / "theta.safetensors")  # damaged at rest

        syncer.start()  # before: the damaged checkpoint stopped every start (a crash loop)
        after = syncer.status()
        assert after["versions"] == before["versions"] == {"0": 2, "1": 1}
        assert after["tokens_merged"] == 7168 and after["contributions_merged"] == 3
        for learner in ("learner-0", "learner-1"):
            assert after["learners"][learner]["tokens_merged"] == before["learners"][learner]["tokens_merged"]
        assert after["learners"]["learner-0"]["tokens_merged"] == 5120
        status, raw = _call(syncer.url, "/v1/fragments/0")
        theta_after, meta = decode_tensors(raw)
        assert status == 200 and meta["version"] == "2"
        for n in theta_before:
            torch.testing.assert_close(theta_after[n], theta_before[n], rtol=1e-5, atol=1e-6)
        for p, payload in acked:  # every acknowledged submission is known, none merged twice
            status, reply = _call(syncer.url, f"/v1/fragments/{p}/outer-gradient", payload)
            assert status == 202 and json.loads(reply)["duplicate"] is True, reply
        metrics = _call(syncer.url, "/metrics")[1].decode()
        assert "diloco_syncer_checkpoint_fallbacks_total 1.0" in metrics
        log = (tmp_path / "syncer.log").read_text()
        assert f"checkpoint {state_dir / 'checkpoint'} is damaged" in log
        assert (state_dir / "checkpoint.corrupt").exists() and (state_dir / "checkpoint.old").exists()
    finally:
        syncer.stop(signal.SIGKILL)


@pytest.mark.slow
def test_a_syncer_whose_checkpoints_are_all_damaged_exits_2_naming_them_in_its_termination_message(tmp_path):
    state_dir = tmp_path / "state"
    live = make_syncer(state_dir, tiny_config())
    for _ in range(2):
        live.state.write(live.state.checkpoint_job())
    (state_dir / "checkpoint" / "state.json").write_text("{not json")
    _flip_a_byte(state_dir / "checkpoint.old" / "momentum.safetensors")
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps(tiny_config().model_dump(mode="json")))
    message = tmp_path / "termination-log"
    message.touch()  # as the kubelet provides /dev/termination-log
    cmd = [sys.executable, "-m", "diloco_trainer.cli", "syncer", "--config", str(config), "--host", "127.0.0.1",
           "--port", "0", "--state-dir", str(state_dir)]
    done = subprocess.run(cmd, env=child_env(DILOCO_TERMINATION_LOG=str(message)), cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    text = message.read_text()
    assert text.startswith(f"diloco syncer: no usable checkpoint in {state_dir}")
    assert str(state_dir / "checkpoint" / "state.json") in text
    assert str(state_dir / "checkpoint.old" / "momentum.safetensors") in text
    assert (state_dir / "checkpoint").exists() and (state_dir / "checkpoint.old").exists()  # nothing moved
