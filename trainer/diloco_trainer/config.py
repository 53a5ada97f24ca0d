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

    vocab_size: int = Field(256, ge=2)
    seq_len: int = Field(128, ge=8)
    d_model: int = Field(128, ge=8)
    n_layers: int = Field(4, ge=1)
    n_heads: int = Field(4, ge=1)
    mlp_ratio: int = Field(4, ge=1)
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


class DataConfig(_Strict):
    """Where tokens come from. 'stdlib' is the Python standard library's own source: on every machine."""

    source: Literal["stdlib", "folder", "tokens"] = "stdlib"
    path: str | None = None  # folder of text files, or a .npy/.bin uint8/uint16 token file
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5)
    max_bytes: int | None = Field(None, ge=1024)  # cap on corpus size (tests use a small one)

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
    warmup_steps: int = Field(20, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    batch_size: int = Field(16, ge=1)


class OuterConfig(_Strict):
    """Decoupled DiLoCo synchronization: fragments, schedule, compression, merge and outer Nesterov."""

    fragments: int = Field(4, ge=1)  # P
    sync_every: int = Field(16, ge=1)  # H inner steps between two sends of the same fragment
    overlap: int = Field(2, ge=0)  # tau: steps a merged fragment is expected to take to come back
    compression: Compression = "int4"
    block_size: int = Field(64, ge=8)  # quantization block (int8 / int4)
    lr: float = Field(0.7, gt=0)  # eta
    momentum: float = Field(0.9, ge=0, lt=1)  # mu
    quorum: int = Field(1, ge=1)  # K
    grace: float = Field(0.5, ge=0, lt=1)  # gamma; 0 disables the grace window
    merge: Literal["rda", "mean"] = "rda"
    token_weights: bool = True
    versions_kept: int = Field(8, ge=1)  # older bases are rejected; the learner re-adopts
    # How learners fetch new fragment versions: fp32 (exact) or bf16 (half the bytes of the down-link, which
    # carries every new version of every fragment and outweighs the int4 up-link ~13x; learners then train
    # from bf16-rounded values, the syncer keeps Θ in fp32).
    downlink: Literal["fp32", "bf16"] = "fp32"


class TrainConfig(_Strict):
    """Everything one training run needs; the syncer hands it to every learner that registers."""

    model: ModelConfig = Field(default_factory=lambda: MODEL_PRESETS["small"].model_copy())
    data: DataConfig = Field(default_factory=DataConfig)
    inner: InnerConfig = Field(default_factory=InnerConfig)
    outer: OuterConfig = Field(default_factory=OuterConfig)
    seed: int = 0

    @classmethod
    def from_yaml(cls, path: str | Path) -> "TrainConfig":
        """Load a config file; unknown or invalid fields raise a ValueError naming the field."""
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if isinstance(raw.get("model"), str):
            raw["model"] = MODEL_PRESETS[raw["model"]].model_dump()
        return cls.model_validate(raw)
