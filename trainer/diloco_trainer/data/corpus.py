"""Byte-level tokenizer, corpora (Python stdlib source / a folder of text / a token file) cached as token files,
and per-learner shards with a deterministic batch sampler whose position survives a restart. Text corpora can be
tokenized with a tokenizer.json instead of bytes (data.tokenizer); memory-mapped token shards live in shards.py."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from diloco_trainer.config import DataConfig
from diloco_trainer.data.tokenizer import BYTES, Tokenizer, load_tokenizer
from diloco_trainer.fsutil import atomic_write

log = logging.getLogger(__name__)

VOCAB_SIZE = 256  # the byte tokenizer's vocabulary: token id == byte value
DOC_SEPARATOR = 0  # NUL byte between documents (never appears inside a text file, so it marks file ends)
CACHE_ENV = "DILOCO_DATA_CACHE"
_CACHE_FORMAT = 2  # bump when the corpus layout changes so old cache files are not reused
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of `text` as a uint8 tensor (token id == byte value)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def decode(tokens: torch.Tensor | np.ndarray | list[int]) -> str:
    """Text of a byte-token sequence; invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD."""
    values = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
    if any(not 0 <= v < VOCAB_SIZE for v in values):
        raise ValueError("decode expects byte tokens in 0..255")
    return bytes(values).decode("utf-8", errors="replace")


@dataclass
class Corpus:
    """Train and held-out validation tokens (uint8 for byte corpora, int32 for wider token files)."""

    train: torch.Tensor
    val: torch.Tensor
    train_files: list[str] = field(default_factory=list)  # relative paths; empty for a token file
    val_files: list[str] = field(default_factory=list)
    tokenizer_vocab: int = VOCAB_SIZE  # the vocabulary of the tokenizer that made the tokens

    @property
    def vocab_needed(self) -> int:
        """Smallest model vocabulary that covers the tokenizer and every token id in the corpus."""
        top = max(int(self.train.max()), int(self.val.max())) if len(self.train) and len(self.val) else 0
        return max(self.tokenizer_vocab, top + 1)

    @property
    def train_tokens(self) -> int:
        return len(self.train)

    def sampler(self, shard: int, num_shards: int, batch_size: int, seq_len: int, seed: int = 0) -> "ShardSampler":
        """A resumable batch sampler over contiguous shard `shard` of `num_shards` of the training tokens."""
        return ShardSampler(self.train, shard, num_shards, batch_size, seq_len, seed)

    def sample(self, split: str, max_tokens: int) -> torch.Tensor:
        """The 'train' or 'val' tokens: all of them, whatever `max_tokens` (a corpus in memory is small)."""
        return self.train if split == "train" else self.val


# ---------------------------------------------------------------- file corpora (stdlib, folder)

def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's own `.py` files, sorted; third-party packages and test suites left out."""
    root = root or stdlib_root()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files)


def looks_like_text(path: Path) -> bool:
    """UTF-8 without NUL bytes in its first 8 KiB."""
    with open(path, "rb") as f:
        head = f.read(8192)
    if b"\x00" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start > len(head) - 4  # only a multi-byte character cut at the 8 KiB boundary
    return True


def list_text_files(folder: Path) -> list[Path]:
    """Regular text files (UTF-8, no NUL bytes) under `folder`, sorted; hidden files and dirs left out."""
    if not folder.is_dir():
        raise ValueError(f"data.path {str(folder)!r} is not a directory")
    files = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        for name in filenames:
            path = Path(dirpath) / name
            if not name.startswith(".") and path.is_file() and looks_like_text(path):
                files.append(path)
    return sorted(files)


def split_files(sizes: list[tuple[str, int]], val_fraction: float) -> tuple[list[str], list[str]]:
    """Deterministic split by file, about `val_fraction` of the bytes held out for validation.

    Files are walked in the order of the SHA-1 of their relative path (independent of the machine, mixes
    packages); a file is held out while the held-out bytes are below val_fraction of the bytes seen so far.
    At least one file lands on each side.
    """
    if len(sizes) < 2:
        raise ValueError(f"a corpus split by file needs at least 2 files, found {len(sizes)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    order = sorted(sizes, key=lambda fs: hashlib.sha1(fs[0].encode()).hexdigest())
    train, val, seen, held = [], [], 0, 0
    for name, size in order:
        seen += size
        if held < val_fraction * seen and len(val) < len(order) - 1:
            val.append(name)
            held += size
        else:
            train.append(name)
    if not train:  # pragma: no cover - the len(val) guard above keeps one file for training
        train.append(val.pop())
    return train, val


def _concat(root: Path, rel_files: list[str], budget: int | None) -> np.ndarray:
    """Files' bytes joined, each followed by DOC_SEPARATOR, cut at `budget` bytes."""
    chunks, total = [], 0
    for rel in rel_files:
        if budget is not None and total >= budget:
            break
        data = (root / rel).read_bytes() + bytes([DOC_SEPARATOR])
        if budget is not None:
            data = data[: budget - total]
        chunks.append(np.frombuffer(data, dtype=np.uint8))
        total += len(data)
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint8)


