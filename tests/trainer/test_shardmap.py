"""The fragment -> syncer shard map: deterministic, balanced, every fragment owned exactly once."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from diloco_trainer.config import TrainConfig
from diloco_trainer.protocol.shardmap import owned_fragments, shard_map, shard_of, shard_sizes, split_syncer_urls


@given(st.integers(1, 200).flatmap(lambda p: st.tuples(st.just(p), st.integers(1, p))))
def test_every_fragment_is_owned_by_exactly_one_shard_and_counts_differ_by_at_most_one(pn):
    p, n = pn
    owned = [owned_fragments(i, p, n) for i in range(n)]
    assert sorted(f for frags in owned for f in frags) == list(range(p))
    assert max(map(len, owned)) - min(map(len, owned)) <= 1
    assert all(shard_of(f, p, n) == i for i, frags in enumerate(owned) for f in frags)
    assert shard_map(p, n) == [shard_of(f, p, n) for f in range(p)]


def test_the_map_is_round_robin_and_the_same_for_the_same_config():
    assert shard_map(8, 3) == [0, 1, 2, 0, 1, 2, 0, 1]
    assert owned_fragments(1, 8, 3) == [1, 4, 7]
    cfg = TrainConfig.model_validate({"outer": {"fragments": 8}, "syncer": {"shards": 3}})
    again = TrainConfig.model_validate(cfg.model_dump(mode="json"))
    assert shard_map(cfg.outer.fragments, cfg.syncer.shards) == shard_map(again.outer.fragments, again.syncer.shards)


def test_one_shard_owns_every_fragment():
    assert owned_fragments(0, 5, 1) == [0, 1, 2, 3, 4]


def test_shard_sizes_sum_the_fragments_each_shard_owns():
    assert shard_sizes([10, 20, 30, 40], 2) == [40, 60]


@pytest.mark.parametrize("p,n,shard", [(4, 5, 0), (4, 0, 0), (4, 2, 2), (4, 2, -1)])
def test_out_of_range_shards_are_refused(p, n, shard):
    with pytest.raises(ValueError):
        owned_fragments(shard, p, n)


def test_config_refuses_more_shards_than_fragments():
    with pytest.raises(ValueError, match="syncer.shards"):
        TrainConfig.model_validate({"outer": {"fragments": 2}, "syncer": {"shards": 3}})
    assert TrainConfig().syncer.shards == 1


def test_syncer_urls_split_in_order_and_bad_ones_are_refused():
    assert split_syncer_urls("http://a:1, https://b:2/") == ["http://a:1", "https://b:2"]
    for bad in ("", "http://a:1,ftp://b", "http://a:1,http://a:1"):
        with pytest.raises(ValueError):
            split_syncer_urls(bad)
