"""Memory-mapped token shards: windows inside one file, disjoint deterministic shards per learner unit, a position
that resumes exactly, a held-out tail per file, and clear errors for bad inputs."""

import json

import numpy as np
import pytest
import torch

from diloco_trainer.config import DataConfig
from diloco_trainer.data.manifest import Manifest, ShardEntry, write_manifest
from diloco_trainer.data.shards import TokenShards, permute
from diloco_trainer.data.source import open_tokens


def write_positions(folder, lengths, dtype=np.uint32, suffix=".npy"):
    """Files whose tokens are their global position (file i starts where file i-1 ended): a token names its place."""
    folder.mkdir(parents=True, exist_ok=True)
    start = 0
    for i, n in enumerate(lengths):
        tokens = np.arange(start, start + n, dtype=dtype)
        if suffix == ".npy":
            np.save(folder / f"part-{i:03d}.npy", tokens)
        else:
            tokens.astype(np.dtype(dtype).newbyteorder("<")).tofile(folder / f"part-{i:03d}.bin")
        start += n
    return folder


def cfg_for(folder, **kw):
    return DataConfig(source="shards", path=str(folder), **{"val_fraction": 0.1, **kw})


def epoch_windows(sampler):
    """Every first token of the windows one epoch serves (batch size 1)."""
    epoch, firsts = sampler.epoch, []
    while sampler.epoch == epoch:
        x, y = sampler.next_batch()
        assert torch.equal(x[0, 1:], y[0, :-1])
        firsts.append(x[0])
    return firsts


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4097])
def test_the_epoch_order_is_a_permutation_of_every_window(n):
    order = permute(np.arange(n), n, key=5)
    assert sorted(order.tolist()) == list(range(n))
    assert n < 17 or order.tolist() != list(range(n)), "shuffled"
    assert order.tolist() == permute(np.arange(n), n, key=5).tolist()


def test_windows_never_cross_a_file_and_every_unit_reads_only_its_own_contiguous_shard(tmp_path):
    lengths = [3000, 500, 4100, 2000]
    shards = TokenShards.open(cfg_for(write_positions(tmp_path / "d", lengths)))
    ends = np.cumsum(lengths)
    train_ends = [e - n + (n - int(n * 0.1)) for e, n in zip(ends, lengths)]
    seen = []
    for unit in range(3):
        sampler = shards.sampler(unit, 3, batch_size=1, seq_len=32, seed=4)
        firsts = epoch_windows(sampler)
        for w in firsts:
            f = int(np.searchsorted(ends, int(w[0]), side="right"))
            assert int(w[-1]) + 1 < train_ends[f] + 1, "a window stays inside one file's training part"
            assert torch.equal(w, torch.arange(int(w[0]), int(w[0]) + 32)), "contiguous tokens of one file"
        starts = [int(w[0]) for w in firsts]
        assert len(starts) == len(set(starts)) > 50
        seen.append(set(range(min(starts), max(starts) + 32)))
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2]), "units read disjoint token ranges"


def test_the_same_seed_gives_the_same_batches_and_another_seed_another_order(tmp_path):
    shards = TokenShards.open(cfg_for(write_positions(tmp_path / "d", [5000, 5000])))
    a, b = shards.sampler(1, 2, 8, 16, seed=1), shards.sampler(1, 2, 8, 16, seed=1)
    for _ in range(5):
        assert torch.equal(a.next_batch()[0], b.next_batch()[0])
    assert not torch.equal(shards.sampler(1, 2, 8, 16, seed=2).next_batch()[0], a.next_batch()[0])


