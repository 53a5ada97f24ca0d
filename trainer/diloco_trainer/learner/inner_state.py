"""A learner's own state that the syncer does not hold: AdamW moments and step, and error-feedback residuals; and a
copy of the global Θ it last adopted, per fragment and version (so it can restart while a syncer shard is down).

Written to the learner's state directory next to its data position every few steps, its unsent work after every step
(safetensors, never pickle), and read back when the learner restarts, so a killed learner resumes with warm moments, the learning rate it had reached
(no second warm-up) and the quantization error it still owed, on top of the current global Θ it pulls from the
syncer. Best effort by design: a missing, damaged or foreign snapshot only means starting these afresh."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diloco_trainer.checkpoint import load_optimizer_tensors, optimizer_tensors
from diloco_trainer.protocol.wire import ErrorFeedback, WireError, decode_tensors, encode_tensors

log = logging.getLogger(__name__)

FILE = "inner-state.safetensors"
KIND = "diloco-learner-inner-state/1"
# Between two snapshots of the whole inner state, the learner snapshots after every step only what a SIGKILL would
# otherwise lose: its unsent work (with the residuals and the data position at that step). A restart takes the
# newer of the two (`with_newer_work`).
WORK_FILE = "unsent-work.safetensors"
WORK_KIND = "diloco-learner-unsent-work/1"


@dataclass
class Snapshot:
    """What `read` found: the tensors (optimizer `opt.*`, residuals `ef.*`, unsent work `base.*`/`theta.*`), the
    steps trained, and the unsent work's fragments with the nonce of the incarnation that trained it."""

    tensors: dict[str, torch.Tensor]
    steps: int
    unsent: list[dict] = field(default_factory=list)
    nonce: str | None = None
    position: dict | None = None  # the data sampler's state when it was taken (None in older snapshots)
    saved_at: float = 0.0  # unix time it was taken (0 in older snapshots)


