"""`diloco export CHECKPOINT [CHECKPOINT ...] --format hf OUT`: the syncer's global Θ as a directory that
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads, with the same logits as the trainer's forward.
Transformers models are saved as they are; the built-in GPT maps exactly onto GPT-2 (gpt2_map.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from diloco_trainer.config import TrainConfig


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", nargs="+", type=Path, metavar="CHECKPOINT",
                        help="a syncer --state-dir, its checkpoint/ directory, or diloco local's final/ directory; "
                             "for a sharded syncer, every shard's state dir")
    parser.add_argument("out", type=Path, metavar="OUT", help="the directory to write (created; must be empty)")
    parser.add_argument("--format", choices=("hf",), default="hf", help="hf: a transformers model directory")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a tokenizers tokenizer.json saved alongside as a PreTrainedTokenizerFast")


def run(args: argparse.Namespace) -> int:
    try:
        written = export_hf(args.checkpoint, args.out, args.tokenizer)
    except ValueError as exc:
        print(f"diloco export: {exc}")
        return 2
    print(f"diloco export: wrote {written} to {args.out}")
    return 0


def checkpoint_dir(source: Path) -> Path:
    """The directory holding the checkpoint to export: for a syncer's --state-dir, the newest whole one (a damaged
    checkpoint/ is passed over for checkpoint.old/, as the syncer itself would: syncer/store.load_checkpoint);
    else SOURCE itself (a checkpoint directory, or diloco local's final/)."""
    from diloco_trainer.syncer.store import LATEST, PREVIOUS, load_checkpoint

    if (source / LATEST).is_dir() or (source / PREVIOUS).is_dir():
        loaded = load_checkpoint(source)  # ValueError naming each damaged directory if none is whole
        if loaded is not None:
            for why in loaded.damaged:
                print(f"diloco export: passed over a damaged checkpoint ({why}); exporting {loaded.path}")
            return loaded.path
    if (source / "theta.safetensors").is_file() and (source / "state.json").is_file():
        return source
    raise ValueError(f"{source} holds no checkpoint (theta.safetensors + state.json, itself or in checkpoint/)")


def read_global_theta(sources: list[Path]) -> tuple[dict[str, torch.Tensor], TrainConfig]:
    """Θ and the run config from one checkpoint, or from every shard's of a sharded syncer (same run)."""
    from safetensors.torch import load_file

    theta: dict[str, torch.Tensor] = {}
    config = None
    for source in sources:
        d = checkpoint_dir(source)
        saved = json.loads((d / "state.json").read_text())["config"]
        if config is not None and saved != config:
            raise ValueError(f"{source} belongs to another run than {sources[0]} (its config differs)")
        config = saved
        theta |= load_file(str(d / "theta.safetensors"))
    return theta, TrainConfig.model_validate(config)


def load_theta(model: nn.Module, theta: dict[str, torch.Tensor]) -> None:
    """Write Θ into the model's parameters in place (a tied tensor once, so it stays tied)."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(theta))
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} of the model's tensors (e.g. {missing[:3]}); "
                         "for a sharded syncer give every shard's state dir")
    extra = sorted(set(theta) - set(params))
    if extra:
        raise ValueError(f"the checkpoint has tensors the model does not (e.g. {extra[:3]}): another model's")
    with torch.no_grad():
        for name, p in params.items():
            if tuple(theta[name].shape) != tuple(p.shape):
                raise ValueError(f"{name}: the checkpoint's shape {tuple(theta[name].shape)} is not the model's "
                                 f"{tuple(p.shape)}")
            p.copy_(theta[name])


def check_exportable(cfg: TrainConfig) -> None:
    """Refuse a model with no transformers form, from the config alone: a checkpoint's state.json is data, so a
    model.entrypoint it names is never imported (importing a module runs its code; issue 38)."""
    if cfg.model.kind not in ("hf", "path", "gpt"):
        raise ValueError(f"the checkpoint's model is model.entrypoint {cfg.model.entrypoint!r} (not imported): "
                         "--format hf needs a transformers model (model.hf, model.path) or the built-in GPT; a "
                         "model from model.entrypoint has no transformers form: read theta.safetensors with your "
                         "own code")


def hf_model_of(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """The transformers model that computes what `model` computes."""
    check_exportable(cfg)
    if cfg.model.kind in ("hf", "path"):
        return model.hf
    from diloco_trainer.model.gpt2_map import gpt_to_gpt2

    return gpt_to_gpt2(model)


def export_hf(sources: list[Path], out: Path, tokenizer: Path | None = None) -> str:
    """Write OUT (config.json, model.safetensors and, with a tokenizer, its files); returns what was written."""
    from diloco_trainer.model import hf as _offline  # noqa: F401 - sets HF_HUB_OFFLINE before transformers loads
    from diloco_trainer.model.build import build_model

    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty")
    if tokenizer is not None and not tokenizer.is_file():
        raise ValueError(f"--tokenizer {tokenizer}: no such file")
    theta, cfg = read_global_theta(sources)
    check_exportable(cfg)  # before build_model: it would import an entrypoint's module
    model = build_model(cfg.model, cfg.seed)
    load_theta(model, theta)
    hf_model = hf_model_of(model, cfg).eval()
    out.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(out)
    what = f"a {type(hf_model).__name__}"
    if tokenizer is not None:
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast(tokenizer_file=str(tokenizer)).save_pretrained(out)
        what += " and its tokenizer"
    return what
