"""`diloco data prepare`: local text / JSONL / Parquet files, read through Hugging Face `datasets` offline, tokenized
in batches and written as bounded uint16/uint32 shards plus manifest.json. Unchanged inputs and tokenizer: a no-op."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from diloco_trainer.data.corpus import looks_like_text
from diloco_trainer.data.manifest import FILE, InputFile, Manifest, ShardEntry, read_manifest, write_manifest
from diloco_trainer.data.tokenizer import Tokenizer, load_tokenizer
from diloco_trainer.fsutil import atomic_open, fsync_dir
from diloco_trainer.data.manifest import READABLE

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # anything else is read as text
SHARD_NAME = re.compile(r"^[0-9a-f]{10}-\d{5}\.bin(\..*\.tmp)?$")  # what prepare writes (and may delete)
DEFAULT_SHARD_TOKENS = 1 << 26  # 128 MiB of uint16


class InputError(ValueError):
    """An input file that is not what the options say it is."""


@dataclass
class PrepareOptions:
    inputs: list[str]
    tokenizer: str
    out: Path
    text_field: str = "text"
    sample_by: str = "document"
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    batch_size: int = 1000
    progress: bool = True


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Input files: each file as given; in a directory, its JSON/Parquet files and the files that look like text
    (UTF-8, no NUL: compiled or binary files are skipped), hidden and __pycache__ left out, sorted. A missing input
    is a ValueError."""
    files = []
    for name in inputs:
        path = Path(name).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file()
                                and not any(part.startswith(".") or part == "__pycache__"
                                            for part in p.relative_to(path).parts)
                                and (p.suffix.lower() in BUILDERS or looks_like_text(p))))
        else:
            raise ValueError(f"input {name!r} is neither a file nor a directory")
    if not files:
        raise ValueError(f"no input files under {inputs}")
    return files


def _recipe_manifest(opts: PrepareOptions, files: list[Path], tok: Tokenizer) -> Manifest:
    inputs = [InputFile(path=str(f.resolve()), size=st.st_size, mtime_ns=st.st_mtime_ns)
              for f in files for st in [f.stat()]]
    return Manifest(tokenizer=tok.name, tokenizer_fingerprint=tok.fingerprint, vocab_size=tok.vocab_size,
                    dtype="uint16" if tok.vocab_size <= 1 << 16 else "uint32", eos_id=tok.eos_id,
                    text_field=opts.text_field, sample_by=opts.sample_by, shard_tokens=opts.shard_tokens,
                    inputs=inputs, shards=[])


def _texts(path: Path, opts: PrepareOptions):
    """Batches of document texts of one input file, streamed through `datasets` (nothing cached, nothing fetched)."""
    import datasets

    builder = BUILDERS.get(path.suffix.lower(), "text")
    kwargs = {"sample_by": opts.sample_by} if builder == "text" else {}
    field = "text" if builder == "text" else opts.text_field
    try:
        ds = datasets.load_dataset(builder, data_files=[str(path)], split="train", streaming=True, **kwargs)
        for batch in ds.iter(batch_size=opts.batch_size):
            if field not in batch:
                raise InputError(f"--text-field {field!r} is not a field of {path} (its fields: {sorted(batch)})")
            yield [t for t in batch[field] if t]
    except InputError:
        raise
    except Exception as exc:  # datasets/pyarrow raise many types for a file that is not what its name says
        raise ValueError(f"{path} could not be read as {builder}: {type(exc).__name__}: {exc}") from exc


