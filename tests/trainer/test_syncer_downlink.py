"""The syncer's quantized down-link through aiohttp's test client: which answer a base gets (one update, a chain,
or the full fragment), bad queries, the metrics, and what a restart keeps."""

import pytest
import torch

from diloco_trainer.protocol.downlink import decode_answer, fragment_digest, reconstruct
from diloco_trainer.syncer.state import SyncerState
from diloco_trainer.syncer.store import read_checkpoint
from diloco_trainer.protocol.wire import WireError
from polling import wait_for_async
from syncer_kit import AUTH, body, deltas_for, make_syncer, snapshot, assert_unchanged, start, tiny_config


async def _merge(client, st, p: int, seed: int) -> int:
    """One acknowledged outer gradient on the current version of fragment p; waits for its merge."""
    before = st.versions[p]
    r = await client.post(f"/v1/fragments/{p}/outer-gradient", headers=AUTH,
                          data=body(st, p, deltas_for(st, p, seed), sid=f"s{seed}", base=before))
    assert r.status == 202, await r.text()
    await wait_for_async(lambda: st.versions[p] > before, what=f"a merge of fragment {p}")
    return st.versions[p]


async def _get(client, p: int, query: str = ""):
    r = await client.get(f"/v1/fragments/{p}{query}", headers=AUTH)
    return r.status, (await r.read())


def _metric(syncer, name: str, kind: str) -> float:
    return syncer.metrics.registry.get_sample_value(f"diloco_syncer_downlink_{name}_total", {"kind": kind}) or 0.0


async def test_each_base_gets_one_update_a_chain_or_the_full_fragment_and_all_rebuild_the_syncers_values(
        aiohttp_client, tmp_path):
    syncer = make_syncer(tmp_path, tiny_config(downlink="int4", versions_kept=3, block_size=16))
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    held = {0: {n: t for n, t in st.fragment(0).items()}}
    for seed in range(1, 6):
        v = await _merge(client, st, 0, seed)
        held[v] = st.fragment(0)
    assert v == 5
    want = fragment_digest(st.fragment(0))

    status, one = await _get(client, 0, "?after=4&base=4")
    a = decode_answer(one)
    assert status == 200 and a.encoding == "delta" and a.base == 4 and a.version == 5 and len(a.steps) == 1
    assert fragment_digest(reconstruct(held[4], a)) == want

    status, chain = await _get(client, 0, "?after=2&base=2")
    a = decode_answer(chain)
    assert a.encoding == "delta" and len(a.steps) == 3 and len(chain) > len(one)
    rebuilt = reconstruct(held[2], a)
    assert all(torch.equal(rebuilt[n], st.theta[n]) for n in rebuilt)

    for base in ("1", "0", "77"):  # update 2 is no longer kept; 77 was never published
        status, full = await _get(client, 0, f"?base={base}")
        a = decode_answer(full)
        assert status == 200 and a.encoding == "full" and a.version == 5
        assert all(torch.equal(a.tensors[n], st.theta[n]) for n in a.tensors)

    status, same = await _get(client, 0, "?base=5")  # nothing newer: no update, only the digest to check against
    a = decode_answer(same)
    assert a.encoding == "delta" and a.steps == [] and reconstruct(held[5], a) == held[5]
    assert (await _get(client, 0, "?after=5&base=5"))[0] == 304
    assert _metric(syncer, "answers", "delta") == 2 and _metric(syncer, "answers", "chain") == 1
    assert _metric(syncer, "answers", "full") == 3
    assert _metric(syncer, "bytes", "chain") == len(chain) and _metric(syncer, "bytes", "full") == 3 * len(full)
    assert len(one) < 0.2 * len(full)


async def test_a_chain_larger_than_the_fragment_is_answered_with_the_fragment(aiohttp_client, tmp_path):
    syncer = make_syncer(tmp_path, tiny_config(downlink="int8", versions_kept=8))
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    for seed in range(1, 6):
        await _merge(client, st, 1, seed)
    # int8 updates are a bit over 1 byte per value: three of them are smaller than fp32, four are not.
    assert decode_answer((await _get(client, 1, "?base=2"))[1]).encoding == "delta"
    assert decode_answer((await _get(client, 1, "?base=1"))[1]).encoding == "full"


