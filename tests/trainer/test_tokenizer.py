"""Tokenizers: a BPE trained here on stdlib sources (no network) round-trips text, tokenizes text corpora, and a
vocabulary the model cannot hold is a clear error."""

import pytest

from diloco_trainer.config import DataConfig
from diloco_trainer.data.corpus import list_stdlib_files, load_corpus
from diloco_trainer.data.source import open_tokens
from diloco_trainer.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    files = [f for f in list_stdlib_files() if f.name in ("argparse.py", "textwrap.py", "string.py")]
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(files, 512, out)
    return out


def test_a_bpe_trained_on_local_files_round_trips_text_and_compresses_it(bpe_path):
    tok = load_tokenizer(str(bpe_path))
    assert tok.vocab_size == 512 and tok.eos_id is not None
    text = "def parse_args(self, args=None):\n    return 'héllo ✓'\n"
    (ids,) = tok.encode_batch([text])
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) * 0.7, "a BPE trained on Python merges common byte pairs"
    assert int(ids.max()) < 512
    assert load_tokenizer(str(bpe_path.parent)).fingerprint == tok.fingerprint, "a directory holding tokenizer.json"


def test_the_byte_tokenizer_is_the_default_and_round_trips():
    tok = load_tokenizer(DataConfig().tokenizer)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256
    (ids,) = tok.encode_batch(["héllo"])
    assert tok.decode(ids) == "héllo" and len(ids) == 6


def test_a_folder_corpus_tokenized_with_a_bpe_ends_every_document_with_its_end_of_text(tmp_path, bpe_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(6):
        (folder / f"f{i}.py").write_text(f"# file {i}\n" + "def f(x):\n    return x + 1\n" * (20 + i))
    cfg = DataConfig(source="folder", path=str(folder), tokenizer=str(bpe_path), val_fraction=0.2)
    corpus = open_tokens(cfg, vocab_size=512, cache_dir=tmp_path / "cache")
    tok = load_tokenizer(str(bpe_path))
    assert int((corpus.train == tok.eos_id).sum()) == len(corpus.train_files)
    assert corpus.vocab_needed == 512
    text = tok.decode(corpus.train.tolist())
    assert "def f(x):\n    return x + 1\n" in text
    bytes_corpus = load_corpus(DataConfig(source="folder", path=str(folder), val_fraction=0.2),
                               cache_dir=tmp_path / "cache")
    assert len(corpus.train) < 0.75 * len(bytes_corpus.train), "the cache key separates tokenizers"


def test_a_tokenizer_larger_than_the_model_vocabulary_names_both_fields(tmp_path, bpe_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(3):
        (folder / f"f{i}.txt").write_text("some text " * 100)
    cfg = DataConfig(source="folder", path=str(folder), tokenizer=str(bpe_path))
    with pytest.raises(ValueError, match=r"data.tokenizer .* 512 tokens.*model.vocab_size \(256\)"):
        open_tokens(cfg, vocab_size=256, cache_dir=tmp_path / "cache")


def test_a_missing_or_malformed_tokenizer_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="data.tokenizer .*neither 'bytes' nor"):
        load_tokenizer(str(tmp_path / "nope.json"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match="not a Hugging Face tokenizer.json"):
        load_tokenizer(str(bad))


def test_a_token_file_source_refuses_a_tokenizer():
    with pytest.raises(ValueError, match="already tokenized"):
        DataConfig(source="tokens", path="t.npy", tokenizer="tok.json")


def test_bpe_training_refuses_a_vocabulary_below_the_byte_alphabet(tmp_path):
    with pytest.raises(ValueError, match="--vocab must be at least 257"):
        train_bpe([list_stdlib_files()[0]], 100, tmp_path / "t.json")
