"""Syncer durability: spool before the 202, atomic checkpoints, restart = checkpoint + spool replay, exactly once."""

import asyncio
import json
import shutil
import threading
import time

import pytest
import torch
from safetensors import safe_open

from diloco_trainer.config import MODEL_PRESETS
from diloco_trainer.syncer.state import SyncerState
from polling import wait_for_async
from syncer_kit import (AUTH, assert_unchanged, body, deltas_for, first_outer_step, make_syncer, register_body, serve,
                        snapshot, start, tiny_config)


def _spooled(state_dir):
    return sorted(p.name for p in (state_dir / "spool").glob("*.safetensors"))


async def test_an_acknowledged_submission_is_merged_exactly_once_after_a_crash(aiohttp_client, tmp_path):
    cfg = tiny_config(quorum=1)
    live, crashed = tmp_path / "live", tmp_path / "crashed"
    syncer, client, st = await serve(aiohttp_client, live, cfg)
    theta0 = st.fragment(0)
    d = deltas_for(st, 0, seed=1)
    payload = body(st, 0, d, sid="acked-before-crash", c_tokens=777)
    r = await client.post("/v1/fragments/0/outer-gradient", data=payload, headers=AUTH)
    assert r.status == 202
    await wait_for_async(lambda: st.versions[0] == 1)
    assert not (live / "checkpoint").exists() and len(_spooled(live)) == 1
    shutil.copytree(live, crashed)  # the disk as a crash (kill -9) would leave it: no checkpoint yet
    # ... by a syncer without the merge journal (journal.py; or with it lost): version 1 is lost with it.
    (crashed / "merges.jsonl").unlink()

    revived = make_syncer(crashed, cfg)
    assert [len(p) for p in revived.state.pending] == [1, 0], "the spooled submission is pending again"
    client2 = await start(aiohttp_client, revived)
    st2 = revived.state
    await wait_for_async(lambda: st2.pending[0] == {}, what="the replayed merge")
    # Version 1 was published (learners may hold it) but lost: the new version must not reuse its id.
    assert st2.versions[0] > 1 and st2.versions[1] == 0
    assert st2.tokens_merged == 777 and st2.contributions_merged == 1
    for n in st2.plan[0]:
        want = first_outer_step(theta0[n], d[n], cfg.outer.lr, cfg.outer.momentum)
        torch.testing.assert_close(st2.theta[n], want, rtol=1e-5, atol=1e-6)
    retry = await client2.post("/v1/fragments/0/outer-gradient", data=payload, headers=AUTH)
    assert (await retry.json())["duplicate"] is True
    # A learner that adopted the lost version 1 is told to re-adopt (409), not silently mis-anchored.
    lost = await client2.post("/v1/fragments/0/outer-gradient",
                              data=body(st2, 0, d, sid="on-lost-version", base=1), headers=AUTH)
    assert lost.status == 409 and "lost" in (await lost.json())["error"]

    await client2.close()  # clean shutdown: final checkpoint, spool emptied
    assert _spooled(crashed) == []
    again = make_syncer(crashed, cfg)
    assert again.state.tokens_merged == 777 and again.state.contributions_merged == 1
    assert [len(p) for p in again.state.pending] == [0, 0]
    assert again.state.versions == st2.versions
    assert all(torch.equal(again.state.theta[n], st2.theta[n]) for n in st2.theta)
    client3 = await start(aiohttp_client, again)  # merged ids come from the checkpoint now
    retry = await client3.post("/v1/fragments/0/outer-gradient", data=payload, headers=AUTH)
    assert retry.status == 202 and (await retry.json())["duplicate"] is True
    assert again.state.pending == [{}, {}] and again.state.tokens_merged == 777


