"""Byte tokenizer, corpora split by file, resumable per-learner shards, evaluation and the unigram baseline."""

import json
import math

import numpy as np
import pytest
import torch

from diloco_trainer.config import DataConfig, MODEL_PRESETS
from diloco_trainer.data.corpus import (
    DOC_SEPARATOR,
    ShardSampler,
    decode,
    encode,
    evaluate,
    list_stdlib_files,
    load_corpus,
    shard_bounds,
    split_files,
    unigram_loss,
)
from diloco_trainer.learner.devices import select_device, sync
from diloco_trainer.model.gpt import build_model


def test_byte_tokenizer_round_trips_unicode_text():
    text = "def f(x):\n    return 'héllo ✓'\n"
    tokens = encode(text)
    assert tokens.dtype == torch.uint8 and len(tokens) == len(text.encode())
    assert decode(tokens) == text


def test_decode_rejects_ids_outside_the_byte_vocabulary():
    with pytest.raises(ValueError, match="0..255"):
        decode([104, 300])


def test_stdlib_corpus_holds_standard_library_sources_without_tests_or_site_packages():
    files = [str(p) for p in list_stdlib_files()]
    assert any(f.endswith("/argparse.py") for f in files)
    assert not any("/site-packages/" in f or "/test/" in f for f in files)
    assert files == sorted(files)


def test_split_by_file_is_deterministic_disjoint_and_near_the_fraction():
    sizes = [(f"pkg{i % 7}/mod{i}.py", 1000 + 37 * i) for i in range(300)]
    train, val = split_files(sizes, 0.1)
    assert (train, val) == split_files(list(reversed(sizes)), 0.1), "order of discovery must not matter"
    assert not set(train) & set(val) and set(train) | set(val) == {n for n, _ in sizes}
    by = dict(sizes)
    frac = sum(by[n] for n in val) / sum(by.values())
    assert 0.08 < frac < 0.12


def test_split_needs_two_files():
    with pytest.raises(ValueError, match="at least 2 files"):
        split_files([("only.py", 10)], 0.1)


def test_folder_corpus_splits_by_file_and_is_cached(tmp_path):
    folder = tmp_path / "texts"
    for i in range(20):
        (folder / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        (folder / f"d{i % 3}" / f"f{i}.txt").write_text(f"<file {i}>" + "lorem ipsum " * (50 + i))
    (folder / "blob.bin").write_bytes(b"\x00\x01\x02binary")  # skipped: not text
    cfg = DataConfig(source="folder", path=str(folder), val_fraction=0.2)
    cache = tmp_path / "cache"
    corpus = load_corpus(cfg, cache_dir=cache)
    assert len(corpus.train_files) + len(corpus.val_files) == 20 and corpus.val_files
    val_text, train_text = decode(corpus.val), decode(corpus.train)
    for rel in corpus.val_files:
        marker = "<" + rel.split("/")[-1].removesuffix(".txt").replace("f", "file ") + ">"
        assert marker in val_text and marker not in train_text, f"{rel} leaked into train"
    assert int((corpus.train == DOC_SEPARATOR).sum()) == len(corpus.train_files)
    cached = sorted(p.name for p in cache.iterdir())
    assert len(cached) == 2 and not any(n.endswith(".tmp") for n in cached)
    again = load_corpus(cfg, cache_dir=cache)
    assert torch.equal(again.train, corpus.train) and torch.equal(again.val, corpus.val)
    (folder / "d0" / "f0.txt").write_text("changed")  # a changed file must not reuse the stale cache
    assert not torch.equal(load_corpus(cfg, cache_dir=cache).train, corpus.train) or \
        not torch.equal(load_corpus(cfg, cache_dir=cache).val, corpus.val)


def test_max_bytes_caps_the_corpus(tmp_path):
    corpus = load_corpus(DataConfig(max_bytes=50_000, val_fraction=0.1), cache_dir=tmp_path)
    assert len(corpus.train) + len(corpus.val) == 50_000
    assert len(corpus.val) == 5_000


@pytest.mark.parametrize("suffix,dtype", [(".npy", np.uint16), (".npy", np.uint8), (".bin", np.uint16)])
def test_token_file_corpus_holds_out_the_tail(tmp_path, suffix, dtype):
    tokens = (np.arange(10_000) * 7919 % (1000 if dtype == np.uint16 else 256)).astype(dtype)
    path = tmp_path / f"tokens{suffix}"
    np.save(path, tokens) if suffix == ".npy" else tokens.astype("<u2").tofile(path)
    corpus = load_corpus(DataConfig(source="tokens", path=str(path), val_fraction=0.1))
    assert len(corpus.val) == 1000
    assert corpus.val.tolist() == tokens[-1000:].tolist() and corpus.train.tolist() == tokens[:-1000].tolist()
    assert corpus.vocab_needed == (1000 if dtype == np.uint16 else 256)


def test_token_file_with_pickled_objects_is_refused(tmp_path):
    path = tmp_path / "evil.npy"
    np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="evil.npy"):
        load_corpus(DataConfig(source="tokens", path=str(path)))


def test_shards_are_contiguous_and_cover_the_tokens():
    bounds = [shard_bounds(1003, i, 4) for i in range(4)]
    assert bounds[0][0] == 0 and bounds[-1][1] == 1003
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    with pytest.raises(ValueError, match="shard"):
        shard_bounds(1003, 4, 4)


