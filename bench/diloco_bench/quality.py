"""Quality: validation loss of Decoupled DiLoCo (4 learners) vs DDP vs synchronous DiLoCo at the same tokens, plus
the paper's ablations (K=1 without grace window, direct mean instead of RDA), late merges re-anchored whole
(outer.late_share off), the adoption mode outer.adopt=keep, and the three methods (and late_share off) on a smaller
model at ~22 tokens per parameter over at least three seeds.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from . import report, runs

NAME = "quality"
# label -> (method, config overrides). Decoupled is the project's default: K=1, grace 0.5, RDA, int4, token weights,
# late merges scaled by their share of the round (outer.late_share).
CONFIGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "decoupled": ("decoupled", ()),
    "ddp": ("ddp", ()),
    "sync-diloco": ("sync-diloco", ()),
    "late-share-off": ("decoupled", ("outer.late_share=false",)),
    "adopt-keep": ("decoupled", ("outer.adopt=keep",)),
    "k1-no-grace": ("decoupled", ("outer.grace=0",)),
    "mean-merge": ("decoupled", ("outer.merge=mean",)),
}
# The three methods again on a ~74k-parameter model (d_model 48, 2 layers): the same tokens are then ~22 tokens per
# parameter instead of ~2, the regime the DiLoCo literature compares methods in (full mode only), over at least
# SMALL_SEEDS seeds: the suite's headline comparison.
SMALL_MODEL = ("model.d_model=48", "model.n_layers=2", "model.n_heads=2")
SMALL = " (74k)"
SMALL_SEEDS = 3
CONFIGS.update({f"{label}{SMALL}": (method, SMALL_MODEL + sets) for label, (method, sets) in list(CONFIGS.items())
                if label in ("decoupled", "ddp", "sync-diloco", "late-share-off")})
TARGET_VS_DDP = 0.02
TARGET_VS_SYNC = 0.01
TARGET_VS_DDP_SMALL = 0.03  # at >= 20 tokens per parameter (issue 35)


def spec(ctx: report.Context, label: str, seed: int) -> runs.RunSpec:
    method, sets = CONFIGS[label]
    return runs.RunSpec(method, runs.standard_steps(ctx), seed=seed, sets=sets, label=f"{label} seed {seed}")


def labels(ctx: report.Context) -> list[str]:
    """Quick mode runs the three methods; full mode adds the two ablations."""
    return ctx.pick(["decoupled", "ddp"], ["decoupled", "ddp", "sync-diloco"], list(CONFIGS))


def run(ctx: report.Context) -> dict:
    result = report.new_result(NAME, ctx.mode)
    n = runs.seeds(ctx)
    todo = [(label, seed) for seed in range(max(n, SMALL_SEEDS if ctx.mode == "full" else n))
            for label in labels(ctx) if seed < n or label.endswith(SMALL)]
    task = ctx.task("quality runs", len(todo))
    per: dict[str, list[dict]] = {}
    for label, seed in todo:
        s = runs.ensure(ctx, spec(ctx, label, seed))
        per.setdefault(label, []).append({
            "seed": seed, "val_loss": s["val_loss"], "tokens": s["tokens_trained"], "wall_time_s": s["wall_time_s"],
            "tokens_per_s": runs.learner_tokens_per_s(s), "goodput": s.get("goodput"), "unigram": s["unigram_loss"],
            "merged_fraction": s.get("merged_fraction", s.get("goodput")),
            "stop_reason": s["stop_reason"], "curve": dict(zip(("time_s", "tokens", "val_loss"), runs.val_curve(s))),
            "run": s["run_dir"]})
        task.advance()
    task.done()
    result["figures"]["runs"] = per
    for label in [k for k in per if CONFIGS[k][0] == "decoupled"]:
        merged = [r["merged_fraction"] for r in per[label] if r.get("merged_fraction") is not None]
        if merged:
            result["notes"].append(f"{label}: {100 * min(merged):.1f}-{100 * max(merged):.1f}% of the steps trained "
                                   "were merged into the global model (sync DiLoCo and DDP merge every step)")
    result["figures"]["steps_per_learner"] = runs.standard_steps(ctx)
    result["figures"]["learners"] = 4
    _summarize(result, per)
    plot(result, ctx.out_dir / f"{NAME}.png")
    return result


def relative(per: dict[str, list[dict]], label: str, base: str) -> dict | None:
    """(loss[label] − loss[base]) / loss[base], paired by seed, with the spread over seeds."""
    ref = {r["seed"]: r["val_loss"] for r in per.get(base, []) if r["val_loss"] is not None}
    rel = [(r["val_loss"] - ref[r["seed"]]) / ref[r["seed"]] for r in per.get(label, [])
           if r["seed"] in ref and r["val_loss"] is not None]
    return report.spread(rel) if rel else None


def _summarize(result: dict, per: dict[str, list[dict]]) -> None:
    fig = result["figures"]
    fig["summary"] = {}
    t = result["table"]
    n_seeds = max(len(v) for v in per.values())
    t["title"] = (f"quality — final validation loss (nats/byte), 4 learners × {fig['steps_per_learner']} steps, "
                  f"{n_seeds} seed(s)")
    t["columns"] = ["configuration", "val loss (mean ± std)", "vs DDP", "vs sync DiLoCo", "tokens", "tokens/s"]
    for label, rs in per.items():
        losses = [r["val_loss"] for r in rs if r["val_loss"] is not None]
        sp = report.spread(losses)
        size = SMALL if label.endswith(SMALL) else ""  # compared with the baselines of the same model
        vs_ddp, vs_sync = relative(per, label, "ddp" + size), relative(per, label, "sync-diloco" + size)
        fig["summary"][label] = {"val_loss": sp, "vs_ddp": vs_ddp, "vs_sync": vs_sync,
                                 "tokens": statistics.fmean(r["tokens"] for r in rs),
                                 "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in rs)}
        t["rows"].append([label, f"{sp['mean']:.4f}" + (f" ± {sp['std']:.4f}" if sp["n"] > 1 else ""), _pct(vs_ddp), _pct(vs_sync),
                          f"{statistics.fmean(r['tokens'] for r in rs):,.0f}",
                          f"{statistics.fmean(r['tokens_per_s'] for r in rs):,.0f}"])
    tokens = {label: s["tokens"] for label, s in fig["summary"].items()}
    if max(tokens.values()) > 1.02 * min(tokens.values()):
        result["notes"].append(f"runs did not all train the same tokens (a time budget cut some short): {tokens}")
    ddp_noise = fig["summary"].get("ddp", {}).get("val_loss", {}).get("std")
    noise = f"; seed spread of DDP ±{ddp_noise:.4f}" if ddp_noise else ""
    s = fig["summary"].get("decoupled", {})
    if s.get("vs_ddp"):
        ok = report.decide(s["vs_ddp"], TARGET_VS_DDP)
        report.target(result, "decoupled vs DDP", f"val loss within {100 * TARGET_VS_DDP:.0f}% of DDP",
                      f"{_pct(s['vs_ddp'])}{noise}", ok,
                      "" if ok else "seed spread wider than the margin" if ok is None else
                      "at this size and token count the async outer loop lags the every-step all-reduce; "
                      "a learner's unsent progress on a fragment is overwritten whenever another learner's merge "
                      "lands first (see 'merged' in the notes)")
    if s.get("vs_sync"):
        ok = report.decide(s["vs_sync"], TARGET_VS_SYNC)
        report.target(result, "decoupled vs sync DiLoCo", f"at least as good, within {100 * TARGET_VS_SYNC:.0f}%",
                      _pct(s["vs_sync"]), ok,
                      "" if ok else "seed spread wider than the margin" if ok is None else
                      "staleness and overwritten unsent progress (sync DiLoCo merges every step of every worker)")
    small = fig["summary"].get("decoupled" + SMALL)
    if small and small.get("vs_sync"):
        tpp = f"{fig['steps_per_learner'] * 4 * 16 * 128 / 74_208:.0f} tokens/parameter, {small['vs_sync']['n']} seeds"
        ok = report.decide(small["vs_sync"], TARGET_VS_SYNC)
        report.target(result, f"decoupled vs sync DiLoCo at {tpp}", f"within {100 * TARGET_VS_SYNC:.0f}% (3-seed mean)",
                      _pct(small["vs_sync"]), ok,
                      "" if ok else "seed spread wider than the margin" if ok is None else
                      "the work a learner trained on a fragment between its send and the new version is dropped "
                      "(outer.adopt=overwrite; see 'merged' in the notes)")
    if small and small.get("vs_ddp"):
        ok = report.decide(small["vs_ddp"], TARGET_VS_DDP_SMALL)
        report.target(result, "decoupled vs DDP at ~22 tokens/parameter",
                      f"within {100 * TARGET_VS_DDP_SMALL:.0f}% of DDP", _pct(small["vs_ddp"]), ok,
                      "" if ok else "seed spread wider than the margin" if ok is None else
                      "every DiLoCo method trails DDP's every-step average of a 4x batch at this size "
                      f"(sync DiLoCo {_pct(fig['summary'].get('sync-diloco' + SMALL, {}).get('vs_ddp'))})")
    gains = []
    for size, name in (("", "0.84M"), (SMALL, "74k")):
        on, off = fig["summary"].get("decoupled" + size, {}), fig["summary"].get("late-share-off" + size, {})
        if on.get("vs_sync") and off.get("vs_sync"):
            gains.append((name, off["vs_sync"]["mean"] - on["vs_sync"]["mean"]))
    if gains:
        report.target(result, "remedy: late merges scaled by their share (outer.late_share)",
                      "better than re-anchoring them whole",
                      "; ".join(f"{name}: {100 * g:+.2f} points without it" for name, g in gains),
                      all(g > 0 for _, g in gains) or None,
                      "" if all(g > 0 for _, g in gains) else "no gain at one size (see the table's seeds)")
    for label in ("k1-no-grace", "mean-merge"):
        a = fig["summary"].get(label)
        if a and a.get("vs_ddp") and s.get("vs_ddp"):
            diff = a["vs_ddp"]["mean"] - s["vs_ddp"]["mean"]
            report.target(result, f"ablation: {label}", "worse than decoupled (paper)",
                          f"{100 * diff:+.2f} points vs decoupled", None,
                          "reported; the paper's ablation gaps appear at M=8-16 and far more tokens")


def _pct(sp: dict | None) -> str:
    if not sp:
        return "-"
    return f"{100 * sp['mean']:+.2f}%" + (f" ± {100 * sp['std']:.2f}" if sp["n"] > 1 else "")


PALETTE = {"decoupled": "#1f77b4", "ddp": "#7f7f7f", "sync-diloco": "#d62728", "late-share-off": "#ff7f0e",
           "adopt-keep": "#9467bd", "k1-no-grace": "#8c564b", "mean-merge": "#e377c2"}


def _base(label: str) -> str:
    return label[:-len(SMALL)] if label.endswith(SMALL) else label


def plot(result: dict, path: Path) -> Path:
    """Left: each configuration's loss against synchronous DiLoCo of its model size (mean, seeds as dots), the 1%
    target drawn; right: the three methods' validation curves at each size (seed 0)."""
    fig_data = result["figures"]
    per, summary = fig_data["runs"], fig_data["summary"]
    fig, (a, b) = report.figure(2, 1, width=6.6, height=4.6)
    order = [k for k in per if not _base(k) == "sync-diloco" and summary[k].get("vs_sync")]
    for i, k in enumerate(order):
        size = SMALL if k.endswith(SMALL) else ""
        ref = {r["seed"]: r["val_loss"] for r in per.get("sync-diloco" + size, [])}
        dots = [100 * (r["val_loss"] - ref[r["seed"]]) / ref[r["seed"]] for r in per[k]
                if r["val_loss"] is not None and r["seed"] in ref]
        mean = 100 * summary[k]["vs_sync"]["mean"]
        a.barh(i, mean, color=PALETTE.get(_base(k), "#17becf"), hatch="//" if size else None, edgecolor="white")
        a.plot(dots, [i] * len(dots), "k.", ms=6)
        right = mean >= 0
        a.annotate(f"{mean:+.1f}%", (max([mean, *dots]) if right else min([mean, *dots]), i),
                   xytext=(4 if right else -4, 0), textcoords="offset points", va="center",
                   ha="left" if right else "right", fontsize=8)
    a.axvline(0, color="k", lw=0.8)
    a.axvline(100 * TARGET_VS_SYNC, color="#2ca02c", ls="--", lw=1)
    a.annotate("target", (100 * TARGET_VS_SYNC, len(order) - 0.4), color="#2ca02c", fontsize=8, ha="left")
    a.set_yticks(range(len(order)), [k.replace(SMALL, f"{SMALL}, 22 tok/param") for k in order], fontsize=8)
    a.invert_yaxis()
    a.set_xlabel("validation loss vs synchronous DiLoCo, same model and tokens (%, lower is better)")
    a.set_title(f"4 learners × {fig_data['steps_per_learner']} steps; dots = seeds, hatched = 74k model", fontsize=10)

    lo = min(r["val_loss"] for rs in per.values() for r in rs if r["val_loss"] is not None)
    for k in per:
        if _base(k) not in ("decoupled", "ddp", "sync-diloco"):
            continue
        c = per[k][0]["curve"]
        if c["tokens"]:
            b.plot(c["tokens"], c["val_loss"], "o--" if k.endswith(SMALL) else "o-", ms=3,
                   color=PALETTE[_base(k)], label=k)
    uni = per[next(iter(per))][0].get("unigram")
    if uni:
        b.axhline(uni, color="k", ls=":", lw=1)
        b.annotate("unigram baseline", (0.6, uni), xycoords=("axes fraction", "data"), fontsize=8, va="bottom")
        b.set_ylim(lo - 0.1, uni * 1.12)  # Θ₀'s loss (~5.5) would flatten everything else
    b.set_xlabel("tokens trained (all learners)")
    b.set_ylabel("validation loss of the global model (nats/byte)")
    b.set_title("during training (seed 0): 0.84M solid, 74k dashed", fontsize=10)
    b.legend(fontsize=8)
    return report.save(fig, path, "Quality: Decoupled DiLoCo vs DDP vs synchronous DiLoCo", report.footnote(result))
