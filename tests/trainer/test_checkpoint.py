"""Per-rank checkpoints of the synchronous baselines, and the whole-job restart decisions (no processes)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from diloco_trainer import checkpoint
from diloco_trainer.runtime.elastic import PEER_LOST_EXIT, failed_worker, last_step_since, lost_steps
from diloco_trainer.runtime.procs import Child


def _model_and_adamw():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _train(model, opt, batches):
    for x in batches:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_adamw_resumed_from_a_checkpoint_continues_bit_identically(tmp_path):
    batches = [torch.randn(16, 4, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    model, opt = _model_and_adamw()
    _train(model, opt, batches[:3])
    tensors = {f"model.{n}": p for n, p in model.named_parameters()} | checkpoint.optimizer_tensors(opt)
    checkpoint.save(tmp_path, 3, tensors, {"note": "json only"})
    _train(model, opt, batches[3:])

    resumed, resumed_opt = _model_and_adamw()
    loaded, state = checkpoint.load(tmp_path, 3)
    with torch.no_grad():
        for n, p in resumed.named_parameters():
            p.copy_(loaded[f"model.{n}"])
    checkpoint.load_optimizer_tensors(resumed_opt, loaded)
    _train(resumed, resumed_opt, batches[3:])
    assert state == {"note": "json only"}
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_the_previous_step_stays_until_a_later_one_is_committed_and_pruned(tmp_path):
    run_dir, state_dir = tmp_path / "run", tmp_path / "run" / "learners" / "learner-0"
    run_dir.mkdir()
    checkpoint.save(state_dir, 10, {"w": torch.ones(2)}, {})
    checkpoint.commit(run_dir, 10)
    checkpoint.save(state_dir, 20, {"w": torch.full((2,), 2.0)}, {})
    (state_dir / "checkpoint" / "step-00000030.tmp").mkdir()  # a save cut short by a kill
    assert checkpoint.committed(run_dir)["step"] == 10  # 20 is on disk, not committed: a restart loads 10
    assert torch.equal(checkpoint.load(state_dir, 10)[0]["w"], torch.ones(2))
    checkpoint.commit(run_dir, 20)
    checkpoint.prune(state_dir, keep=20)
    assert [p.name for p in (state_dir / "checkpoint").iterdir()] == ["step-00000020"]
    assert not list(Path(state_dir).rglob("*.pkl")) and not list(Path(state_dir).rglob("*.pt"))


def test_python_rng_state_survives_json():
    rng = random.Random(3)
    rng.random()
    saved = checkpoint.rng_to_json(rng)
    expected = [rng.random() for _ in range(3)]
    again = random.Random(0)
    checkpoint.rng_from_json(again, saved)
    assert [again.random() for _ in range(3)] == expected


def _exited(name: str, code: int) -> Child:
    child = Child(name, "learner", [], {}, Path("/dev/null"))
    child.starts, child.exits = [1.0], [code]
    return child


def test_the_killed_worker_is_blamed_not_the_ones_that_lost_their_peer():
    children = [_exited("learner-0", PEER_LOST_EXIT), _exited("learner-1", -9), _exited("learner-2", PEER_LOST_EXIT)]
    assert failed_worker(children).name == "learner-1"
    assert failed_worker(children[::2]).name == "learner-0"  # only peer losses: the first one
    assert failed_worker([_exited("learner-0", 0)]) is None


def test_lost_steps_count_each_workers_logged_steps_past_the_checkpoint():
    records = [{"time": 1.0, "step": 24}, {"time": 5.0, "step": 22}, {"time": 6.0, "step": 26}]
    assert last_step_since(records, started=4.0) == 26
    assert last_step_since(records, started=7.0) is None
    assert lost_steps({"learner-0": 26, "learner-1": 23, "learner-2": None}, checkpoint_step=20) == \
        {"learner-0": 6, "learner-1": 3, "learner-2": 0}
