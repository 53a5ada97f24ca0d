"""Hugging Face transformers causal LMs, from an inline config or a local directory, behind the built-in GPT's
interface: forward(idx, targets) -> (logits, loss). Local files only: this module never lets transformers reach the
network (HF_HUB_OFFLINE is set before transformers is imported)."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from diloco_trainer.config import HFModelConfig, ModelConfig  # noqa: E402

PREFIX = "hf."  # parameter names of a CausalLM are the transformers model's own behind this prefix


class CausalLM(nn.Module):
    """A transformers causal LM as `self.hf`; logits for every position and, with targets (already shifted, as the
    samplers give them), the mean next-token cross-entropy computed here (fp32), as the GPT does."""

    def __init__(self, hf_model: nn.Module, seq_len: int):
        super().__init__()
        self.hf = hf_model
        self.seq_len = seq_len
        self.vocab_size = int(hf_model.config.vocab_size)
        self.train()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        if idx.shape[1] > self.seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens is longer than model.seq_len={self.seq_len}")
        logits = self.hf(input_ids=idx, use_cache=False).logits
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss


def _accepted_keys(config_class: type) -> set[str]:
    """Every keyword a transformers config class takes: its (and its bases') __init__ parameters and aliases."""
    keys: set[str] = set()
    for cls in config_class.__mro__:
        init = cls.__dict__.get("__init__")
        if init is not None:
            keys.update(n for n, p in inspect.signature(init).parameters.items()
                        if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
        keys.update(getattr(cls, "attribute_map", {}) or {})
    return keys


def inline_config(cfg: HFModelConfig):
    """AutoConfig.for_model(model_type, **fields); an unknown type or field is a ValueError naming model.hf.<field>."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if cfg.model_type not in CONFIG_MAPPING:
        raise ValueError(f"model.hf.model_type {cfg.model_type!r} is not a model type of transformers")
    kwargs = cfg.kwargs()
    known = _accepted_keys(CONFIG_MAPPING[cfg.model_type])
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"model.hf.{unknown[0]} is not a field of {CONFIG_MAPPING[cfg.model_type].__name__} "
                         f"(model.hf.model_type {cfg.model_type!r})")
    try:
        return AutoConfig.for_model(cfg.model_type, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"model.hf: {exc}") from exc


def _check_positions(hf_config, cfg: ModelConfig, where: str) -> None:
    limit = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
    if limit is not None and cfg.seq_len > limit:
        raise ValueError(f"model.seq_len ({cfg.seq_len}) exceeds {where}'s max_position_embeddings ({limit})")


def from_inline(cfg: ModelConfig) -> CausalLM:
    """A freshly initialised model of `cfg.hf` (the caller seeds torch's generator: same seed, same Θ₀)."""
    from transformers import AutoModelForCausalLM

    hf_config = inline_config(cfg.hf)
    _check_positions(hf_config, cfg, "model.hf")
    try:
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    except ValueError as exc:
        raise ValueError(f"model.hf.model_type {cfg.hf.model_type!r} has no causal language model: {exc}") from exc
    return CausalLM(model, cfg.seq_len)


def from_directory(cfg: ModelConfig) -> CausalLM:
    """The model saved in `cfg.path` (config.json + safetensors), in fp32, from local files only."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(cfg.path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model.path {cfg.path!r} has no config.json: give a directory saved with "
                         "save_pretrained (config.json + model.safetensors)")
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    _check_positions(hf_config, cfg, f"model.path {cfg.path!r}")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True,
                                                     dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model.path {cfg.path!r}: {exc}") from exc
    return CausalLM(model, cfg.seq_len)
