"""Run configuration shared by the learner, the syncer, the local runtime and the operator.

Torch-free on purpose: the operator validates and forwards these models without importing torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

Compression = Literal["none", "bf16", "int8", "int4"]
Device = Literal["cpu", "cuda", "xla", "auto"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Fields of the built-in GPT only; another model kind gets its sizes from its own config.
GPT_ONLY_FIELDS = ("d_model", "n_layers", "n_heads", "mlp_ratio", "dropout")
ModelKind = Literal["gpt", "hf", "path", "entrypoint"]


class HFModelConfig(BaseModel):
    """A Hugging Face transformers config given inline: `model_type` plus any field of that type's config class
    (`AutoConfig.for_model`). The common sizes are checked here; the rest when the model is built."""

    model_config = ConfigDict(extra="allow")

    model_type: str = Field(..., min_length=1, max_length=64, pattern=r"^[a-z0-9_]+$",
                            description="A transformers model type, e.g. llama, qwen2, gpt2, mistral.")
    vocab_size: int = Field(..., ge=2, le=1_048_576, description="Token ids 0..vocab_size-1: the tokenizer's size.")
    hidden_size: int | None = Field(None, ge=1, le=65536)
    num_hidden_layers: int | None = Field(None, ge=1, le=1024)
    num_attention_heads: int | None = Field(None, ge=1, le=1024)
    num_key_value_heads: int | None = Field(None, ge=1, le=1024)
    intermediate_size: int | None = Field(None, ge=1, le=1_048_576)
    max_position_embeddings: int | None = Field(None, ge=1, le=1_048_576)
    tie_word_embeddings: bool | None = None

    @model_validator(mode="after")
    def _heads_fit(self) -> "HFModelConfig":
        width, heads, kv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        if width and heads and width % heads and "head_dim" not in (self.model_extra or {}):
            raise ValueError(f"model.hf.hidden_size ({width}) must be divisible by model.hf.num_attention_heads "
                             f"({heads}), or give model.hf.head_dim")
        if heads and kv and heads % kv:
            raise ValueError(f"model.hf.num_attention_heads ({heads}) must be a multiple of "
                             f"model.hf.num_key_value_heads ({kv})")
        return self

    @model_serializer(mode="wrap")
    def _without_unset_sizes(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}

    def kwargs(self) -> dict:
        """The keyword arguments for AutoConfig.for_model (model_type apart, unset sizes left to its defaults)."""
        return {k: v for k, v in self.model_dump(exclude={"model_type"}).items()}


class ModelConfig(_Strict):
    """What a learner trains: the built-in GPT (default), a transformers causal LM, or a user's module.

    The GPT is a decoder-only transformer over bytes sized by the fields below; with `hf` a transformers causal LM
    from an inline config, with `path` one from a local directory (config.json + safetensors), with `entrypoint` a
    user's own module (docs/models.md)."""

    vocab_size: int = Field(256, ge=2, le=1_048_576, description="Token ids 0..vocab_size-1 (at most 2^20).")
    seq_len: int = Field(128, ge=8, le=1_048_576, description="Context length in tokens (8 to 1,048,576).")
    d_model: int = Field(128, ge=8, le=65536, description="Model width (8 to 65536).")
    n_layers: int = Field(4, ge=1, le=1024, description="Transformer blocks (1 to 1024).")
    n_heads: int = Field(4, ge=1, le=1024, description="Attention heads (1 to 1024), dividing d_model.")
    mlp_ratio: int = Field(4, ge=1, le=64, description="MLP width as a multiple of d_model (1 to 64).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    hf: HFModelConfig | None = Field(None, description="A transformers config given inline (model_type, sizes).")
    path: str | None = Field(None, min_length=1, max_length=4096,
                             description="A local directory with config.json and safetensors weights to continue.")
    entrypoint: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$",
                                   description="A user's builder, 'pkg.module:build', returning an nn.Module.")
    options: dict[str, Any] | None = Field(None, description="Keyword arguments for the entrypoint's builder.")

    @property
    def kind(self) -> ModelKind:
        return "hf" if self.hf is not None else "path" if self.path else "entrypoint" if self.entrypoint else "gpt"

    @model_validator(mode="after")
    def _one_kind(self) -> "ModelConfig":
        chosen = [k for k in ("hf", "path", "entrypoint") if getattr(self, k) is not None]
        if len(chosen) > 1:
            raise ValueError(f"model.{chosen[0]} and model.{chosen[1]} exclude each other: choose one model")
        if chosen:
            kind = chosen[0]
            stray = [f for f in GPT_ONLY_FIELDS if f in self.model_fields_set]
            if kind != "entrypoint" and "vocab_size" in self.model_fields_set:
                stray.insert(0, "vocab_size")
            if stray:
                where = {"hf": "in model.hf (e.g. model.hf.vocab_size, model.hf.hidden_size)",
                         "path": "in the checkpoint's config.json", "entrypoint": "in model.options"}[kind]
                raise ValueError(f"model.{stray[0]} applies to the built-in GPT only; with model.{kind} give it "
                                 f"{where}")
            if self.options is not None and kind != "entrypoint":
                raise ValueError("model.options applies only with model.entrypoint")
            if self.hf is not None and self.hf.max_position_embeddings is not None \
                    and self.seq_len > self.hf.max_position_embeddings:
                raise ValueError(f"model.seq_len ({self.seq_len}) must not exceed "
                                 f"model.hf.max_position_embeddings ({self.hf.max_position_embeddings})")
        elif self.options is not None:
            raise ValueError("model.options applies only with model.entrypoint")
        elif self.d_model % self.n_heads:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        return self

    @model_serializer(mode="wrap")
    def _only_what_applies(self, handler):
        """Dump only the fields of this model's kind, so a dump validates again (and GPT dumps stay as before)."""
        data = handler(self)
        for key in ("hf", "path", "entrypoint", "options"):
            if data.get(key) is None:
                data.pop(key, None)
        if self.kind != "gpt":
            for key in GPT_ONLY_FIELDS + (() if self.kind == "entrypoint" else ("vocab_size",)):
                data.pop(key, None)
        return data


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