async def test_a_restart_resumes_from_the_checkpoint_with_momentum_and_counters(aiohttp_client, tmp_path):
    cfg = tiny_config(quorum=1)
    syncer = make_syncer(tmp_path, cfg)
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    for i, p in enumerate([0, 1, 0]):
        r = await client.post(f"/v1/fragments/{p}/outer-gradient",
                              data=body(st, p, deltas_for(st, p, seed=i), sid=f"s{i}", base=st.versions[p]),
                              headers=AUTH)
        assert r.status == 202
        await wait_for_async(lambda: sum(st.outer_steps) == i + 1)
    st.policy.observe_step_time(0.25)
    before = snapshot(st)
    await client.close()

    assert st.last_checkpoint is not None  # the shutdown checkpoint
    resumed = make_syncer(tmp_path, cfg).state
    assert resumed.last_checkpoint == pytest.approx(st.last_checkpoint)  # reported in /v1/status
    after = snapshot(resumed)
    assert_unchanged({**before, "spool": []}, after)
    assert resumed.versions == [2, 1] and resumed.outer_steps == [2, 1]
    assert resumed.policy.step_time.value == pytest.approx(0.25)
    syncer2 = make_syncer(tmp_path, cfg)
    client2 = await start(aiohttp_client, syncer2)
    # The checkpointed current version is a valid base; after a clean stop the ids continue without a gap.
    r = await client2.post("/v1/fragments/1/outer-gradient",
                           data=body(resumed, 1, deltas_for(resumed, 1, seed=7), sid="s9", base=1), headers=AUTH)
    assert r.status == 202
    await wait_for_async(lambda: syncer2.state.versions == [2, 2])


async def test_spool_files_are_deleted_only_once_a_checkpoint_covers_them(aiohttp_client, tmp_path):
    syncer = make_syncer(tmp_path, tiny_config(quorum=2))
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    for lid in ("a", "b", "c"):
        await client.post("/v1/register", json=register_body(lid), headers=AUTH)
    for lid in ("a", "b"):
        await client.post("/v1/fragments/0/outer-gradient",
                          data=body(st, 0, deltas_for(st, 0, seed=1), learner=lid, sid=f"{lid}0"), headers=AUTH)
    await wait_for_async(lambda: st.versions[0] == 1)
    await client.post("/v1/fragments/1/outer-gradient",
                      data=body(st, 1, deltas_for(st, 1, seed=1), learner="c", sid="c1"), headers=AUTH)
    assert len(_spooled(tmp_path)) == 3, "merged but not checkpointed: still spooled"
    shutil.copytree(tmp_path / "spool", tmp_path / "spool-copy")
    await syncer.checkpoint()
    (left,) = _spooled(tmp_path)
    with safe_open(str(tmp_path / "spool" / left), "pt") as f:
        assert json.loads(f.metadata()["submission"])["submission_id"] == "c1"  # pending: kept
    state = json.loads((tmp_path / "checkpoint" / "state.json").read_text())
    assert sorted(state["merged_ids"]) == ["a0", "b0"] and state["versions"] == {"0": 1, "1": 0}
    # Killed after the checkpoint but before the deletions: the covered files must not be merged again.
    for f in (tmp_path / "spool-copy").iterdir():
        shutil.copy(f, tmp_path / "spool" / f.name)
    resumed = SyncerState(tiny_config(quorum=2), tmp_path)
    assert sorted(resumed.pending[1]) == ["c1"] and resumed.pending[0] == {}
    assert _spooled(tmp_path) == [left] and resumed.tokens_merged == 2048


async def test_a_clean_stop_merges_acknowledged_contributions_still_waiting_for_their_quorum(aiohttp_client, tmp_path):
    """A finished job's final checkpoint is its model (`diloco export`) and its syncer never starts again to replay
    the spool: what was acknowledged must be merged into it, quorum reached or not."""
    cfg = tiny_config(quorum=2)
    syncer = make_syncer(tmp_path, cfg)
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    for lid in ("a", "b"):
        await client.post("/v1/register", json=register_body(lid), headers=AUTH)
    theta0 = st.fragment(1)
    d = deltas_for(st, 1, seed=2)
    r = await client.post("/v1/fragments/1/outer-gradient",
                          data=body(st, 1, d, learner="a", sid="a-last", c_tokens=512), headers=AUTH)
    assert r.status == 202
    assert st.versions == [0, 0] and list(st.pending[1]) == ["a-last"], "one of a quorum of 2: waiting"

    await client.close()  # the path of SIGTERM: Syncer.stop, then the final checkpoint
    state = json.loads((tmp_path / "checkpoint" / "state.json").read_text())
    assert state["versions"] == {"0": 0, "1": 1} and list(state["merged_ids"]) == ["a-last"]
    assert _spooled(tmp_path) == [], "merged and checkpointed: nothing left to replay"
    resumed = SyncerState(cfg, tmp_path)
    assert resumed.pending == [{}, {}] and resumed.tokens_merged == 512
    for n in resumed.plan[1]:
        want = first_outer_step(theta0[n], d[n], cfg.outer.lr, cfg.outer.momentum)
        torch.testing.assert_close(resumed.theta[n], want, rtol=1e-5, atol=1e-6)