def test_a_restarted_sampler_resumes_from_its_saved_position_across_an_epoch_rollover(tmp_path):
    folder = write_positions(tmp_path / "d", [4000, 3000, 2500], dtype=np.uint16, suffix=".bin")
    first = TokenShards.open(cfg_for(folder, dtype="uint16")).sampler(0, 2, 16, 32, seed=7)
    for _ in range(30):
        first.next_batch()
    saved = json.loads(json.dumps(first.state_dict()))
    assert saved["epoch"] >= 2 and saved["tokens"] == sum(n - int(n * 0.1) for n in (4000, 3000, 2500))
    expected = [first.next_batch() for _ in range(5)]
    restarted = TokenShards.open(cfg_for(folder, dtype="uint16")).sampler(0, 2, 16, 32, seed=7)
    restarted.load_state_dict(saved)
    for (ex, ey), (rx, ry) in zip(expected, (restarted.next_batch() for _ in range(5))):
        assert torch.equal(ex, rx) and torch.equal(ey, ry)
    with pytest.raises(ValueError, match="shard 0 of 2"):
        TokenShards.open(cfg_for(folder, dtype="uint16")).sampler(1, 2, 16, 32).load_state_dict(saved)


def test_a_position_saved_on_another_data_set_is_refused(tmp_path):
    folder = write_positions(tmp_path / "d", [4000, 3000])
    saved = TokenShards.open(cfg_for(folder)).sampler(0, 1, 4, 16).state_dict()
    write_positions(tmp_path / "d", [4000, 3000, 3000])
    with pytest.raises(ValueError, match="training tokens"):
        TokenShards.open(cfg_for(folder)).sampler(0, 1, 4, 16).load_state_dict(saved)


def test_the_last_val_fraction_of_every_file_is_held_out(tmp_path):
    shards = TokenShards.open(cfg_for(write_positions(tmp_path / "d", [1000, 2000]), val_fraction=0.2))
    val = shards.sample("val", 10_000)
    assert val.tolist() == list(range(800, 1000)) + list(range(2600, 3000))
    train = shards.sample("train", 10_000)
    assert not set(train.tolist()) & set(val.tolist()) and len(train) == 2400
    assert len(shards.sample("train", 240)) == 240, "a sample is bounded"


def test_files_are_memory_mapped_not_read(tmp_path):
    shards = TokenShards.open(cfg_for(write_positions(tmp_path / "d", [5000, 5000])))
    shards.sampler(0, 1, 4, 16).next_batch()
    assert all(isinstance(f.tokens(), np.memmap) for f in shards.files)