def tensor_count(model: ModelConfig) -> int | None:
    """How many parameter tensors the model of this config has (what fragments split), without torch; None when
    only building the model can tell (every kind but the built-in GPT: the syncer checks at its start)."""
    if model.kind != "gpt":
        return None
    return TENSORS_FIXED + TENSORS_PER_LAYER * model.n_layers


class DataConfig(_Strict):
    """Where tokens come from. 'stdlib' is the Python standard library's own source: on every machine.
    'shards' reads pre-tokenized .bin/.npy files memory-mapped (docs/data.md)."""

    source: Literal["stdlib", "folder", "tokens", "shards"] = "stdlib"
    # folder of text files; a .npy/.bin token file; or (shards) a directory or glob of .bin/.npy token files
    path: str | None = None
    # "bytes" (token id == byte value) or the path of a Hugging Face `tokenizers` file (tokenizer.json) that turns
    # the text of the stdlib/folder sources into tokens; with 'shards', checked against the manifest's tokenizer.
    tokenizer: str = Field("bytes", min_length=1, max_length=4096, description="'bytes' or the path of a tokenizer.json file.")
    # Token type of raw .bin shards when no manifest.json says it (shards prepared by `diloco data prepare` have one).
    dtype: Literal["uint16", "uint32"] | None = None
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5)
    # Cap on corpus size (tests use a small one); the corpus is held in memory, so at most 10^11.
    max_bytes: int | None = Field(None, ge=1024, le=10**11, description="Cap on corpus bytes (1024 to 10^11).")

    @model_validator(mode="after")
    def _path_when_needed(self) -> "DataConfig":
        if self.source != "stdlib" and not self.path:
            raise ValueError(f"data.path is required when data.source is {self.source!r}")
        if self.source == "tokens" and self.tokenizer != "bytes":
            raise ValueError("data.tokenizer applies to text (data.source stdlib or folder) and to shards; "
                             "a data.source 'tokens' file is already tokenized")
        if self.source == "shards" and self.max_bytes is not None:
            raise ValueError("data.max_bytes caps text corpora held in memory; shards are memory-mapped, not capped")
        return self

    @property
    def token_unit(self) -> str:
        """What a token is, for losses in reports (nats per it): 'byte' for text read with the byte tokenizer, else
        'token' (a tokenizer.json, or token files and shards, which may hold any tokenizer's ids)."""
        return "byte" if self.tokenizer == "bytes" and self.source in ("stdlib", "folder") else "token"


