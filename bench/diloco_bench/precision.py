"""bf16 vs fp32 on this CPU: the learner's own inner step (learner/inner_step.py) under `inner.precision` fp32 and
bf16, one step of each in turn on the same batches of the stdlib byte corpus (same background load), from the same
initial weights: seconds per step, and the training and validation loss after N steps."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from diloco_trainer.config import MODEL_PRESETS, TrainConfig
from diloco_trainer.data.source import open_tokens
from diloco_trainer.learner.devices import UnitGroup
from diloco_trainer.learner.inner_step import InnerStep, autocast
from diloco_trainer.model.build import build_model

from . import report

NAME = "precision"
PRECISIONS = ("fp32", "bf16")


@torch.no_grad()
def val_loss(model: torch.nn.Module, val: torch.Tensor, seq: int, batches: int, precision: str) -> float:
    """Mean loss over `batches` fixed held-out windows (evaluated in the precision the model trained in)."""
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(batches):
        starts = torch.randint(0, len(val) - seq - 1, (16,), generator=gen).tolist()
        x = torch.stack([val[s: s + seq + 1].long() for s in starts])
        with autocast(torch.device("cpu"), precision):
            losses.append(float(model(x[:, :-1], x[:, 1:])[1]))
    return statistics.fmean(losses)


def run(ctx: report.Context) -> dict:
    from .runs import BENCH_CONFIG

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the learners run; the same CPU share for both precisions
    try:
        return _run(ctx, BENCH_CONFIG)
    finally:
        torch.set_num_threads(threads)


def _run(ctx: report.Context, base: dict) -> dict:
    result = report.new_result(NAME, ctx.mode)
    result["env"]["torch_threads"] = 1
    steps = ctx.pick(10, 100, 120)  # full: bf16 at ~3 s a step here; 120 keep the suite under ~90 min
    cfg = TrainConfig.model_validate(json.loads(json.dumps(base)))
    if ctx.mode != "full":  # bf16 without AMX/AVX512-BF16 is several times slower: small runs take the tiny model
        cfg = cfg.model_copy(update={"model": MODEL_PRESETS["tiny"].model_copy()})
    tokens = open_tokens(cfg.data, cfg.model.vocab_size)
    sampler = tokens.sampler(0, 1, cfg.inner.batch_size, cfg.model.seq_len, seed=cfg.seed)
    steppers = {p: InnerStep(build_model(cfg.model, cfg.seed),
                             cfg.model_copy(update={"inner": cfg.inner.model_copy(update={"precision": p})}),
                             torch.device("cpu"), UnitGroup()) for p in PRECISIONS}
    times = {p: [] for p in PRECISIONS}
    losses = {p: [] for p in PRECISIONS}
    task = ctx.task(f"fp32 and bf16 inner steps, alternated ({steps} each)", steps)
    for step in range(1, steps + 1):
        x, y = sampler.next_batch()
        for p in PRECISIONS if step % 2 else reversed(PRECISIONS):  # neither always goes first
            t0 = time.perf_counter()
            losses[p].append(steppers[p].step(x, y, steppers[p].lr_at(step)))
            times[p].append(time.perf_counter() - t0)
        task.advance()
    task.done()
    tail = max(1, steps // 10)
    tok_per_step = cfg.inner.batch_size * cfg.model.seq_len
    rows = {}
    for p in PRECISIONS:
        steady = times[p][min(5, steps - 1):]  # the first steps allocate
        rows[p] = {"step_s_median": statistics.median(steady), "step_s_best": min(steady),
                   "tokens_per_s": tok_per_step / statistics.median(steady),
                   "train_loss_last": statistics.fmean(losses[p][-tail:]),
                   "val_loss": val_loss(steppers[p].model, tokens.sample("val", 2_000_000), cfg.model.seq_len,
                                        ctx.pick(4, 16, 32), p),
                   "losses": losses[p]}
    speed = rows["fp32"]["step_s_median"] / rows["bf16"]["step_s_median"]
    loss_gap = rows["bf16"]["val_loss"] - rows["fp32"]["val_loss"]
    m = cfg.model
    result["figures"] = {"model": m.model_dump(), "batch_size": cfg.inner.batch_size, "steps": steps, "rows": rows,
                         "bf16_speedup": speed, "val_loss_gap": loss_gap, "cpu_bf16": _cpu_bf16()}
    t = result["table"]
    t["title"] = (f"bf16 vs fp32 on this CPU — d={m.d_model}, L={m.n_layers}, batch {cfg.inner.batch_size}×{m.seq_len}, "
                  f"{steps} steps, 1 thread")
    t["columns"] = ["precision", "s/step (median)", "tokens/s", "× fp32 speed", f"train loss (last {tail})",
                    "validation loss"]
    for p in PRECISIONS:
        r = rows[p]
        t["rows"].append([p, f"{r['step_s_median'] * 1e3:.0f} ms", f"{r['tokens_per_s']:.0f}",
                          f"{rows['fp32']['step_s_median'] / r['step_s_median']:.2f}×", f"{r['train_loss_last']:.3f}",
                          f"{r['val_loss']:.3f}"])
    report.target(result, "bf16 vs fp32: speed", "reported (no target; CPU bf16 depends on AMX/AVX512-BF16)",
                  f"{speed:.2f}× fp32's steps/s", None, f"cpu flags: {_cpu_bf16()}")
    report.target(result, "bf16 vs fp32: loss", "reported (no target)", f"validation {loss_gap:+.3f} nats vs fp32",
                  None)
    plot(result, ctx.out_dir / f"{NAME}.png")
    return result


def _cpu_bf16() -> str:
    """Which bf16 instructions the CPU advertises (what decides whether bf16 can be fast here)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    have = [f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if f" {f}" in flags]
    return ", ".join(have) or "none of avx2/avx512/amx"


def plot(result: dict, path: Path) -> Path:
    rows = result["figures"]["rows"]
    fig, (a, b) = report.figure(2, 1, width=5.0, height=4.0)
    for p, style in zip(PRECISIONS, ("decoupled", "bf16")):
        losses = rows[p]["losses"]
        k = max(1, len(losses) // 50)
        smooth = [statistics.fmean(losses[i: i + k]) for i in range(0, len(losses), k)]
        a.plot([i + k for i in range(0, len(losses), k)], smooth, label=f"{p} (val {rows[p]['val_loss']:.3f})",
               color=report.color(style))
    a.set_xlabel("step")
    a.set_ylabel("training loss (nats/byte)")
    a.set_title("loss")
    a.legend(fontsize=8)
    bars = b.bar(list(PRECISIONS), [rows[p]["tokens_per_s"] for p in PRECISIONS],
                 color=[report.color("decoupled"), report.color("bf16")])
    report.bar_labels(b, bars, "{:.0f}")
    b.set_ylabel("tokens/s (median step)")
    b.set_title(f"speed: bf16 {result['figures']['bf16_speedup']:.2f}× fp32")
    return report.save(fig, path, "bf16 vs fp32 on this CPU (the learner's inner step)", report.footnote(result))
