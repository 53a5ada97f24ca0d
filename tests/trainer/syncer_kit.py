"""Builders shared by the syncer tests: a tiny run config, a syncer on a state dir, submission bodies, and a
snapshot of everything a rejected request must leave untouched."""

from __future__ import annotations

from pathlib import Path

import torch

from diloco_trainer.config import MODEL_PRESETS, OuterConfig, TrainConfig
from diloco_trainer.syncer.app import Syncer, SyncerOptions, make_app
from diloco_trainer.syncer.state import SyncerState
from diloco_trainer.protocol.wire import SubmissionMeta, encode_submission, encode_tensors, quantize

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def register_body(learner_id: str, unit: int = 0) -> dict:
    """A complete `POST /v1/register` body, as a learner sends it."""
    return {"learner_id": learner_id, "unit": unit, "world_size": 1, "device": "cpu"}


def tiny_config(**outer) -> TrainConfig:
    outer = {"fragments": 2, "compression": "none", "grace": 0.0, **outer}
    return TrainConfig(model=MODEL_PRESETS["tiny"].model_copy(), outer=OuterConfig(**outer), seed=3)


def make_syncer(state_dir: Path, config: TrainConfig | None = None, **options) -> Syncer:
    state = SyncerState(config or tiny_config(), state_dir)
    return Syncer(state, SyncerOptions(token=TOKEN, **{"checkpoint_every_s": 3600.0, **options}))


async def start(aiohttp_client, syncer: Syncer):
    return await aiohttp_client(make_app(syncer))


async def serve(aiohttp_client, state_dir: Path, config: TrainConfig):
    """A syncer on `state_dir` behind aiohttp's test client: (syncer, client, its state)."""
    syncer = make_syncer(state_dir, config)
    return syncer, await start(aiohttp_client, syncer), syncer.state


def deltas_for(state: SyncerState, p: int, seed: int, scale: float = 1e-2) -> dict[str, torch.Tensor]:
    """A random outer gradient for fragment p (reproducible from seed)."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(state.shapes[n], generator=g) * scale for n in state.plan[p]}


def body(state: SyncerState, p: int, deltas: dict, *, learner="learner-a", sid="sub-1", base=0, c_steps=4,
         c_tokens=1024, scheme="none", fragment=None, rider=False) -> bytes:
    """An outer-gradient body as a learner's wire.encode_submission makes it."""
    meta = SubmissionMeta(learner, sid, p if fragment is None else fragment, base, c_steps, c_tokens, rider=rider)
    parts = {n: quantize(d, scheme, 64) for n, d in deltas.items()}
    return encode_submission(meta, parts, scheme, 64, {n: tuple(d.shape) for n, d in deltas.items()})


def raw_body(tensors: dict, meta: dict[str, str]) -> bytes:
    """A hand-made body (for inputs encode_submission refuses to produce)."""
    return encode_tensors(tensors, meta)


def snapshot(state: SyncerState) -> dict:
    """Everything a rejected request must leave unchanged."""
    return {
        "theta": {n: t.clone() for n, t in state.theta.items()},
        "momentum": [{n: t.clone() for n, t in o.state_dict().items()} for o in state.outer],
        "versions": list(state.versions),
        "outer_steps": list(state.outer_steps),
        "pending": [sorted(pend) for pend in state.pending],
        "merged_ids": set(state.merged_ids),
        "tokens_merged": state.tokens_merged,
        "merged_by_learner": {k: (i.tokens_merged, i.submissions_merged) for k, i in state.learners.items()},
        "spool": sorted(p.name for p in state.spool.dir.iterdir()),
    }


def assert_unchanged(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key in before:
        if key == "theta":
            assert all(torch.equal(before[key][n], after[key][n]) for n in before[key])
        elif key == "momentum":
            assert [sorted(m) for m in before[key]] == [sorted(m) for m in after[key]]
            assert all(torch.equal(a[n], b[n]) for a, b in zip(before[key], after[key]) for n in a)
        else:
            assert before[key] == after[key], key


def first_outer_step(theta: torch.Tensor, delta: torch.Tensor, lr: float, momentum: float) -> torch.Tensor:
    """Θ after one Nesterov outer step from zero momentum: buf = Δ; Θ − η(Δ + μ·buf)."""
    return theta - lr * (delta + momentum * delta)