class InnerConfig(_Strict):
    """The learner's own optimizer (AdamW) and batch."""

    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    warmup_steps: int = Field(20, ge=0, le=1_000_000, description="Linear warmup steps (0 to 1,000,000).")
    grad_clip: float = Field(1.0, gt=0)
    batch_size: int = Field(16, ge=1, le=65536, description="Sequences per inner step and learner (1 to 65536).")
    micro_batches: int = Field(1, ge=1, le=65536, description="Gradient accumulation: the batch is trained in this "
                                                              "many equal micro-batches (dividing batch_size); the "
                                                              "step equals the full-batch step.")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="fp32, or bf16 autocast on the device (master "
                                                                  "weights, outer state and outer gradients stay fp32).")
    parallel: Literal["ddp", "fsdp"] = Field("ddp", description="Inside a multi-process unit: DistributedDataParallel "
                                                               "(a full replica per process) or FSDP2 (fully_shard: "
                                                               "parameters, gradients and AdamW state sharded).")
    compile: bool = Field(False, description="Run the model through torch.compile.")

    @model_validator(mode="after")
    def _micro_batches_divide_the_batch(self) -> "InnerConfig":
        if self.batch_size % self.micro_batches:
            raise ValueError(f"inner.micro_batches ({self.micro_batches}) must divide inner.batch_size "
                             f"({self.batch_size})")
        return self


class OuterConfig(_Strict):
    """Decoupled DiLoCo synchronization: fragments, schedule, compression, merge and outer Nesterov."""

    fragments: int = Field(4, ge=1, le=1024, description="P: fragments (1 to 1024, and at most the model's "
                                                         "parameter tensors; the built-in GPT has 4 + 8 x model.n_layers).")
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
    # A merge whose contributions are based on an older version than the current one (others' work merged since)
    # is applied with its share of the weight merged since then, W / (W + S) (merge.late_share): a round of learners
    # split over two merges ends at the weighted average of all of them, as one merge would. Off: re-anchored
    # contributions move Θ by their full size (the paper's App. D.2), so at outer lr 1 the last merge wins.
    late_share: bool = True
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

    # A learner that (re)starts while others train sends each fragment first when the others next will (they
    # adopted its current version when the syncer published it and send H steps later), so its Δ joins their merge;
    # off: after its fragment offset, as a learner starting with the job does (measured: docs/benchmarks.md).
    align_first_sends: bool = True

    # One learner's update norm, per tensor, against max_norm_ratio x the recent accepted ones (and an absolute
    # sanity bound; syncer/merge.py, docs/security.md): "clip" scales it down to the bound (accepted with a note),
    # "reject" refuses the submission (400), "none" trusts every learner.
    update_bound: Literal["clip", "reject", "none"] = "clip"
    max_norm_ratio: float = Field(10.0, gt=1.0, le=1e6, description="A contribution's update norm, per tensor, may be "
                                                                   "at most this many times the recent median.")
    # The grace window after quorum never exceeds this (the learners' step time it is sized from is reported by them).
    max_grace_s: float = Field(600.0, gt=0.0, le=86400.0, description="Longest grace window in seconds.")

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
        if tensors is not None and self.outer.fragments > tensors:
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
