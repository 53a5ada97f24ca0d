"""The trainers' own AdamW against the reference, `torch.optim.AdamW`: the same parameters bit for bit, the same
state_dict layout both ways, and a learner process that trains without ever importing torch._dynamo."""

import subprocess
import sys

import pytest
import torch

from diloco_trainer.checkpoint import load_optimizer_tensors, optimizer_tensors
from diloco_trainer.config import MODEL_PRESETS, TrainConfig
from diloco_trainer.model.adamw import AdamW
from diloco_trainer.model.gpt import build_model
from diloco_trainer.model.optimizer import decay_groups, inner_optimizer

from learner_kit import ROOT, child_env


def _twins(foreach: bool | None = None):
    """Two identical tiny GPTs with the learner's two parameter groups, the first under this AdamW (the second's
    groups returned for the reference)."""
    models = [build_model(MODEL_PRESETS["tiny"], seed=0) for _ in range(2)]
    groups = [[{"params": d, "weight_decay": 0.1}, {"params": p, "weight_decay": 0.0}]
              for d, p in map(decay_groups, models)]
    return models, AdamW(groups[0], lr=3e-3, betas=(0.9, 0.95), foreach=foreach), groups[1]


def _train(model, opt, steps: int, lr_at=lambda step: None) -> None:
    g = torch.Generator().manual_seed(7)
    for step in range(1, steps + 1):
        if lr_at(step) is not None:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
        x = torch.randint(0, 256, (4, 32), generator=g)
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, x)
        loss.backward()
        opt.step()


@pytest.mark.parametrize("foreach", [False, True], ids=["per-tensor", "foreach"])
def test_every_parameter_and_moment_equals_torch_adamw_bit_for_bit(foreach):
    (mine, ref), opt, ref_groups = _twins(foreach)  # foreach: the path taken on CUDA, here on CPU tensors
    ref_opt = torch.optim.AdamW(ref_groups, lr=3e-3, betas=(0.9, 0.95), foreach=foreach)
    warmup = lambda step: 3e-3 * min(1.0, step / 4)  # noqa: E731 - lr changes between steps, as set_lr does
    _train(mine, opt, 6, warmup)
    _train(ref, ref_opt, 6, warmup)
    for (name, a), b in zip(mine.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    assert optimizer_tensors(opt).keys() == optimizer_tensors(ref_opt).keys()
    for key, value in optimizer_tensors(ref_opt).items():
        assert torch.equal(optimizer_tensors(opt)[key], value), key


def test_state_saved_by_either_optimizer_loads_into_the_other_and_training_continues_identically():
    (mine, ref), opt, ref_groups = _twins()
    ref_opt = torch.optim.AdamW(ref_groups, lr=3e-3, betas=(0.9, 0.95))
    _train(mine, opt, 3)
    _train(ref, ref_opt, 3)
    # Swap the states: each optimizer continues from what the other saved (a snapshot of an older learner version).
    saved_mine, saved_ref = optimizer_tensors(opt), optimizer_tensors(ref_opt)
    load_optimizer_tensors(opt, saved_ref)
    load_optimizer_tensors(ref_opt, saved_mine)
    assert all(torch.equal(optimizer_tensors(opt)[k], v) for k, v in saved_ref.items())
    saved_ref["opt.0.exp_avg"].add_(1.0)  # a loaded state is a copy, never an alias of what was loaded
    assert not torch.equal(optimizer_tensors(opt)["opt.0.exp_avg"], saved_ref["opt.0.exp_avg"])
    _train(mine, opt, 3)
    _train(ref, ref_opt, 3)
    for a, b in zip(mine.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_loading_a_state_of_other_parameter_groups_is_refused():
    _, opt, _ = _twins()
    with pytest.raises(ValueError, match="parameter groups"):
        opt.load_state_dict({"state": {}, "param_groups": [{"params": [0]}]})


def test_the_learners_optimizer_has_its_two_groups_and_steps_without_importing_dynamo():
    code = """
import sys, torch
from diloco_trainer.config import MODEL_PRESETS, TrainConfig
from diloco_trainer.model.gpt import build_model
from diloco_trainer.model.optimizer import inner_optimizer
model = build_model(MODEL_PRESETS["tiny"], seed=0)
opt, lr_at = inner_optimizer(model, TrainConfig(model=MODEL_PRESETS["tiny"]))
x = torch.zeros(1, 8, dtype=torch.long)
_, loss = model(x, x)
loss.backward()
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
opt.step()
opt.zero_grad(set_to_none=True)
assert len(opt.state) == len(list(model.parameters())), len(opt.state)
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "an inner step imported torch._dynamo"
    cfg = TrainConfig(model=MODEL_PRESETS["tiny"])
    opt, _ = inner_optimizer(build_model(cfg.model, seed=0), cfg)
    assert [g["weight_decay"] for g in opt.param_groups] == [cfg.inner.weight_decay, 0.0]
