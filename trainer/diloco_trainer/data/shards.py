"""Pre-tokenized shards (a directory or glob of .bin/.npy files, the nanoGPT/Megatron/torchtitan layout) read
memory-mapped, never whole into RAM, and a resumable per-learner sampler whose windows never cross a file boundary."""

from __future__ import annotations

import glob
import logging
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from diloco_trainer.config import DataConfig
from diloco_trainer.data.corpus import hash_seed
from diloco_trainer.data.manifest import Manifest, read_manifest
from diloco_trainer.data.tokenizer import BYTES, load_tokenizer

log = logging.getLogger(__name__)

DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}


@dataclass
class ShardFile:
    """One file of tokens: its first `train_end` tokens train, the rest is held out for validation."""

    path: Path
    dtype: np.dtype
    length: int
    train_end: int
    npy: bool = False
    _map: np.ndarray | None = None

    def tokens(self) -> np.ndarray:
        """The file's tokens, memory-mapped read-only (pages are read only when touched)."""
        if self._map is None:
            self._map = (np.load(self.path, mmap_mode="r", allow_pickle=False) if self.npy
                         else np.memmap(self.path, dtype=self.dtype, mode="r"))
            self._advise(mmap.MADV_RANDOM)  # windows are read in random order: no readahead
        return self._map

    def release(self) -> None:
        """Unmap the pages read so far: they stay in the page cache, but no longer count in this process's RSS."""
        if self._map is not None:
            self._advise(mmap.MADV_DONTNEED)

    def _advise(self, advice: int) -> None:
        # The kernel maps whole page-cache folios (up to 2 MiB) around every touched page: without this, random
        # windows leave the whole set mapped into the process (measured: 160 windows of a 64 MiB file, all of it).
        raw = getattr(self._map, "_mmap", None)
        if raw is not None:
            raw.madvise(advice)


def _bad(cfg: DataConfig, why: str) -> ValueError:
    return ValueError(f"data.path {cfg.path!r}: {why}")


def _list_files(cfg: DataConfig) -> tuple[list[Path], Manifest | None]:
    root = Path(cfg.path).expanduser()
    if root.is_dir():
        manifest = read_manifest(root)
        if manifest is not None:
            files = [root / s.file for s in manifest.shards]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise _bad(cfg, f"manifest.json lists shards that are missing: {missing[:5]}")
            return files, manifest
        files = sorted(p for p in root.iterdir() if p.suffix in (".bin", ".npy") and p.is_file())
    elif root.is_file() and root.suffix in (".bin", ".npy"):
        files = [root]
    elif any(c in cfg.path for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(str(root)) if Path(p).suffix in (".bin", ".npy"))
    else:
        raise _bad(cfg, "is neither a directory, nor a .bin/.npy token file, nor a glob of them")
    if not files:
        raise _bad(cfg, "holds no .bin or .npy token files")
    return files, None


def _open_file(path: Path, cfg: DataConfig, dtype_name: str | None) -> ShardFile:
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise _bad(cfg, f"{path.name} is not a plain .npy array: {exc}") from exc
        if arr.ndim != 1 or arr.dtype.newbyteorder("=") not in [np.dtype(t) for t in DTYPES.values()]:
            raise _bad(cfg, f"{path.name}: expected a 1-D uint8/uint16/uint32 array, got {arr.dtype} {arr.shape}")
        n = len(arr)
        dtype = arr.dtype
    else:
        if dtype_name is None:
            raise ValueError(f"data.dtype is required for raw .bin shards without a manifest.json: "
                             f"uint16 or uint32 ({path.name} in data.path {cfg.path!r})")
        dtype = np.dtype(DTYPES[dtype_name]).newbyteorder("<")
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise ValueError(f"{path.name} in data.path {cfg.path!r} holds {size} bytes, not a whole number of "
                             f"{dtype_name} tokens: is data.dtype right?")
        n = size // dtype.itemsize
    n_val = int(n * cfg.val_fraction)
    return ShardFile(path, dtype, n, n - n_val, npy=path.suffix == ".npy")


