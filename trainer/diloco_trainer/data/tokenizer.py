"""Tokenizers by name: `bytes` (token id == byte value) or a Hugging Face `tokenizers` file (tokenizer.json), and
training a small byte-level BPE from local files (no network)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

BYTES = "bytes"
BYTE_VOCAB = 256
# Token appended after every document, when the tokenizer has one (the byte tokenizer uses NUL, id 0).
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")


class ByteTokenizer:
    """UTF-8 bytes; the built-in GPT's default vocabulary."""

    name = BYTES
    vocab_size = BYTE_VOCAB
    eos_id: int | None = 0  # NUL never appears inside a text file, so it marks document ends
    fingerprint = BYTES

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from a tokenizer.json file."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.name = str(path)
        raw = path.read_bytes()
        try:
            self.tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"data.tokenizer {str(path)!r} is not a Hugging Face tokenizer.json: {exc}") from exc
        self.fingerprint = "sha256:" + hashlib.sha256(raw).hexdigest()
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = next((i for i in map(self.tok.token_to_id, END_OF_TEXT) if i is not None), None)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self.tok.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(spec: str) -> Tokenizer:
    """`bytes`, or the tokenizer.json at path `spec`; a missing or malformed file raises ValueError naming it."""
    if spec == BYTES:
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():  # a model directory holding its tokenizer
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"data.tokenizer {spec!r} is neither 'bytes' nor an existing tokenizer.json file")
    return HFTokenizer(path)


def check_vocab(needed: int, vocab_size: int, what: str) -> None:
    """ValueError naming both fields when token ids up to `needed` - 1 do not fit model.vocab_size."""
    if needed > vocab_size:
        raise ValueError(f"{what} needs a vocabulary of {needed} tokens, more than model.vocab_size "
                         f"({vocab_size}); raise model.vocab_size or use a smaller tokenizer")


def train_bpe(files: list[Path], vocab_size: int, out: Path) -> HFTokenizer:
    """Train a byte-level BPE of `vocab_size` tokens (with <|endoftext|>) on local text files; write tokenizer.json."""
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers

    from diloco_trainer.fsutil import atomic_write

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"--vocab must be at least {len(alphabet) + 1} (the 256 byte symbols and <|endoftext|>)")
    missing = [str(f) for f in files if not Path(f).is_file()]
    if missing or not files:
        raise ValueError(f"BPE training needs existing text files; missing: {missing[:5] or 'all'}")
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT[0]], initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train([str(f) for f in files], trainer)
    atomic_write(out, tok.to_str().encode(), mode=0o644)  # read by pods under another user, like the shards
    return HFTokenizer(out)