def test_sampler_reads_only_its_own_shard():
    tokens = (torch.arange(40_000) // 10_000).to(torch.uint8)  # shard i holds only the value i
    for shard in range(4):
        sampler = ShardSampler(tokens, shard, 4, batch_size=8, seq_len=16, seed=3)
        for _ in range(5):
            x, y = sampler.next_batch()
            assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
            assert set(x.unique().tolist()) == {shard}


def test_targets_are_inputs_shifted_by_one():
    tokens = torch.arange(5000) % 251
    x, y = ShardSampler(tokens.to(torch.uint8), 0, 1, 4, 32, seed=0).next_batch()
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal((x + 1) % 251, y)


def test_a_restarted_sampler_resumes_with_the_same_next_batches():
    tokens = torch.randint(0, 256, (20_000,), dtype=torch.uint8)
    first = ShardSampler(tokens, 1, 3, batch_size=16, seq_len=32, seed=7)
    for _ in range(30):  # past one epoch (≈ 208 windows / 16 per batch): the epoch rollover is covered too
        first.next_batch()
    saved = json.loads(json.dumps(first.state_dict()))
    assert saved["epoch"] >= 2 and set(saved) == {"shard", "num_shards", "offset", "epoch"}
    expected = [first.next_batch() for _ in range(5)]
    restarted = ShardSampler(tokens, 1, 3, batch_size=16, seq_len=32, seed=7)
    restarted.load_state_dict(saved)
    for (ex, ey), (rx, ry) in zip(expected, (restarted.next_batch() for _ in range(5))):
        assert torch.equal(ex, rx) and torch.equal(ey, ry)
    fresh = ShardSampler(tokens, 1, 3, batch_size=16, seq_len=32, seed=7)
    assert not torch.equal(fresh.next_batch()[0], expected[0][0]), "resume must not restart the shard"


def test_an_epoch_serves_every_window_once_and_the_next_epoch_reshuffles():
    tokens = torch.arange(3300, dtype=torch.int32)
    sampler = ShardSampler(tokens, 0, 1, batch_size=1, seq_len=32, seed=0)
    epoch0 = []
    while sampler.epoch == 0:
        epoch0.append(int(sampler.next_batch()[0][0, 0]))
    assert len(epoch0) == len(set(epoch0)) and len(epoch0) >= 100
    epoch1 = [int(sampler.next_batch()[0][0, 0]) for _ in range(len(epoch0))]
    assert epoch1 != epoch0


def test_position_from_another_shard_layout_is_refused():
    sampler = ShardSampler(torch.zeros(10_000, dtype=torch.uint8), 0, 2, 4, 16)
    with pytest.raises(ValueError, match="shard 1 of 2"):
        sampler.load_state_dict({"shard": 1, "num_shards": 2, "offset": 0, "epoch": 0})
    with pytest.raises(ValueError, match="malformed"):
        sampler.load_state_dict({"shard": 0})


def test_a_shard_too_small_for_one_window_is_a_clear_error():
    with pytest.raises(ValueError, match="too few"):
        ShardSampler(torch.zeros(100, dtype=torch.uint8), 0, 4, 2, 64)


def test_unigram_loss_matches_entropy_and_punishes_mismatched_frequencies():
    train = torch.tensor([0] * 5000 + [1] * 5000, dtype=torch.uint8)
    near_two_symbols = unigram_loss(train, torch.tensor([0, 1] * 100, dtype=torch.uint8))
    assert near_two_symbols == pytest.approx(math.log(2), abs=0.03)  # add-one smoothing costs a little
    assert unigram_loss(train, torch.tensor([7] * 50, dtype=torch.uint8)) > 8.0  # unseen byte: ~log(10256)


def test_unigram_loss_of_the_stdlib_corpus_is_a_few_nats(tmp_path):
    corpus = load_corpus(DataConfig(max_bytes=400_000), cache_dir=tmp_path)
    loss = unigram_loss(corpus.train, corpus.val)
    assert 2.5 < loss < math.log(256)


@pytest.fixture
def one_thread():
    """The machine is shared: several torch threads on 2 busy cores are ~15x slower than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_evaluate_is_deterministic_and_a_trained_model_beats_the_unigram_baseline(tmp_path, one_thread):
    torch.manual_seed(0)
    corpus = load_corpus(DataConfig(max_bytes=200_000), cache_dir=tmp_path)
    cfg = MODEL_PRESETS["tiny"]
    device = select_device("cpu")
    model = build_model(cfg, seed=0).to(device)
    before = evaluate(model, corpus.val, cfg.seq_len, batches=4, batch_size=8, device=device)
    assert before == evaluate(model, corpus.val, cfg.seq_len, batches=4, batch_size=8, device=device)
    assert before == pytest.approx(math.log(256), abs=0.3)  # an untrained model is near uniform
    sampler = ShardSampler(corpus.train, 0, 1, batch_size=16, seq_len=cfg.seq_len, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        x, y = sampler.next_batch()
        _, loss = model(x.to(device), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sync(device)
    after = evaluate(model, corpus.val, cfg.seq_len, batches=4, batch_size=8, device=device)
    assert model.training, "evaluate must restore training mode"
    assert after < unigram_loss(corpus.train, corpus.val) < before