def token_dtype(vocab_size: int) -> np.dtype:
    """Type of a text corpus's tokens in memory: uint8 for bytes, else int32 (torch has few uint16 kernels)."""
    return np.dtype(np.uint8 if vocab_size <= 256 else np.int32)


def _tokenize(joined: np.ndarray, tok: Tokenizer) -> np.ndarray:
    """Byte-joined documents (DOC_SEPARATOR after each; the last one maybe cut by a budget) as tokens of `tok`, with
    the tokenizer's end-of-text token after each complete document."""
    docs = bytes(joined).split(bytes([DOC_SEPARATOR]))
    complete = [True] * (len(docs) - 1) + [False]  # split leaves what follows the last separator
    pieces = []
    for ids, whole in zip(tok.encode_batch([d.decode("utf-8", errors="ignore") for d in docs]), complete):
        pieces.append(ids)
        if whole and tok.eos_id is not None:
            pieces.append(np.array([tok.eos_id]))
    dtype = token_dtype(tok.vocab_size)
    return np.concatenate(pieces).astype(dtype) if pieces else np.zeros(0, dtype=dtype)


def default_cache_dir() -> Path:
    """$DILOCO_DATA_CACHE, else ~/.cache/diloco/data."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "diloco" / "data")


def _atomic_save(path: Path, array: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    atomic_write(path, buf.getvalue())


def _file_corpus(root: Path, files: list[Path], cfg: DataConfig, cache_dir: Path | None) -> Corpus:
    rel = [str(p.relative_to(root)) for p in files]
    stats = [(r, st.st_size, st.st_mtime_ns) for r in rel for st in [(root / r).stat()]]
    train_files, val_files = split_files([(r, size) for r, size, _ in stats], cfg.val_fraction)
    tok = load_tokenizer(cfg.tokenizer)
    # The key covers everything the tokens depend on, so a changed file or setting never reuses a stale cache.
    key_src = json.dumps([_CACHE_FORMAT, str(root.resolve()), cfg.val_fraction, cfg.max_bytes, stats,
                          tok.fingerprint])
    key = hashlib.sha256(key_src.encode()).hexdigest()[:20]
    cache = (cache_dir or default_cache_dir())
    train_path, val_path = cache / f"{cfg.source}-{key}.train.npy", cache / f"{cfg.source}-{key}.val.npy"
    if train_path.exists() and val_path.exists():
        train = np.load(train_path, allow_pickle=False)
        val = np.load(val_path, allow_pickle=False)
        log.info("corpus from cache %s (%d train / %d val bytes)", train_path.name, len(train), len(val))
    else:
        val_budget = None if cfg.max_bytes is None else max(1, int(cfg.max_bytes * cfg.val_fraction))
        val = _concat(root, val_files, val_budget)
        train = _concat(root, train_files, None if cfg.max_bytes is None else cfg.max_bytes - len(val))
        if cfg.tokenizer != BYTES:  # max_bytes counts text bytes, whatever the tokenizer
            train, val = _tokenize(train, tok), _tokenize(val, tok)
        try:
            _atomic_save(train_path, train)
            _atomic_save(val_path, val)
        except OSError as exc:  # a read-only home in a container must not stop training
            log.warning("could not cache the corpus in %s: %s", cache, exc)
    return Corpus(torch.from_numpy(np.array(train)), torch.from_numpy(np.array(val)), train_files, val_files,
                  tok.vocab_size)


# ---------------------------------------------------------------- token files

def load_token_file(path: Path) -> np.ndarray:
    """A pre-tokenized 1-D file: `.npy` (uint8/uint16/int32, no pickles) or raw `.bin` (little-endian uint16)."""
    if not path.is_file():
        raise ValueError(f"data.path {str(path)!r} is not a file")
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise ValueError(f"data.path {str(path)!r} is not a plain .npy array: {exc}") from exc
        if tokens.dtype not in (np.uint8, np.uint16, np.int32) or tokens.ndim != 1:
            raise ValueError(f"data.path {str(path)!r}: expected a 1-D uint8/uint16/int32 array, "
                             f"got {tokens.dtype} with shape {tokens.shape}")
        if tokens.dtype == np.int32 and len(tokens) and int(tokens.min()) < 0:
            raise ValueError(f"data.path {str(path)!r} holds negative token ids")
        return tokens
    if path.suffix == ".bin":
        if path.stat().st_size % 2:
            raise ValueError(f"data.path {str(path)!r}: a .bin token file is uint16, its size must be even")
        return np.memmap(path, dtype="<u2", mode="r")
    raise ValueError(f"data.path {str(path)!r}: token files must end in .npy or .bin")


def _token_corpus(cfg: DataConfig) -> Corpus:
    tokens = load_token_file(Path(cfg.path))
    if cfg.max_bytes is not None:
        tokens = tokens[: cfg.max_bytes]  # for token files the cap counts tokens
    n_val = max(1, int(len(tokens) * cfg.val_fraction))
    if len(tokens) - n_val < 2:
        raise ValueError(f"data.path {cfg.path!r} holds only {len(tokens)} tokens")
    # No files to split by: the last val_fraction of the tokens is held out.
    dtype = np.uint8 if tokens.dtype == np.uint8 or int(tokens.max()) < VOCAB_SIZE else np.int32
    tokens = np.asarray(tokens, dtype=dtype)
    return Corpus(torch.from_numpy(tokens[:-n_val].copy()), torch.from_numpy(tokens[-n_val:].copy()))


_PRELOADED: dict[str, Corpus] = {}  # see `preload`


def _preload_key(cfg: DataConfig, cache_dir: Path | None) -> str:
    return json.dumps([cfg.model_dump(mode="json"), str(cache_dir)], sort_keys=True)


def preload(cfg: DataConfig, cache_dir: Path | None = None) -> Corpus | None:
    """Load a corpus now and hand it, unchecked, to this process's later `load_corpus` calls with the same arguments.

    Only for a process that becomes a learner within the run that loaded it (a warm spare forked from the local
    runtime's zygote inherits it): its start then skips walking, hashing and reading the corpus files — measured
    (issue 11), 2.2 s of a 2.9 s learner start on the busy 2-core machine. Shards need none: they open in
    milliseconds and are memory-mapped (None)."""
    if cfg.source == "shards":
        return None
    corpus = _PRELOADED[_preload_key(cfg, cache_dir)] = load_corpus(cfg, cache_dir)
    return corpus


def load_corpus(cfg: DataConfig, cache_dir: Path | None = None) -> Corpus:
    """Train and validation tokens for a data config; file corpora are cached as .npy token files."""
    preloaded = _PRELOADED.get(_preload_key(cfg, cache_dir))
    if preloaded is not None:
        return preloaded
    if cfg.source == "shards":
        raise ValueError("data.source 'shards' is memory-mapped, not loaded: open it with data.source.open_tokens")
    if cfg.source == "tokens":
        return _token_corpus(cfg)
    if cfg.source == "stdlib":
        root = stdlib_root()
        files = list_stdlib_files(root)
    else:
        root = Path(cfg.path).expanduser()
        files = list_text_files(root)
    if not files:
        raise ValueError(f"no text files found under {str(root)!r} (data.source={cfg.source!r})")
    return _file_corpus(root, files, cfg, cache_dir)


# ---------------------------------------------------------------- shards and batches

def shard_bounds(length: int, shard: int, num_shards: int) -> tuple[int, int]:
    """[start, end) of contiguous shard `shard` of `num_shards` over `length` tokens."""
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ValueError(f"shard must be in 0..num_shards-1, got shard {shard} of {num_shards}")
    return length * shard // num_shards, length * (shard + 1) // num_shards


class ShardSampler:
    """Batches of (x, y) windows from one contiguous shard, in a seeded order that a saved position resumes.

    Each epoch draws a random phase and a random permutation of non-overlapping windows of seq_len + 1
    tokens, both from (seed, shard, epoch) alone; `offset` counts windows already served in the epoch.
    """

    def __init__(self, tokens: torch.Tensor, shard: int, num_shards: int, batch_size: int, seq_len: int,
                 seed: int = 0):
        start, end = shard_bounds(len(tokens), shard, num_shards)
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
        if end - start < 2 * (seq_len + 1):
            raise ValueError(f"shard {shard} of {num_shards} holds {end - start} tokens, too few for "
                             f"seq_len={seq_len}; use fewer shards or more data")
        self.tokens = tokens[start:end]
        self.shard, self.num_shards = shard, num_shards
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.epoch, self.offset = 0, 0
        self._starts: torch.Tensor | None = None

    def _epoch_starts(self) -> torch.Tensor:
        if self._starts is None:
            gen = torch.Generator().manual_seed(hash_seed(self.seed, self.shard, self.epoch))
            phase = int(torch.randint(self.seq_len, (1,), generator=gen))
            n = (len(self.tokens) - phase - 1) // self.seq_len
            if n < 1:  # a shard barely longer than one window: no room for a phase
                phase, n = 0, (len(self.tokens) - 1) // self.seq_len
            self._starts = phase + self.seq_len * torch.randperm(n, generator=gen)
        return self._starts

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (inputs, targets), int64 tensors of shape (batch_size, seq_len); epochs roll over."""
        picked, count = [], 0
        while count < self.batch_size:
            starts = self._epoch_starts()
            take = min(self.batch_size - count, len(starts) - self.offset)
            picked.append(starts[self.offset: self.offset + take])
            self.offset, count = self.offset + take, count + take
            if self.offset == len(starts):
                self.epoch, self.offset, self._starts = self.epoch + 1, 0, None
        idx = torch.cat(picked)[:, None] + torch.arange(self.seq_len + 1)
        windows = self.tokens[idx].long()
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        """JSON-able position: {"shard", "num_shards", "offset", "epoch"} (docs/protocol.md)."""
        return {"shard": self.shard, "num_shards": self.num_shards, "offset": self.offset, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        """Resume a saved position; a position from another shard layout raises ValueError."""
        try:
            shard, num, offset, epoch = (int(state[k]) for k in ("shard", "num_shards", "offset", "epoch"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed data position {state!r}: {exc}") from exc
        if (shard, num) != (self.shard, self.num_shards):
            raise ValueError(f"data position is for shard {shard} of {num}, "
                             f"this sampler reads shard {self.shard} of {self.num_shards}")
        if offset < 0 or epoch < 0:
            raise ValueError(f"data position offset/epoch must be >= 0, got {offset}/{epoch}")
        self.epoch, self._starts = epoch, None
        self.offset = min(offset, len(self._epoch_starts()))
        if self.offset == len(self._epoch_starts()):
            self.epoch, self.offset, self._starts = self.epoch + 1, 0, None


def hash_seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (stable across processes, unlike hash())."""
    digest = hashlib.sha256(json.dumps(list(parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# ---------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(model: torch.nn.Module, val_tokens: torch.Tensor, seq_len: int, batches: int, batch_size: int,
             device: torch.device | str = "cpu") -> float:
    """Mean next-token cross-entropy over `batches` fixed, evenly spaced windows of the validation tokens."""
    if len(val_tokens) < seq_len + 1:
        raise ValueError(f"validation set has {len(val_tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    n = max(1, batches * batch_size)
    starts = torch.linspace(0, len(val_tokens) - seq_len - 1, n).long()
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        for i in range(0, n, batch_size):
            idx = starts[i: i + batch_size, None] + torch.arange(seq_len + 1)
            windows = val_tokens[idx].long().to(device)
            _, loss = model(windows[:, :-1], windows[:, 1:])
            total += float(loss) * len(idx)
    finally:
        model.train(was_training)
    return total / n


def unigram_loss(train_tokens: torch.Tensor, val_tokens: torch.Tensor) -> float:
    """Cross-entropy (nats/token) of the validation tokens under add-one-smoothed train token frequencies."""
    if len(train_tokens) == 0 or len(val_tokens) == 0:
        raise ValueError("unigram_loss needs non-empty train and validation tokens")
    vocab = max(VOCAB_SIZE, int(train_tokens.max()) + 1, int(val_tokens.max()) + 1)
    counts = torch.bincount(train_tokens.long(), minlength=vocab).double() + 1.0
    logp = counts.log() - math.log(float(counts.sum()))
    return float(-logp[val_tokens.long()].mean())