class TokenShards:
    """A set of token files opened lazily and memory-mapped; the last val_fraction of every file is validation."""

    def __init__(self, files: list[ShardFile], manifest: Manifest | None, vocab: int | None, where: str):
        self.files, self.manifest = files, manifest
        self.vocab_known = vocab  # the tokenizer's vocabulary, when a manifest or data.tokenizer says it
        self.where = where
        self.vocab_limit: int | None = None  # model.vocab_size, checked on every batch when vocab_known is None

    @classmethod
    def open(cls, cfg: DataConfig) -> "TokenShards":
        """Open the files of data.path (a manifest, when the directory has one, gives their order and type)."""
        paths, manifest = _list_files(cfg)
        dtype_name = cfg.dtype
        if manifest is not None:
            if cfg.dtype is not None and cfg.dtype != manifest.dtype:
                raise ValueError(f"data.dtype is {cfg.dtype!r} but the manifest.json of data.path {cfg.path!r} "
                                 f"says the shards are {manifest.dtype}")
            dtype_name = manifest.dtype
        files = [_open_file(p, cfg, dtype_name) for p in paths]
        if manifest is not None:
            for f, entry in zip(files, manifest.shards):
                if f.length != entry.tokens:
                    raise _bad(cfg, f"{f.path.name} holds {f.length} tokens, its manifest says {entry.tokens}")
        vocab = manifest.vocab_size if manifest is not None else None
        if cfg.tokenizer != BYTES:
            tok = load_tokenizer(cfg.tokenizer)
            if manifest is not None and tok.fingerprint != manifest.tokenizer_fingerprint:
                raise ValueError(f"data.tokenizer {cfg.tokenizer!r} is not the tokenizer the shards in data.path "
                                 f"{cfg.path!r} were made with ({manifest.tokenizer})")
            vocab = max(vocab or 0, tok.vocab_size)
        shards = cls(files, manifest, vocab, f"the shards in data.path {cfg.path!r}")
        log.info("token shards: %d files, %d train / %d validation tokens, memory-mapped", len(files),
                 shards.train_tokens, shards.val_tokens)
        return shards

    @property
    def train_tokens(self) -> int:
        return sum(f.train_end for f in self.files)

    @property
    def val_tokens(self) -> int:
        return sum(f.length - f.train_end for f in self.files)

    @property
    def vocab_needed(self) -> int | None:
        return self.vocab_known

    def pieces(self, shard: int, num_shards: int) -> list[tuple[int, int, int]]:
        """(file, start, end) token ranges of contiguous shard `shard` of `num_shards` over all training tokens."""
        from diloco_trainer.data.corpus import shard_bounds

        lo, hi = shard_bounds(self.train_tokens, shard, num_shards)
        out, base = [], 0
        for i, f in enumerate(self.files):
            a, b = max(lo, base), min(hi, base + f.train_end)
            if a < b:
                out.append((i, a - base, b - base))
            base += f.train_end
        return out

    def sampler(self, shard: int, num_shards: int, batch_size: int, seq_len: int, seed: int = 0) -> "FileShardSampler":
        """A resumable sampler over this learner's shard (see FileShardSampler)."""
        return FileShardSampler(self, shard, num_shards, batch_size, seq_len, seed)

    def sample(self, split: str, max_tokens: int) -> torch.Tensor:
        """Up to `max_tokens` tokens of 'train' or 'val', a contiguous run from each file in proportion to its size
        (copied: bounded by max_tokens, whatever the set's size). Runs are joined: a few windows cross a join."""
        ranges = [(f, 0, f.train_end) if split == "train" else (f, f.train_end, f.length) for f in self.files]
        total = sum(b - a for _, a, b in ranges)
        parts = []
        for f, a, b in ranges:
            if b > a:
                parts.append(np.asarray(f.tokens()[a: a + (b - a) * max_tokens // max(total, max_tokens)],
                                        dtype=np.int32))
                f.release()
        return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32))