async def test_a_rider_acknowledged_before_a_crash_still_waits_for_its_fragments_next_merge(aiohttp_client, tmp_path):
    cfg = tiny_config(quorum=1)
    live, crashed = tmp_path / "live", tmp_path / "crashed"
    syncer, client, st = await serve(aiohttp_client, live, cfg)
    r = await client.post("/v1/fragments/0/outer-gradient",
                          data=body(st, 0, deltas_for(st, 0, seed=1), sid="resent", rider=True), headers=AUTH)
    assert r.status == 202 and st.versions == [0, 0]
    shutil.copytree(live, crashed)  # a kill -9 now
    replayed = SyncerState(cfg, crashed)
    (c,) = replayed.pending[0].values()
    assert c.submission_id == "resent" and c.rides, "replayed as a resend"
    assert replayed.decide(0, 30.0) > 0, "it still waits for the fragment's next merge (nobody seen yet)"
    replayed.seen("learner-b")  # another learner alive: the next merge will come
    assert replayed.decide(0, 30.0) > 0
    again = make_syncer(crashed, cfg)
    client2 = await start(aiohttp_client, again)
    r = await client2.post("/v1/fragments/0/outer-gradient",
                           data=body(again.state, 0, deltas_for(st, 0, seed=2), learner="learner-b", sid="live"),
                           headers=AUTH)
    assert r.status == 202
    await wait_for_async(lambda: again.state.versions[0] == 1)
    assert again.state.contributions_merged == 2 and again.state.tokens_merged == 2048


async def test_checkpoints_and_spool_hold_only_safetensors_and_json(aiohttp_client, tmp_path):
    syncer = make_syncer(tmp_path, tiny_config(quorum=1))
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    await client.post("/v1/fragments/0/outer-gradient", data=body(st, 0, deltas_for(st, 0, seed=1)), headers=AUTH)
    await wait_for_async(lambda: st.versions[0] == 1)
    await client.post("/v1/register", json=register_body("a"), headers=AUTH)
    await client.post("/v1/register", json=register_body("b"), headers=AUTH)
    await syncer.checkpoint()
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert "checkpoint/theta.safetensors" in files and "checkpoint/momentum.safetensors" in files
    assert "checkpoint/state.json" in files
    for rel in files:
        path = tmp_path / rel
        if rel.endswith(".safetensors"):
            with safe_open(str(path), "pt") as f:  # parses as safetensors, nothing else
                assert list(f.keys())
        elif rel.endswith(".jsonl"):  # the merge journal: one JSON document a line
            assert all(json.loads(line) for line in path.read_text().splitlines())
        else:
            assert rel.endswith(".json"), rel
            json.loads(path.read_text())
        assert not path.read_bytes().startswith(b"\x80"), f"{rel} looks like a pickle"
    with safe_open(str(tmp_path / "checkpoint" / "momentum.safetensors"), "pt") as f:
        assert set(f.keys()) == set(st.plan[0])  # momentum exists only for merged fragments


def test_a_checkpoint_written_for_another_model_is_refused(tmp_path):
    syncer = make_syncer(tmp_path)
    syncer.state.write(syncer.state.checkpoint_job())
    other = tiny_config()
    other.model = MODEL_PRESETS["tiny"].model_copy(update={"d_model": 32})
    with pytest.raises(ValueError, match="different model"):
        SyncerState(other, tmp_path)
    with pytest.raises(ValueError, match="fragments"):
        SyncerState(tiny_config(fragments=3), tmp_path)


