"""`diloco data prepare`: text, JSONL and Parquet through `datasets` offline into bounded shards with a manifest the
training side reads; a re-run on the same inputs is a no-op, a changed input rebuilds, bad inputs are clear errors."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diloco_trainer.cli import main
from diloco_trainer.config import DataConfig
from diloco_trainer.data.corpus import list_stdlib_files
from diloco_trainer.data.manifest import read_manifest
from diloco_trainer.data.shards import TokenShards
from diloco_trainer.data.tokenizer import load_tokenizer, train_bpe

DOCS = [f"def f{i}(x):\n    return x * {i}  # é\n" * (3 + i % 5) for i in range(40)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    files = [f for f in list_stdlib_files() if f.name in ("argparse.py", "textwrap.py")]
    return train_bpe(files, 400, tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture
def inputs(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i, doc in enumerate(DOCS[:10]):
        (src / f"t{i}.txt").write_text(doc)
    with open(src / "records.jsonl", "w") as f:
        for doc in DOCS[10:25]:
            f.write(json.dumps({"body": doc, "id": 1}) + "\n")
    pq.write_table(pa.table({"body": DOCS[25:], "n": list(range(15))}), src / "part.parquet")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "t0.cpython-311.pyc").write_bytes(b"\xa7\r\r\n\x00compiled")
    (src / "blob.dat").write_bytes(b"\x00\x01binary")  # skipped in a directory: not text
    return src


def run(*argv):
    return main(["data", "prepare", *map(str, argv), "--no-progress"])


def all_tokens(out):
    manifest = read_manifest(out)
    return manifest, np.concatenate([np.fromfile(out / s.file, dtype="<" + manifest.dtype[4:].replace("16", "u2")
                                                 .replace("32", "u4")) for s in manifest.shards])


def test_text_jsonl_and_parquet_become_bounded_shards_that_decode_to_the_documents(tmp_path, inputs, bpe, capsys):
    out = tmp_path / "shards"
    assert run(inputs, "--tokenizer", bpe.name, "--out", out, "--text-field", "body", "--shard-tokens", 1024) == 0
    assert "wrote" in capsys.readouterr().out
    manifest, tokens = all_tokens(out)
    assert manifest.dtype == "uint16" and manifest.vocab_size == 400 and manifest.tokenizer_fingerprint.startswith(
        "sha256:")
    assert all(s.tokens == 1024 for s in manifest.shards[:-1]) and 0 < manifest.shards[-1].tokens <= 1024
    assert len(manifest.shards) > 2 and sum(s.documents for s in manifest.shards) == len(DOCS)
    tok = load_tokenizer(bpe.name)
    docs = tok.decode(tokens.tolist()).split("<|endoftext|>")
    assert sorted(docs[:-1]) == sorted(DOCS) and docs[-1] == "", "every document once, each ended by <|endoftext|>"
    assert {f.path.rsplit("/", 1)[-1] for f in manifest.inputs} == \
        {f.name for f in inputs.iterdir()} - {"__pycache__", "blob.dat"}
    shards = TokenShards.open(DataConfig(source="shards", path=str(out), tokenizer=bpe.name))
    assert shards.vocab_needed == 400 and shards.train_tokens + shards.val_tokens == len(tokens)


def test_a_rerun_on_the_same_inputs_is_a_no_op_and_a_changed_input_rebuilds(tmp_path, inputs, capsys):
    out = tmp_path / "shards"
    assert run(inputs, "--tokenizer", "bytes", "--out", out, "--text-field", "body", "--shard-tokens", 4096) == 0
    first = read_manifest(out)
    files = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert run(inputs, "--tokenizer", "bytes", "--out", out, "--text-field", "body", "--shard-tokens", 4096) == 0
    assert "up to date, nothing to do" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == files, "nothing rewritten"

    (inputs / "t0.txt").write_text("a new first document\n")
    assert run(inputs, "--tokenizer", "bytes", "--out", out, "--text-field", "body", "--shard-tokens", 4096) == 0
    assert "wrote" in capsys.readouterr().out
    second, tokens = all_tokens(out)
    assert second.total_tokens != first.total_tokens
    assert b"a new first document\n\x00" in tokens.astype(np.uint8).tobytes()
    left = sorted(p.name for p in out.iterdir())
    assert left == sorted([s.file for s in second.shards] + ["manifest.json"]), "the old build's shards are gone"


def test_bad_inputs_are_clear_errors_and_write_nothing(tmp_path, inputs, capsys):
    out = tmp_path / "shards"
    assert run(tmp_path / "missing.txt", "--tokenizer", "bytes", "--out", out) == 2
    assert "neither a file nor a directory" in capsys.readouterr().err
    assert run(inputs / "records.jsonl", "--tokenizer", "bytes", "--out", out, "--text-field", "nope") == 2
    err = capsys.readouterr().err
    assert "--text-field 'nope'" in err and "'body'" in err
    (tmp_path / "bad.parquet").write_text("not parquet")
    assert run(tmp_path / "bad.parquet", "--tokenizer", "bytes", "--out", out) == 2
    assert "could not be read as parquet" in capsys.readouterr().err
    assert run(inputs, "--tokenizer", tmp_path / "none.json", "--out", out) == 2
    assert "data.tokenizer" in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())


def test_the_tokenizer_command_trains_a_bpe_from_local_files(tmp_path, inputs, capsys):
    out = tmp_path / "tok.json"
    assert main(["data", "tokenizer", "--vocab", "300", "--out", str(out), str(inputs / "t1.txt"),
                 str(inputs / "t2.txt")]) == 0
    assert load_tokenizer(str(out)).vocab_size <= 300 and "byte-level BPE" in capsys.readouterr().out


def test_prepared_shards_manifest_and_tokenizer_are_readable_by_the_pods_user(tmp_path, inputs):
    """Pods run as another user (UID 10001) and mount the data read-only: files made private (0600) would be
    unreadable there."""
    tok = train_bpe([f for f in list_stdlib_files() if f.name == "textwrap.py"], 300, tmp_path / "tok.json")
    out = tmp_path / "shards"
    assert run(inputs, "--tokenizer", tok.name, "--out", out, "--text-field", "body", "--shard-tokens", 1024) == 0
    made = [tmp_path / "tok.json", *out.iterdir()]
    assert len(made) > 2
    for path in made:
        assert path.stat().st_mode & 0o777 == 0o644, f"{path.name}: {oct(path.stat().st_mode & 0o777)}"


def test_a_vocabulary_beyond_uint16_is_written_as_uint32_and_read_back_exactly(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "doc.txt").write_text("w1 w65535 w65536 w69999 w2")
    out = tmp_path / "shards"
    assert run(tmp_path / "doc.txt", "--tokenizer", tmp_path / "big.json", "--out", out) == 0
    manifest = read_manifest(out)
    assert manifest.dtype == "uint32" and manifest.vocab_size == 70_000 and manifest.eos_id is None
    assert np.fromfile(out / manifest.shards[0].file, dtype="<u4").tolist() == [1, 65535, 65536, 69999, 2]