def test_a_manifest_gives_the_type_and_order_and_its_vocabulary_must_fit_the_model(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    for name, n in (("b.bin", 3000), ("a.bin", 2000)):
        np.full(n, 7, dtype="<u4").tofile(folder / name)
    manifest = Manifest(tokenizer="t.json", tokenizer_fingerprint="sha256:x", vocab_size=70_000, dtype="uint32",
                        text_field="text", shard_tokens=3000, inputs=[],
                        shards=[ShardEntry(file="b.bin", tokens=3000, documents=1),
                                ShardEntry(file="a.bin", tokens=2000, documents=1)])
    write_manifest(folder, manifest)
    shards = open_tokens(cfg_for(folder), vocab_size=70_000)
    assert [f.path.name for f in shards.files] == ["b.bin", "a.bin"] and shards.vocab_needed == 70_000
    with pytest.raises(ValueError, match=r"70000 tokens, more than model.vocab_size \(256\)"):
        open_tokens(cfg_for(folder), vocab_size=256)
    with pytest.raises(ValueError, match="data.dtype is 'uint16' but the manifest"):
        TokenShards.open(cfg_for(folder, dtype="uint16"))


def test_without_a_manifest_a_token_beyond_the_model_vocabulary_stops_the_batch(tmp_path):
    folder = write_positions(tmp_path / "d", [3000, 3000])
    sampler = open_tokens(cfg_for(folder), vocab_size=256).sampler(0, 1, 8, 16)
    with pytest.raises(ValueError, match=r"token id \d+, outside model.vocab_size \(256\)"):
        sampler.next_batch()


@pytest.mark.parametrize("make,match", [
    (lambda d: None, "neither a directory"),
    (lambda d: d.mkdir(), "holds no .bin or .npy"),
    (lambda d: (d.mkdir(), np.arange(100, dtype="<u2").tofile(d / "a.bin")), "data.dtype is required"),
    (lambda d: (d.mkdir(), np.arange(101, dtype="<u2").tofile(d / "a.bin")), "not a whole number of uint32"),
    (lambda d: (d.mkdir(), np.save(d / "a.npy", np.arange(100, dtype=np.int64))), "expected a 1-D uint8"),
    (lambda d: (d.mkdir(), (d / "manifest.json").write_text("{")), "not a valid token-shard manifest"),
])
def test_bad_shard_inputs_are_clear_errors(tmp_path, make, match):
    folder = tmp_path / "d"
    make(folder)
    with pytest.raises(ValueError, match=match):
        TokenShards.open(cfg_for(folder, dtype="uint32") if "whole number" in match else cfg_for(folder))


def test_a_glob_selects_files_and_a_shard_too_small_for_a_window_is_a_clear_error(tmp_path):
    folder = write_positions(tmp_path / "d", [2000, 2000, 50])
    shards = TokenShards.open(cfg_for(str(folder / "part-00[01].npy")))
    assert len(shards.files) == 2
    with pytest.raises(ValueError, match="too few"):
        TokenShards.open(cfg_for(str(folder / "part-002.npy"))).sampler(0, 1, 2, 64)
    with pytest.raises(ValueError, match="max_bytes"):
        DataConfig(source="shards", path="x", max_bytes=4096)


def test_shards_are_not_preloaded_nor_loaded_as_a_corpus(tmp_path):
    from diloco_trainer.data.corpus import load_corpus, preload

    cfg = cfg_for(write_positions(tmp_path / "d", [3000, 3000]))
    assert preload(cfg) is None, "a warm spare has nothing to preload: the files are mapped when read"
    with pytest.raises(ValueError, match="memory-mapped, not loaded"):
        load_corpus(cfg)


def _manifest_naming(folder, *files, tokens=2000):
    write_manifest(folder, Manifest(tokenizer="bytes", tokenizer_fingerprint="bytes", vocab_size=256, dtype="uint32",
                                    text_field="text", shard_tokens=tokens, inputs=[],
                                    shards=[ShardEntry(file=f, tokens=tokens, documents=1) for f in files]))


@pytest.mark.parametrize("entry", ["../outside.bin", "ABSOLUTE", "sub/../../outside.bin", "link.bin",
                                   "linkdir/outside.bin"])
def test_a_manifest_naming_a_file_outside_its_directory_is_refused_naming_the_entry_and_the_manifest(tmp_path,
                                                                                                     entry):
    """Issue 38 (11): whoever writes a shard directory must not make a learner read (and train on, i.e. leak into the
    model) files outside it: `..`, absolute paths and symlinks leading out are refused, before anything is opened."""
    outside = tmp_path / "outside.bin"
    np.full(2000, 7, dtype="<u4").tofile(outside)
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "link.bin").symlink_to(outside)
    (folder / "linkdir").symlink_to(tmp_path)
    entry = str(outside) if entry == "ABSOLUTE" else entry
    _manifest_naming(folder, entry)
    with pytest.raises(ValueError) as err:
        TokenShards.open(cfg_for(folder))
    assert entry in str(err.value) and str(folder / "manifest.json") in str(err.value)
    assert "outside" in str(err.value)


def test_a_manifest_may_name_files_in_subfolders_and_symlinks_that_stay_inside(tmp_path):
    folder = tmp_path / "d"
    (folder / "sub" / "deeper").mkdir(parents=True)
    np.full(2000, 7, dtype="<u4").tofile(folder / "sub" / "deeper" / "a.bin")
    np.full(2000, 8, dtype="<u4").tofile(folder / "b.bin")
    (folder / "c.bin").symlink_to(folder / "sub" / "deeper" / "a.bin")
    _manifest_naming(folder, "sub/deeper/a.bin", "b.bin", "./c.bin")
    shards = TokenShards.open(cfg_for(folder))
    assert [f.path.name for f in shards.files] == ["a.bin", "b.bin", "c.bin"] and shards.train_tokens == 3 * 1800
