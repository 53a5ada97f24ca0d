"""Run configuration shared by the learner, the syncer, the local runtime and the operator.

Torch-free on purpose: the operator validates and forwards these models without importing torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

Compression = Literal["none", "bf16", "int8", "int4"]
Device = Literal["cpu", "cuda", "xla", "auto"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Strict):
    """A decoder-only transformer over a byte vocabulary."""

    vocab_size: int = Field(256, ge=2, le=1_048_576, description="Token ids 0..vocab_size-1 (at most 2^20).")
    seq_len: int = Field(128, ge=8, le=1_048_576, description="Context length in tokens (8 to 1,048,576).")
    d_model: int = Field(128, ge=8, le=65536, description="Model width (8 to 65536).")
    n_layers: int = Field(4, ge=1, le=1024, description="Transformer blocks (1 to 1024).")
    n_heads: int = Field(4, ge=1, le=1024, description="Attention heads (1 to 1024), dividing d_model.")
    mlp_ratio: int = Field(4, ge=1, le=64, description="MLP width as a multiple of d_model (1 to 64).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "ModelConfig":
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        return self


MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(seq_len=64, d_model=64, n_layers=2, n_heads=2),  # ~0.1M: tests
    "small": ModelConfig(seq_len=128, d_model=128, n_layers=4, n_heads=4),  # ~0.8M: default local run
    "base": ModelConfig(seq_len=256, d_model=384, n_layers=6, n_heads=6),  # ~11M
    "100m": ModelConfig(seq_len=512, d_model=768, n_layers=14, n_heads=12),  # ~100M
}


# Parameter tensors of model.GPT: token and position embeddings, the final norm's weight and bias (4), and per
# block two norms' weights and biases, qkv, proj and the MLP's two matrices (8). The output head is tied.
TENSORS_FIXED = 4
TENSORS_PER_LAYER = 8


def tensor_count(model: ModelConfig) -> int:
    """How many parameter tensors the model of this config has (what fragments split), without torch."""
    return TENSORS_FIXED + TENSORS_PER_LAYER * model.n_layers


class DataConfig(_Strict):
    """Where tokens come from. 'stdlib' is the Python standard library's own source: on every machine."""

    source: Literal["stdlib", "folder", "tokens"] = "stdlib"
    path: str | None = None  # folder of text files, or a .npy/.bin uint8/uint16 token file
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5)
    # Cap on corpus size (tests use a small one); the corpus is held in memory, so at most 10^11.
    max_bytes: int | None = Field(None, ge=1024, le=10**11, description="Cap on corpus bytes (1024 to 10^11).")

    @model_validator(mode="after")
    def _path_when_needed(self) -> "DataConfig":
        if self.source != "stdlib" and not self.path:
            raise ValueError(f"data.path is required when data.source is {self.source!r}")
        return self


class InnerConfig(_Strict):
    """The learner's own optimizer (AdamW) and batch."""

    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    warmup_steps: int = Field(20, ge=0, le=1_000_000, description="Linear warmup steps (0 to 1,000,000).")
    grad_clip: float = Field(1.0, gt=0)
    batch_size: int = Field(16, ge=1, le=65536, description="Sequences per inner step and learner (1 to 65536).")


