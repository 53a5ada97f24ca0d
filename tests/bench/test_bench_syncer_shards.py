"""Smoke test of the syncer-shards benchmark in its tiny mode: real shard processes merge what one driver sends, and
the result holds each shard count's throughput as a ratio to one shard measured in the same run, a table and a PNG."""

import json

import pytest

from diloco_bench import report, syncer_shards

pytestmark = pytest.mark.slow  # real syncer shard processes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_syncer_shards_tiny_measures_merges_at_1_and_2_shards_against_one_shard_in_the_same_run(tmp_path):
    ctx = report.Context(mode="tiny", out_dir=tmp_path)
    data = json.loads(report.finish(syncer_shards.run(ctx), tmp_path).read_text())
    rows = data["figures"]["by_shards"]
    assert [r["shards"] for r in rows] == [1, 2]
    assert all(r["contributions"] > 0 and r["errors"] == 0 for r in rows), rows
    assert rows[0]["speedup"] == 1.0 and rows[1]["speedup"] == rows[1]["contributions_per_s"] / rows[0][
        "contributions_per_s"]
    assert data["table"]["rows"] and all(len(r) == len(data["table"]["columns"]) for r in data["table"]["rows"])
    assert (tmp_path / "syncer_shards.png").read_bytes()[:8] == PNG_MAGIC
