"""A learner's own state across a restart (inner_state.py): AdamW moments and step and the error-feedback residuals
are saved as safetensors and come back exactly; a snapshot of another model, or a damaged one, is ignored with a
warning instead of failing the start. The end-to-end check (a restarted learner process resumes its learning rate
instead of warming up again) is in test_learner_syncer.py."""

import logging

import torch

from diloco_trainer.learner import inner_state
from diloco_trainer.config import MODEL_PRESETS, TrainConfig
from diloco_trainer.model.optimizer import inner_optimizer
from diloco_trainer.model.gpt import build_model
from diloco_trainer.protocol.wire import ErrorFeedback


def trained(preset: str = "tiny"):
    cfg = TrainConfig(model=MODEL_PRESETS[preset])
    model = build_model(cfg.model, seed=0)
    opt, _ = inner_optimizer(model, cfg)
    x = torch.randint(0, cfg.model.vocab_size, (2, 16))
    for _ in range(3):
        _, loss = model(x, x)
        opt.zero_grad()
        loss.backward()
        opt.step()
    ef = ErrorFeedback()
    ef.compress({"tok_emb.weight": torch.randn_like(model.tok_emb.weight)}, "int4", 64)
    assert ef.residual("tok_emb.weight") is not None
    return model, opt, ef, cfg


def test_moments_step_and_residuals_come_back_exactly(tmp_path):
    model, opt, ef, cfg = trained()
    path = tmp_path / inner_state.FILE
    inner_state.save(path, opt, ef, steps=42)

    fresh = build_model(cfg.model, seed=1)
    fresh_opt, _ = inner_optimizer(fresh, cfg)
    found = inner_state.read(path, fresh_opt, dict(fresh.named_parameters()))
    assert found is not None and found.steps == 42
    fresh_ef = ErrorFeedback()
    inner_state.restore(fresh_opt, fresh_ef, found.tensors)
    before, after = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert sorted(before) == sorted(after)
    for idx in before:
        saved, loaded = before[idx], after[idx]
        assert torch.equal(saved["exp_avg"], loaded["exp_avg"]) and torch.equal(saved["exp_avg_sq"], loaded["exp_avg_sq"])
        assert float(saved["step"]) == float(loaded["step"]) == 3.0
    assert ef.state_dict().keys() == fresh_ef.state_dict().keys()
    assert all(torch.equal(ef.state_dict()[k], fresh_ef.state_dict()[k]) for k in ef.state_dict())


def test_a_snapshot_of_another_model_is_ignored_with_a_warning(tmp_path, caplog):
    _, opt, ef, _ = trained("tiny")
    path = tmp_path / inner_state.FILE
    inner_state.save(path, opt, ef, steps=7)
    other = build_model(MODEL_PRESETS["small"], seed=0)
    other_opt, _ = inner_optimizer(other, TrainConfig(model=MODEL_PRESETS["small"]))
    with caplog.at_level(logging.WARNING):
        assert inner_state.read(path, other_opt, dict(other.named_parameters())) is None
    assert "starting AdamW and error feedback afresh" in caplog.text


def test_a_damaged_or_missing_snapshot_starts_afresh(tmp_path, caplog):
    model, opt, ef, _ = trained()
    path = tmp_path / inner_state.FILE
    assert inner_state.read(path, opt, dict(model.named_parameters())) is None, "no snapshot yet"
    inner_state.save(path, opt, ef, steps=3)
    path.write_bytes(path.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        assert inner_state.read(path, opt, dict(model.named_parameters())) is None
    assert "unusable" in caplog.text


def test_the_adopted_theta_comes_back_only_for_the_run_it_was_saved_in(tmp_path):
    model, opt, ef, cfg = trained()
    params = dict(model.named_parameters())
    names = sorted(params)
    plan = [names[::2], names[1::2]]
    held = ({f"base.{p}.{n}": params[n].detach().clone() for p, frag in enumerate(plan) for n in frag}, {0: 3, 1: 5})
    run = inner_state.run_digest(cfg.model_dump(), plan)
    path = tmp_path / inner_state.FILE
    inner_state.save(path, opt, ef, steps=9, held=held, run=run)

    found = inner_state.read_held(path, run, plan)
    assert {p: v for p, (v, _) in found.items()} == {0: 3, 1: 5}
    assert all(torch.equal(found[p][1][n], params[n]) for p, frag in enumerate(plan) for n in frag)
    other_run = inner_state.run_digest(cfg.model_copy(update={"seed": cfg.seed + 1}).model_dump(), plan)
    assert inner_state.read_held(path, other_run, plan) == {}
    assert inner_state.read_held(path, inner_state.run_digest(cfg.model_dump(), plan[::-1]), plan[::-1]) == {}
    # The optimizer state reads as before (the held tensors name parameters of this model).
    assert inner_state.read(path, opt, params).steps == 9


def test_a_snapshot_without_held_theta_holds_nothing(tmp_path):
    _, opt, ef, cfg = trained()
    path = tmp_path / inner_state.FILE
    inner_state.save(path, opt, ef, steps=4)
    assert inner_state.read_held(path, inner_state.run_digest(cfg.model_dump(), [["x"]]), [["x"]]) == {}


def test_a_later_unsent_work_snapshot_replaces_the_work_residuals_and_position_of_the_whole_one(tmp_path):
    model, opt, ef, _ = trained()
    params = dict(model.named_parameters())
    name = "tok_emb.weight"
    whole, work = tmp_path / inner_state.FILE, tmp_path / inner_state.WORK_FILE
    base = {f"base.0.{name}": torch.zeros_like(params[name])}
    inner_state.save(whole, opt, ef, 20, (base | {f"theta.0.{name}": torch.ones_like(params[name])},
                                          [{"fragment": 0, "version": 3, "c_steps": 4, "c_tokens": 40}]),
                     "n1", position={"offset": 20}, saved_at=100.0)
    later = torch.full_like(params[name], 2.0)
    inner_state.save_work(work, {}, 23, (base | {f"theta.0.{name}": later},
                                         [{"fragment": 0, "version": 3, "c_steps": 7, "c_tokens": 70}]),
                          "n1", {"offset": 23}, saved_at=101.0)
    found = inner_state.with_newer_work(inner_state.read(whole, opt, params), work, params)
    assert found.steps == 23 and found.position == {"offset": 23} and found.unsent[0]["c_steps"] == 7
    assert torch.equal(found.tensors[f"theta.0.{name}"], later)
    assert not any(k.startswith("ef.") for k in found.tensors), "the residuals as of the later snapshot: none"
    assert set(inner_state.optimizer_template(opt)) <= set(found.tensors), "AdamW's state from the whole one"

    # A work snapshot older than the whole one (a previous start's) is ignored.
    inner_state.save(whole, opt, ef, 30, None, None, position={"offset": 30}, saved_at=102.0)
    found = inner_state.with_newer_work(inner_state.read(whole, opt, params), work, params)
    assert found.steps == 30 and found.position == {"offset": 30} and found.unsent == []
