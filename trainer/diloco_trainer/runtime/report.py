"""End-of-run figures: the global model's validation loss, bytes on the wire vs DDP, and the printed summary.

Communication formulas (per learner, per inner step, fp32 = 4 bytes per parameter):
- DDP, ring all-reduce of the gradients every step: 2·(N−1)/N · 4·params (≈ 2 × 4·params for large N).
- Synchronous DiLoCo, ring all-reduce of Δ (full model) every H steps: 2·(N−1)/N · 4·params / H.
- Decoupled DiLoCo: measured — outer-gradient bytes the learners sent (their `bytes_up`, or the syncer's
  Prometheus counter) divided by the inner steps trained; each fragment goes out once per H steps, so about
  params/H values per step at the compression's bits (int4: 4 bits + a 4-byte scale per block). Received
  bytes (`bytes_down`: every new fragment version the learner fetched, whole or as down-link updates, and the
  start-up state) are reported next to it, with their ratio to the bytes sent.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from diloco_trainer.config import TrainConfig

if TYPE_CHECKING:  # torch is imported only when a model is evaluated: `--help` and arg errors stay fast
    import torch


def ring_allreduce_bytes(params: int, n: int, every: int = 1) -> float:
    """Bytes one worker sends per step for a ring all-reduce of `params` fp32 values every `every` steps."""
    if n < 2:
        return 0.0
    return 2.0 * (n - 1) / n * 4.0 * params / every


def ddp_bytes_per_step(params: int, n: int) -> float:
    """What DDP sends per worker per step; with a single worker we still quote the N=∞ ring figure, 8·params."""
    return ring_allreduce_bytes(params, n) if n >= 2 else 8.0 * params


def wire_bytes_estimate(params: int, compression: str, block_size: int, sync_every: int) -> float:
    """Expected outer-gradient payload per learner per step (tensor bytes only, no headers)."""
    per_value = {"none": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / block_size, "int4": 0.5 + 4.0 / block_size}
    if compression not in per_value:
        raise ValueError(f"unknown compression {compression!r}")
    return per_value[compression] * params / sync_every


def load_theta(path: Path) -> "dict[str, torch.Tensor]":
    """Parameters from a safetensors checkpoint (never pickle)."""
    from safetensors.torch import load_file

    return load_file(str(path))


def evaluate_theta(cfg: TrainConfig, theta: "dict[str, torch.Tensor]", val_tokens: "torch.Tensor",
                   batches: int, batch_size: int) -> float:
    """Validation loss of the model `cfg.model` with parameters `theta` (names as in named_parameters)."""
    import torch

    from diloco_trainer.data.corpus import evaluate
    from diloco_trainer.model.build import build_model

    model = build_model(cfg.model, cfg.seed)
    expected = {name for name, _ in model.named_parameters()}
    missing, extra = expected - set(theta), set(theta) - expected
    if missing or extra:
        raise ValueError(f"checkpoint does not match model: missing {sorted(missing)[:5]}, extra {sorted(extra)[:5]}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(theta[name].to(p.dtype).view_as(p))
    return evaluate(model, val_tokens, cfg.model.seq_len, batches, batch_size)


def prometheus_sum(text: str, metric: str, **labels: str) -> float | None:
    """Sum of the samples of one metric (matching the given labels) in Prometheus text, None if absent."""
    from prometheus_client.parser import text_string_to_metric_families

    total, seen = 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (metric, metric + "_total") and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
                seen = True
    return total if seen else None


def format_bytes(n: float | None) -> str:
    if n is None or math.isnan(n):
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def summary_lines(s: dict) -> list[str]:
    """The human-readable end-of-run report, from summary.json's fields."""
    lines = [f"run directory: {s['run_dir']}"]
    lines.append(f"mode: {s['mode']}, {s['learners']} learners, {s['params']:,} parameters, "
                 f"wall time {s['wall_time_s']:.1f} s ({s['wall_time_s'] / 60:.2f} min)")
    val, uni = s.get("val_loss"), s.get("unigram_loss")
    if val is not None:
        rel = 100 * (uni - val) / uni if uni else None
        gap = "" if rel is None else f" ({rel:.1f}% below)" if rel >= 0 else f" ({-rel:.1f}% ABOVE: not learned yet)"
        lines.append(f"validation loss of the final global model: {val:.4f} {s.get('loss_unit', 'nats/byte')} "
                     f"vs unigram baseline {uni:.4f}{gap}")
    lines.append(f"tokens trained: {s['tokens_trained']:,} in {s['steps_trained']:,} learner steps "
                 f"({s['tokens_trained'] / max(s['wall_time_s'], 1e-9):,.0f} tokens/s overall)")
    if s.get("goodput") is not None:
        lines.append(f"goodput: {100 * s['goodput']:.1f}% of the learners' allocated time was useful training")
    if s.get("merged_fraction") is not None:
        if s.get("tokens_merged_per_fragment") is not None:  # Decoupled: every fragment merges on its own
            tokens = (f"tokens merged {s['tokens_merged_per_fragment']:,.0f} per fragment of {s['tokens_trained']:,} "
                      f"trained; {s['tokens_merged']:,} summed over the {s['fragments']} fragments")
        else:
            tokens = f"tokens merged {s.get('tokens_merged', 0):,} of {s['tokens_trained']:,} trained"
        lines.append(f"merged: {100 * s['merged_fraction']:.1f}% of trained steps reached the global model ({tokens})")
    if s.get("ledger"):
        from diloco_trainer.runtime.ledger import ledger_line

        lines.append(ledger_line(s["ledger"]))
    if s.get("restarts"):
        lost = (f" (lost {s['lost_steps']:,} learner steps, trained again from checkpoints)"
                if "lost_steps" in s else "")
        lines.append(f"restarts: {s['restarts']}{lost}")
    syncer = s.get("syncer") or {}
    if syncer.get("shards", 1) > 1:
        lines.append(f"syncer: {syncer['shards']} shards (fragment p on shard p mod {syncer['shards']}), outer steps "
                     f"per fragment {syncer.get('outer_steps')}")
    b = s.get("bytes") or {}
    if b:
        sent = b.get("sent_per_learner_step")
        ratio = b.get("ddp_per_learner_step", 0) / sent if sent else None
        lines.append(f"sent per learner per step: {format_bytes(b.get('sent_per_learner_step'))} "
                     f"({b.get('source', '')}) vs DDP {format_bytes(b.get('ddp_per_learner_step'))}"
                     + (f" → {ratio:,.0f}× less" if ratio and ratio > 1 else ""))
        if b.get("received_per_learner_step") is not None:
            what = (f"new global fragment versions, outer.downlink={b.get('downlink') or 'fp32'}"
                    if s["mode"] == "decoupled" else b.get("source", ""))
            per_sent = f", {b['received_over_sent']:.2f}× what it sent" if b.get("received_over_sent") else ""
            lines.append(f"received per learner per step: {format_bytes(b['received_per_learner_step'])} ({what}"
                         f"{per_sent}) vs DDP {format_bytes(b.get('ddp_per_learner_step'))} (a ring all-reduce "
                         "receives what it sends)")
        lines.append(f"  DDP formula: {b.get('ddp_formula')}")
    return lines