def permute(index: np.ndarray, n: int, key: int) -> np.ndarray:
    """A keyed bijection of [0, n) applied to `index` (a 4-round Feistel network with cycle-walking): a shuffled
    epoch of any length in O(1) memory."""
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2
    half, mask = bits // 2, np.uint64((1 << (bits // 2)) - 1)
    keys = [np.uint64(hash_seed(key, r)) for r in range(4)]

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << np.uint64(half)) | right

    out = encrypt(np.asarray(index, dtype=np.uint64))
    while (outside := out >= n).any():  # walks the cycle back into [0, n): the orbit of an x < n returns there
        out[outside] = encrypt(out[outside])
    return out.astype(np.int64)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (wrapping uint64 arithmetic)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class FileShardSampler:
    """Batches of (x, y) windows from one learner's shard of a TokenShards set, in a seeded order a saved position
    resumes. As ShardSampler: each epoch draws a phase and an order of the non-overlapping seq_len + 1 windows from
    (seed, shard, epoch) alone, `offset` counts windows served; windows lie inside one file's piece of the shard."""

    def __init__(self, shards: TokenShards, shard: int, num_shards: int, batch_size: int, seq_len: int,
                 seed: int = 0):
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
        self.set, self.shard, self.num_shards = shards, shard, num_shards
        self.pieces = shards.pieces(shard, num_shards)
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        held = sum(b - a for _, a, b in self.pieces)
        if held < 2 * (seq_len + 1) or not self._layout(0)[1][-1]:
            raise ValueError(f"shard {shard} of {num_shards} holds {held} tokens in {len(self.pieces)} file "
                             f"piece(s), too few for seq_len={seq_len}; use fewer shards or more data")
        self.epoch, self.offset = 0, 0
        self._epoch_cache: tuple[int, int, np.ndarray] | None = None

    def _layout(self, phase: int) -> tuple[np.ndarray, np.ndarray]:
        counts = np.array([max(0, (b - a - phase - 1) // self.seq_len) for _, a, b in self.pieces], dtype=np.int64)
        return counts, np.concatenate([[0], np.cumsum(counts)])

    def _epoch(self) -> tuple[int, int, np.ndarray]:
        """(phase, windows, cumulative window counts per piece) of the current epoch."""
        if self._epoch_cache is None:
            phase = hash_seed(self.seed, self.shard, self.epoch) % self.seq_len
            _, cum = self._layout(phase)
            if cum[-1] == 0:  # pieces barely longer than one window: no room for a phase
                phase, (_, cum) = 0, self._layout(0)
            self._epoch_cache = (phase, int(cum[-1]), cum)
        return self._epoch_cache

    def _starts(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        phase, n, cum = self._epoch()
        window = permute(np.arange(first, first + count), n, hash_seed(self.seed, self.shard, self.epoch, 1))
        piece = np.searchsorted(cum, window, side="right") - 1
        starts = np.array([self.pieces[p][1] for p in piece]) + phase + self.seq_len * (window - cum[piece])
        return np.array([self.pieces[p][0] for p in piece]), starts

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (inputs, targets), int64 tensors of shape (batch_size, seq_len); epochs roll over."""
        rows = []
        while len(rows) < self.batch_size:
            _, n, _ = self._epoch()
            take = min(self.batch_size - len(rows), n - self.offset)
            files, starts = self._starts(self.offset, take)
            for f, s in zip(files, starts):
                rows.append(np.asarray(self.set.files[f].tokens()[s: s + self.seq_len + 1], dtype=np.int64))
            for f in set(files.tolist()):  # copied out: what this learner holds of the set is one batch
                self.set.files[f].release()
            self.offset += take
            if self.offset == n:
                self.epoch, self.offset, self._epoch_cache = self.epoch + 1, 0, None
        windows = torch.from_numpy(np.stack(rows))
        limit = self.set.vocab_limit
        if limit is not None and self.set.vocab_known is None and int(windows.max()) >= limit:
            raise ValueError(f"{self.set.where} hold token id {int(windows.max())}, outside model.vocab_size "
                             f"({limit}); raise model.vocab_size or check data.dtype")
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        """JSON-able position: {"shard", "num_shards", "offset", "epoch", "tokens"} (tokens: the set's training
        tokens, so a position is never applied to another data set)."""
        return {"shard": self.shard, "num_shards": self.num_shards, "offset": self.offset, "epoch": self.epoch,
                "tokens": self.set.train_tokens}

    def load_state_dict(self, state: dict) -> None:
        """Resume a saved position; one from another shard layout or data set raises ValueError."""
        try:
            shard, num, offset, epoch = (int(state[k]) for k in ("shard", "num_shards", "offset", "epoch"))
            tokens = int(state.get("tokens", -1))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed data position {state!r}: {exc}") from exc
        if (shard, num) != (self.shard, self.num_shards):
            raise ValueError(f"data position is for shard {shard} of {num}, "
                             f"this sampler reads shard {self.shard} of {self.num_shards}")
        if tokens != self.set.train_tokens:
            raise ValueError(f"data position is for a set of {tokens} training tokens, "
                             f"{self.set.where} now hold {self.set.train_tokens}")
        if offset < 0 or epoch < 0:
            raise ValueError(f"data position offset/epoch must be >= 0, got {offset}/{epoch}")
        self.epoch, self._epoch_cache = epoch, None
        self.offset = min(offset, self._epoch()[1])
        if self.offset == self._epoch()[1]:
            self.epoch, self.offset, self._epoch_cache = self.epoch + 1, 0, None
