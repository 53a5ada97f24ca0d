"""One rank of a two-process FSDP2 unit, for tests (RANK/WORLD_SIZE/MASTER_* set): AdamW's state gathered to full
tensors and saved by rank 0 as the learner's inner-state snapshot, then restored into a fresh unit as the learner does
it (rank 0 reads, the unit receives it, each rank keeps its slice) and gathered again; both written per rank."""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from diloco_trainer.config import MODEL_PRESETS, TrainConfig
from diloco_trainer.learner import inner_state
from diloco_trainer.learner.devices import UnitGroup
from diloco_trainer.learner.inner_step import InnerStep
from diloco_trainer.model.build import build_model

CPU = torch.device("cpu")


def main(out: Path) -> None:
    torch.set_num_threads(1)
    group = UnitGroup.from_env(CPU)
    cfg = TrainConfig(model=MODEL_PRESETS["tiny"], inner={"batch_size": 4, "parallel": "fsdp"})
    unit = InnerStep(build_model(cfg.model, cfg.seed), cfg, CPU, group)
    gen = torch.Generator().manual_seed(100 + group.rank)
    for _ in range(3):
        x = torch.randint(0, 256, (4, cfg.model.seq_len + 1), generator=gen)
        unit.step(x[:, :-1], x[:, 1:], 1e-3)
    saved = unit.optimizer_state()
    path = out / inner_state.FILE
    if group.is_main:
        inner_state.save(path, saved, None, steps=3)
    group.broadcast_json(None)  # the file is written before anyone reads it

    fresh = InnerStep(build_model(cfg.model, cfg.seed + 1), cfg, CPU, group)
    found = inner_state.read(path, fresh.opt, dict(fresh.model.named_parameters())) if group.is_main else None
    template = inner_state.optimizer_template(fresh.opt)
    tensors = found.tensors if found else template
    group.broadcast_tensors([tensors[k] for k in sorted(template)])
    inner_state.restore(fresh.opt, None, fresh.local_optimizer_state(tensors))
    restored = fresh.optimizer_state()
    for name, state in (("saved", saved), ("restored", restored)):
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / f"{name}-rank{group.rank}.safetensors"))
    group.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