def test_a_crash_between_checkpoint_renames_falls_back_to_the_previous_checkpoint(tmp_path):
    syncer = make_syncer(tmp_path)
    syncer.state.write(syncer.state.checkpoint_job())
    (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.old")  # as if killed between the two renames
    (tmp_path / "checkpoint.tmp").mkdir()  # and a half-written new one
    resumed = SyncerState(tiny_config(), tmp_path)
    assert resumed.versions == [0, 0]
    assert all(torch.equal(resumed.theta[n], syncer.state.theta[n]) for n in resumed.theta)


async def test_merged_ids_past_the_idempotency_window_are_forgotten_and_a_late_retry_is_never_merged_twice(
        aiohttp_client, tmp_path):
    cfg = tiny_config(quorum=1, versions_kept=2)
    syncer = make_syncer(tmp_path, cfg)
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    payloads = {}
    for i in range(4):  # s0..s3 on fragment 0, each based on the current version: versions 1..4
        payloads[f"s{i}"] = body(st, 0, deltas_for(st, 0, seed=i), sid=f"s{i}", base=st.versions[0], c_tokens=100)
        assert (await client.post("/v1/fragments/0/outer-gradient", data=payloads[f"s{i}"], headers=AUTH)).status == 202
        await wait_for_async(lambda: st.versions[0] == i + 1)
        if i == 0:
            (s0_file,) = _spooled(tmp_path)
            shutil.copy(tmp_path / "spool" / s0_file, tmp_path / "s0-copy")
    assert set(st.merged_ids) == {"s0", "s1", "s2", "s3"}
    await syncer.checkpoint()
    # Bases 0 and 1 are below 4 - versions_kept: s0 and s1 are forgotten once a checkpoint covers them.
    assert set(st.merged_ids) == {"s2", "s3"}
    await syncer.checkpoint()
    state = json.loads((tmp_path / "checkpoint" / "state.json").read_text())
    assert state["merged_ids"] == {"s2": [0, 2], "s3": [0, 3]}
    before = snapshot(st)
    late = await client.post("/v1/fragments/0/outer-gradient", data=payloads["s0"], headers=AUTH)
    assert late.status == 409, "refused as stale, not merged again"
    assert_unchanged(before, snapshot(st))
    recent = await client.post("/v1/fragments/0/outer-gradient", data=payloads["s3"], headers=AUTH)
    assert recent.status == 202 and (await recent.json())["duplicate"] is True
    await client.close()

    # A spool file of a forgotten id left behind (its deletion lost in a crash) is recognised and never replayed.
    shutil.copy(tmp_path / "s0-copy", tmp_path / "spool" / s0_file)
    resumed = SyncerState(cfg, tmp_path)
    assert resumed.pending == [{}, {}] and _spooled(tmp_path) == []
    assert resumed.tokens_merged == 400 and resumed.versions[0] == 4


async def test_a_stop_during_a_periodic_checkpoint_writes_its_final_one_only_after_that_write_is_done(tmp_path):
    """stop() cancels the checkpoint loop mid-write; the write's thread runs on, so the final checkpoint must wait for
    it: two writes of checkpoint.tmp at once left the final one failing (FileNotFoundError) on a SIGTERM."""
    syncer = make_syncer(tmp_path, checkpoint_every_s=0.01)
    real_write, spans, started = syncer.state.write, [], threading.Event()

    def timed_write(job):  # a slow disk: the periodic write is still running when the stop comes
        t0 = time.monotonic()
        started.set()
        time.sleep(0.5 if len(spans) == 0 else 0.0)
        real_write(job)
        spans.append((t0, time.monotonic()))

    syncer.state.write = timed_write
    syncer.state.dirty = True
    await syncer.start()
    assert await asyncio.to_thread(started.wait, 30), "the periodic checkpoint never started"
    await syncer.stop()  # cancels the loop mid-write, then writes the final checkpoint
    assert len(spans) == 2, spans
    (_, first_end), (second_start, _) = sorted(spans)
    assert second_start >= first_end, "the final checkpoint was written while the interrupted one still was"
    saved = json.loads((tmp_path / "checkpoint" / "state.json").read_text())["versions"]
    assert [saved[str(p)] for p in range(len(saved))] == syncer.state.versions