class OuterConfig(_Strict):
    """Decoupled DiLoCo synchronization: fragments, schedule, compression, merge and outer Nesterov."""

    fragments: int = Field(4, ge=1, le=1024, description="P: fragments (1 to 1024, and at most the model's "
                                                         "parameter tensors, 4 + 8 x model.n_layers).")
    sync_every: int = Field(16, ge=1, le=100_000, description="H: inner steps between two sends of the same "
                                                              "fragment (1 to 100,000).")
    overlap: int = Field(2, ge=0, le=100_000, description="tau: steps a merged fragment is expected to take to "
                                                          "come back (0 to 100,000, less than sync_every).")
    compression: Compression = "int4"
    block_size: int = Field(64, ge=8, le=65536, description="Quantization block of int8/int4 (8 to 65536).")
    lr: float = Field(0.7, gt=0)  # eta
    momentum: float = Field(0.9, ge=0, lt=1)  # mu
    quorum: int = Field(1, ge=1, le=10000, description="K: contributions a merge waits for (1 to 10000).")
    grace: float = Field(0.5, ge=0, lt=1)  # gamma; 0 disables the grace window
    merge: Literal["rda", "mean"] = "rda"
    token_weights: bool = True
    # Older bases are rejected; the learner re-adopts.
    versions_kept: int = Field(8, ge=1, le=1024, description="Versions of each fragment kept (1 to 1024).")
    # How learners fetch new fragment versions. fp32: whole versions. bf16: whole versions rounded (half the
    # bytes; learners train from rounded values). int8/int4/int2: the syncer publishes each version as a
    # blockwise quantized update with its own error feedback, and a learner holding the previous version rebuilds
    # the new one bit-identically from it (see downlink.py); a new or far-behind learner gets the full fragment.
    downlink: Literal["fp32", "bf16", "int8", "int4", "int2"] = "fp32"
    # What a learner does with its own progress on a fragment when it adopts a newer global version of it:
    # "overwrite" drops what it trained since its last send (the paper), "keep" carries it on top of the new
    # version into its next send (see outer_sync.py; the benchmark that chose the default: docs/benchmarks.md).
    adopt: Literal["keep", "overwrite"] = "overwrite"
    # With adopt=keep: the share rho of that progress carried (streaming DiLoCo's mixing; 1 = all of it).
    keep_fraction: float = Field(1.0, gt=0.0, le=1.0, description="rho: share of the unsent progress adopt=keep "
                                                                   "carries over an adoption (0 < rho <= 1).")

    @model_validator(mode="after")
    def _overlap_below_sync_every(self) -> "OuterConfig":
        # A fragment sent every H steps cannot be expected back later than its next send.
        if self.overlap >= self.sync_every:
            raise ValueError(f"outer.overlap ({self.overlap}) must be less than outer.sync_every ({self.sync_every})")
        return self


class SyncerConfig(_Strict):
    """How the syncer is run: the global model's fragments split across `shards` syncer processes (shardmap.py)."""

    shards: int = Field(1, ge=1, le=1024, description="N: syncer shards; shard i owns fragments p with p mod N = i "
                                                      "(1 to 1024, and at most outer.fragments).")


class TrainConfig(_Strict):
    """Everything one training run needs; the syncer hands it to every learner that registers."""

    model: ModelConfig = Field(default_factory=lambda: MODEL_PRESETS["small"].model_copy())
    data: DataConfig = Field(default_factory=DataConfig)
    inner: InnerConfig = Field(default_factory=InnerConfig)
    outer: OuterConfig = Field(default_factory=OuterConfig)
    syncer: SyncerConfig = Field(default_factory=SyncerConfig)
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed of the initial parameters and data order (0 to 2^32-1).")

    @model_validator(mode="after")
    def _fragments_fit_the_model(self) -> "TrainConfig":
        tensors = tensor_count(self.model)
        if self.outer.fragments > tensors:
            raise ValueError(f"outer.fragments ({self.outer.fragments}) must not exceed the model's {tensors} "
                             f"parameter tensors ({TENSORS_FIXED} + {TENSORS_PER_LAYER} x model.n_layers): "
                             "every fragment holds at least one tensor")
        if self.syncer.shards > self.outer.fragments:
            raise ValueError(f"syncer.shards ({self.syncer.shards}) must not exceed outer.fragments "
                             f"({self.outer.fragments}): every shard owns at least one fragment")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> "TrainConfig":
        """Load a config file; unknown or invalid fields raise a ValueError naming the field."""
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if isinstance(raw.get("model"), str):
            raw["model"] = MODEL_PRESETS[raw["model"]].model_dump()
        return cls.model_validate(raw)