def run_digest(config: dict, plan: list[list[str]]) -> str:
    """Names the run a held Θ belongs to: the syncer's config and fragment plan as served at registration."""
    text = json.dumps({"config": config, "plan": plan}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def save(path: Path, opt: torch.optim.Optimizer | dict[str, torch.Tensor],
         ef: ErrorFeedback | dict[str, torch.Tensor] | None, steps: int,
         unsent: tuple[dict[str, torch.Tensor], list[dict]] | None = None, nonce: str | None = None,
         held: tuple[dict[str, torch.Tensor], dict[int, int]] | None = None, run: str | None = None,
         position: dict | None = None, saved_at: float = 0.0) -> None:
    """Atomically replace `path` with the optimizer's state (or those tensors as `optimizer_tensors` names them: an
    FSDP2 unit's gathered full state), the residuals (an ErrorFeedback or its state_dict), the steps trained so far
    and, if given, the unsent work (OuterSync.unsent_work) of the incarnation `nonce`, the adopted Θ
    (OuterSync.held) of run `run` (run_digest) and the data sampler's state at those steps (`position`: a restart
    resumes the data right after the work the snapshot holds, so none is trained twice or skipped)."""
    tensors = dict(opt) if isinstance(opt, dict) else optimizer_tensors(opt)
    if ef is not None:
        residuals = ef if isinstance(ef, dict) else ef.state_dict()
        tensors.update({f"ef.{n}": t for n, t in residuals.items()})
    meta = {"kind": KIND, "steps": str(steps), "saved_at": repr(saved_at)}
    if position is not None:
        meta["position"] = json.dumps(position)
    if held is not None and held[1] and run:
        tensors.update(held[0])  # base.{p}.{name}: the same tensors the unsent work names for its fragments
        meta.update(held=json.dumps({str(p): v for p, v in held[1].items()}), run=run)
    if unsent is not None and unsent[1] and nonce:
        tensors.update(unsent[0])
        meta.update(unsent=json.dumps(unsent[1]), nonce=nonce)
    _write(path, tensors, meta)


def save_work(path: Path, ef: dict[str, torch.Tensor], steps: int, unsent: tuple[dict[str, torch.Tensor], list[dict]],
              nonce: str, position: dict, saved_at: float) -> None:
    """Atomically replace `path` with the unsent work (OuterSync.unsent_work) of the incarnation `nonce`, the
    residuals and the data position as of `steps` steps trained, taken at unix time `saved_at`."""
    tensors = {f"ef.{n}": t for n, t in ef.items()} | unsent[0]
    meta = {"kind": WORK_KIND, "steps": str(steps), "saved_at": repr(saved_at), "unsent": json.dumps(unsent[1]),
            "nonce": nonce, "position": json.dumps(position)}
    _write(path, tensors, meta)


def _write(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    body = encode_tensors(tensors, meta)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(body)
    os.replace(tmp, path)


def read(path: Path, opt: torch.optim.Optimizer, params: dict[str, torch.Tensor]) -> Snapshot | None:
    """(tensors, steps trained) of the snapshot at `path`, checked against this optimizer and the model's named
    parameters; None when there is none or it does not fit (logged)."""
    if not path.exists():
        return None
    try:
        tensors, meta = decode_tensors(path.read_bytes())
        if meta.get("kind") != KIND:
            raise ValueError(f"not a learner inner-state snapshot (kind {meta.get('kind')!r})")
        expected = optimizer_template(opt)
        saved = {k: t for k, t in tensors.items() if k.startswith("opt.")}
        if set(saved) != set(expected):
            raise ValueError(f"its optimizer state has {len(saved)} tensors, this model's {len(expected)}")
        for key, value in saved.items():
            if value.shape != expected[key].shape:
                raise ValueError(f"{key} has shape {tuple(value.shape)}, not this model's {tuple(expected[key].shape)}")
        return _checked(tensors, meta, params)
    except (OSError, ValueError, KeyError, WireError) as exc:
        log.warning("starting AdamW and error feedback afresh: the snapshot %s is unusable: %s", path, exc)
        return None


def _checked(tensors: dict[str, torch.Tensor], meta: dict[str, str], params: dict[str, torch.Tensor]) -> Snapshot:
    """The Snapshot of a file's tensors and metadata whose residuals and unsent work fit `params` (ValueError)."""
    for key, t in tensors.items():
        kind, _, rest = key.partition(".")
        if kind in ("base", "theta"):
            _, _, name = rest.partition(".")
        elif kind == "ef":
            name = rest
        else:
            continue
        if name not in params or t.shape != params[name].shape:
            raise ValueError(f"{key} fits no parameter of this model")
    steps = int(meta["steps"])
    unsent = json.loads(meta.get("unsent", "[]"))
    if not isinstance(unsent, list) or not all(isinstance(f, dict) for f in unsent):
        raise ValueError("its unsent work is not a list of fragments")
    position = json.loads(meta["position"]) if "position" in meta else None
    if position is not None and not isinstance(position, dict):
        raise ValueError("its data position is not an object")
    return Snapshot(tensors, steps, unsent, meta.get("nonce"), position, float(meta.get("saved_at", "0")))


def with_newer_work(found: Snapshot | None, path: Path, params: dict[str, torch.Tensor]) -> Snapshot | None:
    """`found` (the whole inner state), with its unsent work, residuals and data position replaced by those of the
    unsent-work snapshot at `path` when that one was taken later; `found` as it is when there is none, it is
    older, or it does not fit (logged). Without `found` (no AdamW state to resume) nothing is taken from it."""
    if found is None or not path.exists():
        return found
    try:
        tensors, meta = decode_tensors(path.read_bytes())
        if meta.get("kind") != WORK_KIND:
            raise ValueError(f"not a learner unsent-work snapshot (kind {meta.get('kind')!r})")
        work = _checked(tensors, meta, params)
    except (OSError, ValueError, KeyError, WireError) as exc:
        log.warning("ignoring the unsent-work snapshot %s: %s", path, exc)
        return found
    if work.saved_at <= found.saved_at:
        return found
    kept = {k: t for k, t in found.tensors.items() if not k.startswith(("ef.", "theta."))}
    # Its base.{p}.* (the versions its work started from) replace the whole snapshot's adopted Θ of those fragments.
    return Snapshot(kept | work.tensors, work.steps, work.unsent, work.nonce, work.position, work.saved_at)


def read_held(path: Path, run: str, plan: list[list[str]]) -> dict[int, tuple[int, dict[str, torch.Tensor]]]:
    """The global Θ_p the snapshot at `path` holds, as {p: (version, tensors)}, only if it was saved in run `run`
    (run_digest) with every tensor of each fragment; {} when there is none or it does not fit (logged)."""
    if not path.exists():
        return {}
    try:
        tensors, meta = decode_tensors(path.read_bytes())
        if meta.get("kind") != KIND or meta.get("run") != run:
            return {}  # an older snapshot, or one of another run (config or plan differ): holds nothing of this run
        versions = {int(p): int(v) for p, v in json.loads(meta["held"]).items()}
        out = {}
        for p, version in versions.items():
            if not 0 <= p < len(plan):
                raise ValueError(f"it holds fragment {p}, the plan has {len(plan)}")
            out[p] = (version, {n: tensors[f"base.{p}.{n}"] for n in plan[p]})
    except (OSError, ValueError, KeyError, WireError) as exc:
        log.warning("holding no saved fragment values: the snapshot %s is unusable: %s", path, exc)
        return {}
    return out


def cpu_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies on the host of tensors that training changes in place (AdamW's state, θ): what a snapshot written in
    the background holds while the next steps run."""
    return {k: t.detach().to("cpu", copy=True) for k, t in tensors.items()}


def optimizer_template(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Zero tensors named and shaped as `optimizer_tensors` of an AdamW that has stepped (a broadcast target): full
    shapes, also for the sharded parameters of an FSDP2 unit (plain tensors on the device of this rank's shard)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    out = {}
    for idx, p in enumerate(params):
        out[f"opt.{idx}.step"] = torch.zeros(())
        out[f"opt.{idx}.exp_avg"] = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        out[f"opt.{idx}.exp_avg_sq"] = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
    return out


def restore(opt: torch.optim.Optimizer, ef: ErrorFeedback | None, tensors: dict[str, torch.Tensor]) -> None:
    """Load what `read` returned (or a unit's broadcast of it) into the optimizer and the residuals."""
    device = next(p for group in opt.param_groups for p in group["params"]).device
    load_optimizer_tensors(opt, {k: v if k.endswith(".step") else v.to(device)
                                 for k, v in tensors.items() if k.startswith("opt.")})
    if ef is not None:
        ef.load_state_dict({k[3:]: t for k, t in tensors.items() if k.startswith("ef.")})