class ShardWriter:
    """Writes tokens into files of exactly `shard_tokens` tokens (the last one shorter), each replaced atomically."""

    def __init__(self, out: Path, build: str, dtype: str, shard_tokens: int):
        self.out, self.build, self.shard_tokens = out, build, shard_tokens
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shards: list[ShardEntry] = []
        self._cm = self._f = None
        self._count = self._docs = 0

    def write(self, tokens: np.ndarray, ends: np.ndarray) -> None:
        """Append tokens; `ends` are the positions (exclusive) in `tokens` where a document ends."""
        pos = 0
        while pos < len(tokens):
            if self._f is None:
                name = f"{self.build}-{len(self.shards):05d}.bin"
                self._cm = atomic_open(self.out / name, mode=READABLE)
                self._f, self._name = self._cm.__enter__(), name
            take = min(len(tokens) - pos, self.shard_tokens - self._count)
            self._f.write(tokens[pos: pos + take].astype(self.dtype).tobytes())
            self._docs += int(((ends > pos) & (ends <= pos + take)).sum())
            self._count, pos = self._count + take, pos + take
            if self._count == self.shard_tokens:
                self.close()

    def close(self) -> None:
        if self._f is not None:
            self._cm.__exit__(None, None, None)
            self.shards.append(ShardEntry(file=self._name, tokens=self._count, documents=self._docs))
            self._cm = self._f = None
            self._count = self._docs = 0

    def abort(self, exc: BaseException) -> None:
        if self._cm is not None:
            try:
                self._cm.__exit__(type(exc), exc, exc.__traceback__)  # removes the temporary file
            except BaseException:
                pass


def _progress(enabled: bool, total: int):
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                    TextColumn("{task.fields[tokens]:,} tokens"), TimeElapsedColumn(), TimeRemainingColumn(),
                    disable=not enabled)


def prepare(opts: PrepareOptions) -> tuple[Manifest, bool]:
    """Tokenize the inputs into opts.out; returns (manifest, whether anything was written)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if opts.shard_tokens < 1024:
        raise ValueError(f"--shard-tokens must be at least 1024, got {opts.shard_tokens}")
    files = expand_inputs(opts.inputs)
    tok = load_tokenizer(opts.tokenizer)
    out = Path(opts.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} exists and is not a directory")
    planned = _recipe_manifest(opts, files, tok)
    try:
        current = read_manifest(out) if out.is_dir() else None
    except ValueError:
        current = None  # a damaged manifest: rebuild
    if current is not None and current.recipe == planned.recipe and \
            all((out / s.file).is_file() for s in current.shards):
        return current, False

    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    out.mkdir(parents=True, exist_ok=True)
    build = hashlib.sha256(json.dumps(planned.recipe, sort_keys=True).encode()).hexdigest()[:10]
    writer = ShardWriter(out, build, planned.dtype, opts.shard_tokens)
    total_tokens, done_bytes = 0, 0
    eos = [] if tok.eos_id is None else [tok.eos_id]
    try:
        with _progress(opts.progress, sum(f.size for f in planned.inputs)) as bar:
            task = bar.add_task("tokenizing", total=sum(f.size for f in planned.inputs), tokens=0)
            for path, info in zip(files, planned.inputs):
                bar.update(task, description=f"tokenizing {path.name}")
                for texts in _texts(path, opts):
                    docs = [np.concatenate([ids.astype(np.uint32), np.asarray(eos, dtype=np.uint32)])
                            for ids in tok.encode_batch(texts)]
                    if docs:
                        tokens = np.concatenate(docs)
                        writer.write(tokens, np.cumsum([len(d) for d in docs]))
                        total_tokens += len(tokens)
                    bar.update(task, completed=min(done_bytes + sum(len(t) for t in texts), done_bytes + info.size),
                               tokens=total_tokens)
                done_bytes += info.size
                bar.update(task, completed=done_bytes)
            writer.close()
    except BaseException as exc:
        writer.abort(exc)
        raise
    manifest = planned.model_copy(update={"shards": writer.shards})
    write_manifest(out, manifest)  # the commit point: readers see the old shards or all of the new ones
    for stale in out.iterdir():
        if SHARD_NAME.match(stale.name) and stale.name not in {s.file for s in manifest.shards}:
            stale.unlink()
    fsync_dir(out)
    return manifest, True


def describe(manifest: Manifest, out: Path) -> str:
    return (f"{len(manifest.shards)} shard(s), {manifest.total_tokens:,} {manifest.dtype} tokens of "
            f"{sum(s.documents for s in manifest.shards):,} documents from {len(manifest.inputs)} input file(s) "
            f"in {out} ({FILE})")