@pytest.mark.parametrize("query, reason", [("?base=x", "base"), ("?base=-1", "base"), ("?base=1.5", "base"),
                                           ("?base=99999999999999999999", "base"), ("?base=0&dtype=bf16", "base"),
                                           ("?base=0&dtype=int4", "dtype")])
async def test_a_malformed_base_is_a_400_naming_it_and_changes_nothing(aiohttp_client, tmp_path, query, reason):
    syncer = make_syncer(tmp_path, tiny_config(downlink="int4"))
    client = await start(aiohttp_client, syncer)
    before = snapshot(syncer.state)
    r = await client.get(f"/v1/fragments/0{query}", headers=AUTH)
    assert r.status == 400 and reason in (await r.json())["error"]
    assert_unchanged(before, snapshot(syncer.state))


async def test_without_a_quantized_downlink_a_base_gets_the_full_fragment(aiohttp_client, tmp_path):
    syncer = make_syncer(tmp_path, tiny_config(downlink="fp32"))
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    await _merge(client, st, 0, 1)
    a = decode_answer((await _get(client, 0, "?after=0&base=0"))[1])
    assert a.encoding == "full" and all(torch.equal(a.tensors[n], st.theta[n]) for n in a.tensors)


async def test_after_a_restart_a_learner_rebuilds_the_syncers_values_or_is_told_to_fetch_them_whole(
        aiohttp_client, tmp_path):
    cfg = tiny_config(downlink="int4", block_size=16)
    syncer = make_syncer(tmp_path, cfg)
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    await _merge(client, st, 0, 1)
    await syncer.checkpoint()
    held = {1: st.fragment(0)}
    residual = {n: t.clone() for n, t in st.residual[0].items()}
    assert residual and any(bool(t.abs().sum() > 0) for t in residual.values())
    saved = read_checkpoint(tmp_path).residual
    assert all(torch.equal(saved[n], residual[n]) for n in residual)  # the residual is checkpointed with Θ
    await _merge(client, st, 0, 2)  # version 2: published, acknowledged work, not in the checkpoint
    held[2] = st.fragment(0)

    resumed = make_syncer(tmp_path, cfg)  # what a crash now leaves: the checkpoint, the spool (and journal)
    rst = resumed.state
    client2 = await start(aiohttp_client, resumed)
    await wait_for_async(lambda: rst.versions[0] >= 2 and not rst.pending[0], what="the acknowledged work merged again")
    a = decode_answer((await _get(client2, 0, "?base=1"))[1])  # a learner holding the checkpointed version
    assert a.encoding == "delta" and a.base == 1
    rebuilt = reconstruct(held[1], a)
    assert all(torch.equal(rebuilt[n], rst.theta[n]) for n in rebuilt)
    # A learner holding version 2 of the crashed incarnation gets the full fragment or updates checked against the
    # digest of the syncer's values: it never ends up with anything else.
    a = decode_answer((await _get(client2, 0, "?base=2"))[1])
    if a.encoding == "full":
        rebuilt = a.tensors
    else:
        try:
            rebuilt = reconstruct(held[2], a)
        except WireError:
            rebuilt = decode_answer((await _get(client2, 0))[1]).tensors
    assert all(torch.equal(rebuilt[n], rst.theta[n]) for n in rebuilt)


def test_a_checkpoint_written_before_the_downlink_existed_loads_with_a_zero_residual(tmp_path):
    SyncerState(tiny_config(downlink="fp32"), tmp_path).write(SyncerState(tiny_config(), tmp_path).checkpoint_job())
    st = SyncerState(tiny_config(downlink="int4"), tmp_path)
    assert st.residual == [{}, {}] and not (tmp_path / "checkpoint" / "downlink-residual.safetensors").exists()
