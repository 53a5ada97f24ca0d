"""One rank of a two-process learner unit, for tests (run as a script with RANK/WORLD_SIZE/MASTER_* set): an
InnerStep over gloo trains on a batch of its own, rank 0 writes a fragment as an adoption does, the unit trains on,
and each rank saves what it holds (safetensors) for the test to compare."""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from diloco_trainer.config import MODEL_PRESETS, TrainConfig
from diloco_trainer.learner.devices import UnitGroup
from diloco_trainer.learner.inner_step import InnerStep
from diloco_trainer.model.build import build_model

ADOPTED = ["tok_emb.weight", "blocks.0.attn.qkv.weight", "blocks.1.ln2.bias"]


def adopted_value(shape: torch.Size, name: str) -> torch.Tensor:
    """What 'the syncer' published for `name` in this test: distinct values, so a misplaced slice shows."""
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) * 1e-4 + len(name)


def main(out: Path, inner: dict) -> None:
    torch.set_num_threads(1)
    group = UnitGroup.from_env(torch.device("cpu"))
    cfg = TrainConfig(model=MODEL_PRESETS["tiny"], inner={"batch_size": 4, **inner})
    model = build_model(cfg.model, cfg.seed)
    step = InnerStep(model, cfg, torch.device("cpu"), group)
    names = [n for n, _ in model.named_parameters()]
    gen = torch.Generator().manual_seed(100 + group.rank)  # every rank its own batch, as in a unit
    losses = []

    def train(steps: int) -> None:
        for _ in range(steps):
            x = torch.randint(0, 256, (4, cfg.model.seq_len + 1), generator=gen)
            losses.append(step.step(x[:, :-1], x[:, 1:], 1e-3))

    train(3)
    with step.full(ADOPTED, write_back=True) as full:
        if group.is_main:
            with torch.no_grad():
                for n in ADOPTED:
                    full[n].copy_(adopted_value(full[n].shape, n))
    with step.full(ADOPTED) as full:
        save_file({n: full[n].clone().contiguous() for n in ADOPTED}, out / f"adopted-rank{group.rank}.safetensors")
    train(2)
    with step.full(names) as full:
        save_file({n: full[n].clone().contiguous() for n in names}, out / f"params-rank{group.rank}.safetensors")
    (out / f"losses-rank{group.rank}.json").write_text(json.dumps(losses))
    group.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
