"""What a restarted learner loses with its inner state (issue 11): today it keeps only its data position, so it
starts with fresh AdamW moments, warms its learning rate up again from 0 (its step counter restarts), and drops
its error-feedback residuals.

One learner of the benchmark model, no syncer: train `before` steps, then go on for `after` steps in four ways on
the same batches — unchanged (nothing lost), today's restart (fresh moments, warm-up again), fresh moments with the
learning rate schedule kept, restored moments with the warm-up again — and compare the training loss of the last
steps. A loss gap is turned into steps: how many steps later the unchanged run had the same loss. The residuals
are measured directly: the norm of what error feedback holds after one int4 compression of a real outer gradient,
as a fraction of that outer gradient's norm.
"""

from __future__ import annotations

import statistics

import torch

from diloco_trainer.config import TrainConfig
from diloco_trainer.data.corpus import ShardSampler, load_corpus
from diloco_trainer.model.gpt import build_model
from diloco_trainer.protocol.wire import ErrorFeedback

from . import report, runs

VARIANTS = ("unchanged", "today: fresh moments + warm-up again", "fresh moments, no warm-up again",
            "restored moments, warm-up again")
TAIL = 10  # steps averaged at the end of each continuation


def inner_lr(step: int, lr: float, warmup_steps: int) -> float:
    """The learner's inner schedule: linear warm-up to `lr` over `warmup_steps`, then constant."""
    return lr * min(1.0, step / warmup_steps) if warmup_steps else lr


def _optimizer(model, cfg: TrainConfig) -> torch.optim.AdamW:
    params = list(model.parameters())
    inner = cfg.inner
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": inner.weight_decay},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=inner.lr, betas=(inner.beta1, inner.beta2))


def _step(model, opt, cfg: TrainConfig, batch, lr_step: int) -> float:
    for g in opt.param_groups:
        g["lr"] = inner_lr(lr_step, cfg.inner.lr, cfg.inner.warmup_steps)
    _, loss = model(*batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
    opt.step()
    return float(loss.detach())


def one_seed(cfg: TrainConfig, corpus, seed: int, before: int, after: int) -> dict:
    """Losses of the four continuations after `before` steps, and the error-feedback residual fraction."""
    torch.manual_seed(seed)
    sampler = ShardSampler(corpus.train, seed % 3, 3, cfg.inner.batch_size, cfg.model.seq_len, seed=seed)
    model = build_model(cfg.model, seed)
    opt = _optimizer(model, cfg)
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    for s in range(1, before + 1):
        _step(model, opt, cfg, sampler.next_batch(), s)
    # Error feedback: the residual one int4 compression leaves, against the outer gradient it compressed.
    deltas = {n: theta0[n] - p.detach() for n, p in model.named_parameters()}
    ef = ErrorFeedback()
    ef.compress(deltas, cfg.outer.compression, cfg.outer.block_size)
    res = sum(float(ef.residual(n).norm() ** 2) for n in deltas if ef.residual(n) is not None) ** 0.5
    ef_fraction = res / sum(float(d.norm() ** 2) for d in deltas.values()) ** 0.5
    batches = [sampler.next_batch() for _ in range(after)]
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt_state = opt.state_dict()
    curves = {}
    for v in VARIANTS:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(state[n])
        o = _optimizer(model, cfg)
        if v in (VARIANTS[0], VARIANTS[3]):
            o.load_state_dict(opt_state)
        rewarm = v in (VARIANTS[1], VARIANTS[3])
        curves[v] = [_step(model, o, cfg, b, (i + 1) if rewarm else before + i + 1) for i, b in enumerate(batches)]
    return {"seed": seed, "curves": curves, "ef_residual_fraction": ef_fraction}


def steps_behind(reference: list[float], curve: list[float]) -> float:
    """How many steps behind `reference` the end of `curve` is: its mean loss over the last TAIL steps is matched
    to the reference's running mean (a TAIL-step window) at some step, interpolated; 0 if it is not behind."""
    target = statistics.mean(curve[-TAIL:])
    smooth = [statistics.mean(reference[max(0, i - TAIL + 1): i + 1]) for i in range(len(reference))]
    end = len(reference) - 1
    for i in range(end, 0, -1):
        if smooth[i - 1] >= target >= smooth[i]:
            frac = (smooth[i - 1] - target) / (smooth[i - 1] - smooth[i]) if smooth[i - 1] != smooth[i] else 0.0
            return max(0.0, end - (i - 1 + frac))
    return 0.0 if target <= smooth[end] else float(end)


def measure(ctx: report.Context) -> dict:
    cfg = TrainConfig.model_validate(runs.RunSpec("decoupled", 1).config())
    corpus = load_corpus(cfg.data)
    before, after, n = ctx.pick((10, 20, 1), (40, 60, 2), (60, 80, 3))
    per_seed = [one_seed(cfg, corpus, seed, before, after) for seed in range(n)]
    behind = {v: [steps_behind(s["curves"][VARIANTS[0]], s["curves"][v]) for s in per_seed] for v in VARIANTS[1:]}
    gap = {v: [statistics.mean(s["curves"][v][-TAIL:]) - statistics.mean(s["curves"][VARIANTS[0]][-TAIL:])
               for s in per_seed] for v in VARIANTS[1:]}
    return {"before_steps": before, "after_steps": after, "seeds": per_seed, "steps_behind": behind,
            "loss_gap": gap, "ef_residual_fraction": [s["ef_residual_fraction"] for s in per_seed]}


def describe(r: dict) -> str:
    parts = [f"{v}: {statistics.mean(r['steps_behind'][v]):.1f} steps behind "
             f"(loss {statistics.mean(r['loss_gap'][v]):+.3f})" for v in VARIANTS[1:]]
    return (f"after {r['before_steps']} steps, {r['after_steps']} more, {len(r['seeds'])} seeds — " + "; ".join(parts)
            + f"; one int4 error-feedback residual is {100 * statistics.mean(r['ef_residual_fraction']):.1f}% of "
            "an outer gradient's norm")
