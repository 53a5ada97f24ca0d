"""manifest.json of a directory of token shards: which tokenizer made them, their type and token counts, and the
inputs they came from (what `diloco data prepare` compares to decide a re-run is a no-op). Torch-free."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from diloco_trainer.fsutil import atomic_write

FILE = "manifest.json"
FORMAT = "diloco-token-shards/1"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ShardEntry(_Strict):
    """One file of tokens, raw little-endian `dtype` values, documents separated by `eos_id`."""

    file: str = Field(description="File name inside the shard directory.")
    tokens: int = Field(ge=0)
    documents: int = Field(ge=0, description="Documents that end in this shard.")


class InputFile(_Strict):
    """What an input file looked like when it was tokenized."""

    path: str
    size: int = Field(ge=0)
    mtime_ns: int


class Manifest(_Strict):
    format: Literal["diloco-token-shards/1"] = FORMAT
    tokenizer: str = Field(description="'bytes' or the tokenizer.json path the shards were made with.")
    tokenizer_fingerprint: str = Field(description="'bytes' or sha256 of the tokenizer.json file.")
    vocab_size: int = Field(ge=2)
    dtype: Literal["uint16", "uint32"]
    eos_id: int | None = Field(None, description="Token after every document, if the tokenizer has one.")
    text_field: str = Field(description="The field of JSONL/Parquet records holding the text.")
    sample_by: Literal["document", "paragraph", "line"] = Field(
        "document", description="What one document of a plain text file is.")
    shard_tokens: int = Field(ge=1, description="Tokens per shard (the last one holds the rest).")
    inputs: list[InputFile]
    shards: list[ShardEntry]

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def recipe(self) -> dict:
        """Everything the shards' content depends on: equal recipes mean a re-run would write the same files."""
        return self.model_dump(include={"format", "tokenizer_fingerprint", "dtype", "text_field", "sample_by",
                                     "shard_tokens", "inputs"})


def read_manifest(folder: Path) -> Manifest | None:
    """The manifest of a shard directory, None if it has none; a damaged one raises ValueError naming it, and so
    does one naming a shard file outside the directory (see confine)."""
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    try:
        manifest = Manifest.model_validate(json.loads(path.read_text()))
    except (ValueError, ValidationError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path} is not a valid token-shard manifest: {exc}") from exc
    for i, entry in enumerate(manifest.shards):
        confine(Path(folder), entry.file, f"{path}: shards[{i}].file {entry.file!r}")
    return manifest


def confine(folder: Path, name: str, where: str) -> Path:
    """folder / name, refused unless it stays inside folder: a relative path without '..', that does not lead out
    through a symlink (the file's or a parent folder's). A manifest is data: whoever writes the shard directory must
    not make a reader open (and train on, i.e. leak into the model) files elsewhere (issue 38)."""
    pure = PurePosixPath(name)
    if pure.is_absolute() or Path(name).is_absolute():
        raise ValueError(f"{where} is an absolute path, outside the shard directory {folder}: name files relative "
                         "to it")
    if ".." in pure.parts or ".." in Path(name).parts:
        raise ValueError(f"{where} names '..', which may lead outside the shard directory {folder}: name files "
                         "relative to it, without '..'")
    target = (folder / name).resolve()
    root = folder.resolve()
    if not target.is_relative_to(root):
        raise ValueError(f"{where} leads outside the shard directory {root} through a symlink (to {target})")
    return folder / name


# Shards, manifests and tokenizers are data that learner and syncer pods read under another user (the images run
# as UID 10001): readable by all, writable by their owner, unlike the 0600 of private state files.
READABLE = 0o644


def write_manifest(folder: Path, manifest: Manifest) -> None:
    """Crash-safe: a reader sees the old manifest or the new one."""
    atomic_write(Path(folder) / FILE, manifest.model_dump_json(indent=1).encode(), mode=READABLE)
