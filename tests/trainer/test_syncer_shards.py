"""A syncer shard (`diloco syncer --shard i`) through its HTTP app: it holds, serves, merges and persists only the
fragments it owns; a request for another shard's fragment gets 421 naming the owner and changes nothing."""

import pytest

from diloco_trainer.config import TrainConfig
from diloco_trainer.syncer.state import SyncerState
from diloco_trainer.protocol.wire import decode_tensors
from diloco_trainer.syncer.app import Syncer, SyncerOptions
from polling import wait_for_async
from syncer_kit import AUTH, TOKEN, assert_unchanged, body, deltas_for, register_body, snapshot, start, tiny_config


def sharded_config(shards: int = 2, fragments: int = 4) -> TrainConfig:
    cfg = tiny_config(fragments=fragments)
    return cfg.model_copy(update={"syncer": cfg.syncer.model_copy(update={"shards": shards})})


def shard_syncer(state_dir, shard: int, shards: int = 2) -> Syncer:
    state = SyncerState(sharded_config(shards), state_dir, shard=shard)
    return Syncer(state, SyncerOptions(token=TOKEN, checkpoint_every_s=3600.0))


async def test_a_shard_holds_and_serves_only_its_own_fragments(aiohttp_client, tmp_path):
    syncer = shard_syncer(tmp_path, shard=1)
    st = syncer.state
    assert st.owned == [1, 3]
    assert set(st.theta) == {n for p in (1, 3) for n in st.plan[p]}, "a shard holds another shard's parameters"
    client = await start(aiohttp_client, syncer)
    reg = await (await client.post("/v1/register", json=register_body("learner-a"), headers=AUTH)).json()
    assert (reg["shard"], reg["shards"], reg["owned"]) == (1, 2, [1, 3])
    assert reg["versions"] == {"1": 0, "3": 0} and len(reg["plan"]) == 4, "the plan is the whole run's"
    tensors, meta = decode_tensors(await (await client.get("/v1/state", headers=AUTH)).read())
    assert set(tensors) == set(st.theta)
    status = await (await client.get("/v1/status", headers=AUTH)).json()
    assert (status["shard"], status["shards"], status["owned"]) == (1, 2, [1, 3])
    assert set(status["pending"]) == {"1", "3"}
    metrics = (await (await client.get("/metrics")).read()).decode()
    assert 'diloco_syncer_shard{shard="1",shards="2"} 1.0' in metrics
    assert "diloco_syncer_owned_fragments 2.0" in metrics


@pytest.mark.parametrize("method,path", [("POST", "/v1/fragments/0/outer-gradient"), ("GET", "/v1/fragments/2")])
async def test_a_fragment_of_another_shard_is_refused_with_421_naming_its_owner_and_nothing_changes(
        aiohttp_client, tmp_path, method, path):
    """Fragments 0 and 2 belong to shard 0 of 2; this is shard 1."""
    syncer = shard_syncer(tmp_path, shard=1)
    st = syncer.state
    client = await start(aiohttp_client, syncer)
    before = snapshot(st)
    # A well-formed submission for fragment 0 (owned by shard 0), built from a shard-0 state of the same run.
    other = SyncerState(sharded_config(), tmp_path / "other", shard=0)
    data = body(other, 0, deltas_for(other, 0, seed=1)) if method == "POST" else None
    r = await client.request(method, path, data=data, headers=AUTH)
    assert r.status == 421
    reason = (await r.json())["error"]
    assert "owned by syncer shard 0 of 2" in reason and "this is shard 1" in reason
    assert_unchanged(before, snapshot(st))


async def test_a_shard_merges_its_fragments_and_its_checkpoint_resumes_only_as_the_same_shard(aiohttp_client,
                                                                                              tmp_path):
    syncer = shard_syncer(tmp_path, shard=1)
    st = syncer.state
    client = await start(aiohttp_client, syncer)
    r = await client.post("/v1/fragments/3/outer-gradient", data=body(st, 3, deltas_for(st, 3, seed=2)), headers=AUTH)
    assert r.status == 202
    await wait_for_async(lambda: st.versions[3] == 1, what="the merge of fragment 3")
    await client.close()  # final checkpoint
    resumed = SyncerState(sharded_config(), tmp_path, shard=1)
    assert resumed.versions[3] == 1 and resumed.versions[1] == 0
    with pytest.raises(ValueError, match="belongs to shard 1 of 2"):
        SyncerState(sharded_config(), tmp_path, shard=0)
    with pytest.raises(ValueError, match="belongs to shard 1 of 2"):
        SyncerState(sharded_config(shards=1), tmp_path)
