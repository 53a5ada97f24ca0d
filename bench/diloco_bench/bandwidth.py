"""Bandwidth: bytes per learner per inner step for each compression (real encoded submissions) vs DDP's ring
all-reduce of the same model, and the loss each compression costs in short real `diloco local` runs.

Formulas (per learner, per inner step; params = P parameters; N workers; H inner steps per fragment send):
  DDP           ring all-reduce of fp32 gradients every step: 2·(N−1)/N · 4 B · params
  sync DiLoCo   ring all-reduce of fp32 Δ every H steps:      2·(N−1)/N · 4 B · params / H
  decoupled up  every fragment once per H steps:              Σ_p |encoded body of fragment p| / H
                (≈ params/H · (0.5 B + 4 B/block) for int4: 4-bit values plus an fp32 scale per block)
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from diloco_trainer.config import MODEL_PRESETS, ModelConfig
from diloco_trainer.protocol.fragments import plan_fragments
from diloco_trainer.model.gpt import build_model
from diloco_trainer.protocol.wire import SCHEMES, SubmissionMeta, encode_submission, quantize, wire_bytes

from . import report, runs

NAME = "bandwidth"
TARGET_RATIO = 400.0
TARGET_LOSS = 0.005


def ddp_bytes(params: int, n: int) -> float:
    """Bytes one DDP worker sends per step (ring all-reduce of fp32 gradients)."""
    return 2.0 * (n - 1) / n * 4.0 * params


def encoded_bytes(model_cfg: ModelConfig, fragments: int, scheme: str, block: int) -> dict:
    """Encode one real submission per fragment; total body bytes (safetensors header included) and payload bytes.

    A body's size depends only on the shapes and the scheme (fixed-width values), so a constant Δ measures it.
    """
    shapes = _shapes(model_cfg)
    plan = plan_fragments([(n, s.numel()) for n, s in shapes.items()], fragments)
    body = payload = 0
    for p, names in enumerate(plan):
        parts = {n: quantize(torch.full(shapes[n].shape, 1e-3), scheme, block) for n in names}
        meta = SubmissionMeta("learner-0", f"learner-0-{p}-0", p, 0, 24, 24 * 2048)
        data = encode_submission(meta, parts, scheme, block, {n: tuple(shapes[n].shape) for n in names})
        body += len(data)
        payload += sum(t.numel() * t.element_size() for part in parts.values() for t in part.values())
    return {"body_bytes": body, "payload_bytes": payload}


def _shapes(model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Parameter shapes without allocating the parameters (meta device)."""
    with torch.device("meta"):
        model = build_model(model_cfg)
    return dict(model.named_parameters())


def formula_bytes(model_cfg: ModelConfig, scheme: str, block: int) -> dict:
    """Payload bytes from `wire.wire_bytes` (what `encoded_bytes` measures, minus the small safetensors headers)."""
    payload = wire_bytes({n: s.numel() for n, s in _shapes(model_cfg).items()}, scheme, block)
    return {"body_bytes": payload, "payload_bytes": payload}


def wire_table(model_cfg: ModelConfig, fragments: int, sync_every: int, block: int, n: int,
               encode: bool = True) -> dict:
    """Bytes per learner per inner step for each scheme, next to DDP and synchronous DiLoCo.

    `encode`: measure real encoded bodies (slow for 100M parameters); else the payload formula of `wire`.
    """
    params = sum(t.numel() for t in _shapes(model_cfg).values())
    ddp = ddp_bytes(params, n)
    rows = {}
    for scheme in SCHEMES:
        b = encoded_bytes(model_cfg, fragments, scheme, block) if encode else formula_bytes(model_cfg, scheme, block)
        per_step = b["body_bytes"] / sync_every
        rows[scheme] = {**b, "per_step": per_step, "bits_per_value": 8 * b["payload_bytes"] / params,
                        "ddp_ratio": ddp / per_step, "ddp_inf_ratio": 8.0 * params / per_step}
    return {"params": params, "fragments": fragments, "sync_every": sync_every, "block_size": block, "learners": n,
            "ddp_per_step": ddp, "ddp_inf_per_step": 8.0 * params,
            "sync_diloco_per_step": ddp / sync_every, "measured_by": "encoded bodies" if encode else "wire.wire_bytes",
            "ddp_formula": f"2·(N−1)/N · 4 B · params = 2·{n - 1}/{n} · 4 · {params:,} = {ddp:,.0f} B",
            "schemes": rows}


def compression_specs(ctx: report.Context) -> list[tuple[str, runs.RunSpec]]:
    """The loss-cost runs: none and int4 (the target's pair) for every seed; bf16 and int8 in full mode, seed 0.

    int4 is the benchmark config's default, so its runs are quality's Decoupled runs (shared, not repeated).
    """
    steps = runs.standard_steps(ctx)
    wanted = [(scheme, seed) for seed in range(runs.seeds(ctx)) for scheme in ("none", "int4")]
    if ctx.mode == "full":
        wanted += [("bf16", 0), ("int8", 0)]
    out = []
    for scheme, seed in sorted(wanted, key=lambda x: (x[1], SCHEMES.index(x[0]))):
        sets = () if scheme == runs.BENCH_CONFIG["outer"]["compression"] else (f"outer.compression={scheme}",)
        out.append((scheme, runs.RunSpec("decoupled", steps, seed=seed, sets=sets,
                                         label=f"decoupled {scheme} seed {seed}")))
    return out


def run(ctx: report.Context) -> dict:
    result = report.new_result(NAME, ctx.mode)
    bench = runs.BENCH_CONFIG
    big = wire_table(MODEL_PRESETS["100m"], 24, 24, 64, 4, encode=ctx.mode == "full") if ctx.mode != "tiny" else None
    small_cfg = ModelConfig(**bench["model"])
    small = wire_table(small_cfg, bench["outer"]["fragments"], bench["outer"]["sync_every"],
                       bench["outer"]["block_size"], 4)
    result["figures"]["wire_100m_paper_schedule"] = big
    result["figures"]["wire_bench_model"] = small

    measured: dict[str, list[dict]] = {s: [] for s in SCHEMES}
    if ctx.mode != "tiny":
        specs = compression_specs(ctx)
        task = ctx.task("bandwidth: compression runs", len(specs))
        for scheme, spec in specs:
            s = runs.ensure(ctx, spec)
            steps = s["steps_trained"] or 1
            measured[scheme].append({"seed": spec.seed, "val_loss": s["val_loss"], "run": s["run_dir"],
                                     "up_per_step": (s["bytes"].get("sent_per_learner_step") or 0.0),
                                     "down_per_step": runs.bytes_down(s) / steps,
                                     "tokens": s["tokens_trained"], "wall_time_s": s["wall_time_s"]})
            task.advance()
        task.done()
    result["figures"]["runs"] = measured
    if any(measured.values()):
        result["notes"].append("down-link: learners fetch merged fragments as fp32 (GET /v1/fragments), so what a "
                               "learner receives per step is far more than it sends; see 'down' in the table")
    _summarize(result, big or small, small, measured)
    plot(result, ctx.out_dir / f"{NAME}.png")
    return result


def _loss_cost(measured: dict[str, list[dict]]) -> dict[str, dict]:
    """Per scheme: relative val-loss change vs `none`, paired by seed, with the spread over seeds."""
    base = {m["seed"]: m["val_loss"] for m in measured.get("none", []) if m["val_loss"] is not None}
    out = {}
    for scheme, ms in measured.items():
        rel = [(m["val_loss"] - base[m["seed"]]) / base[m["seed"]] for m in ms
               if m["seed"] in base and m["val_loss"] is not None]
        if rel:
            out[scheme] = {**report.spread(rel), "val_loss": statistics.fmean(m["val_loss"] for m in ms)}
    return out


def _summarize(result: dict, wire: dict, small: dict, measured: dict) -> None:
    cost = _loss_cost(measured)
    result["figures"]["loss_cost"] = cost
    t = result["table"]
    t["title"] = (f"bandwidth — bytes per learner per inner step, {wire['params'] / 1e6:.1f}M params, "
                  f"P={wire['fragments']}, H={wire['sync_every']}, N={wire['learners']}")
    t["columns"] = ["method", "bytes/step", "× fewer than DDP", "bits/value", "measured in runs (bench model, N=4)",
                    "val loss vs none"]
    t["rows"] = [["DDP (ring all-reduce, fp32)", report_bytes(wire["ddp_per_step"]), "1", "32", "", ""],
                 ["sync DiLoCo (fp32 Δ / H)", report_bytes(wire["sync_diloco_per_step"]),
                  f"{wire['ddp_per_step'] / wire['sync_diloco_per_step']:.0f}", "32", "", ""]]
    for scheme, row in wire["schemes"].items():
        ms = measured.get(scheme) or []
        up = statistics.fmean(m["up_per_step"] for m in ms) if ms else None
        down = statistics.fmean(m["down_per_step"] for m in ms) if ms else None
        ratio_small = small["ddp_per_step"] / up if up else None
        c = cost.get(scheme)
        t["rows"].append([f"decoupled {scheme}", report_bytes(row["per_step"]), f"{row['ddp_ratio']:.0f}",
                          f"{row['bits_per_value']:.2f}",
                          f"up {report_bytes(up)} ({ratio_small:.0f}× < DDP), down {report_bytes(down)}" if up else "-",
                          (f"{100 * c['mean']:+.2f}%" + (f" ± {100 * c['std']:.2f}" if c["n"] > 1 else "")) if c else "-"])
    int4 = wire["schemes"]["int4"]
    ok = int4["ddp_ratio"] >= TARGET_RATIO
    report.target(result, "int4 bytes vs DDP", f"≥ {TARGET_RATIO:.0f}× fewer bytes than DDP",
                  f"{int4['ddp_ratio']:.0f}× (N={wire['learners']}; {int4['ddp_inf_ratio']:.0f}× vs N→∞ DDP)", ok,
                  "" if ok else _why_ratio(wire))
    c = cost.get("int4")
    if c is None:
        report.target(result, "int4 loss cost", f"≤ {100 * TARGET_LOSS:.1f}% extra val loss vs none", "not run",
                      None, "tiny mode runs no training")
    else:
        met = report.decide(c, TARGET_LOSS)
        report.target(result, "int4 loss cost", f"≤ {100 * TARGET_LOSS:.1f}% extra val loss vs none",
                      f"{100 * c['mean']:+.2f}% (seeds: {', '.join(f'{100 * v:+.2f}%' for v in c['values'])})", met,
                      "paired by seed; " + ("the seed-to-seed spread of these asynchronous runs "
                                            f"(±{100 * c['std']:.1f}%) is wider than the 0.5% margin"
                                            if met is None else "one seed: no spread to compare against"
                                            if c["n"] == 1 else ""))


def _why_ratio(wire: dict) -> str:
    int4 = wire["schemes"]["int4"]
    bits = int4["bits_per_value"]
    n = wire["learners"]
    need_h = TARGET_RATIO * bits / (32 * 2 * (n - 1) / n)
    return (f"by construction: int4 with an fp32 scale per {wire['block_size']} values is {bits:.2f} bits on "
            f"1/H of the params per step vs 2·(N−1)/N·32 bits on all of them, i.e. "
            f"{wire['sync_every']}·{64 * (n - 1) / n:.0f}/{bits:.2f}; ≥ 400× needs H ≥ {need_h:.0f} at N={n} "
            "(or larger quantization blocks)")


def report_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def plot(result: dict, path: Path) -> Path:
    fig_data = result["figures"]
    wire = fig_data["wire_100m_paper_schedule"] or fig_data["wire_bench_model"]
    fig, (a, c, b) = report.figure(3, 1, width=5.6, height=4.4)
    labels = ["DDP", "sync\nDiLoCo"] + [f"decoupled\n{s}" for s in wire["schemes"]]
    values = [wire["ddp_per_step"], wire["sync_diloco_per_step"]] + [r["per_step"] for r in wire["schemes"].values()]
    colors = [report.color("ddp"), report.color("sync-diloco")] + [report.color(s) for s in wire["schemes"]]
    bars = a.bar(labels, values, color=colors)
    a.set_yscale("log")
    for bar, v in zip(bars, values):
        a.annotate(f"{report_bytes(v)}\n{wire['ddp_per_step'] / v:,.0f}× less" if v != wire["ddp_per_step"]
                   else report_bytes(v), (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom",
                   fontsize=7, xytext=(0, 2), textcoords="offset points")
    a.axhline(wire["ddp_per_step"] / TARGET_RATIO, color="k", ls=":", lw=1)
    a.annotate(f"target: {TARGET_RATIO:.0f}× less than DDP", (0.02, wire["ddp_per_step"] / TARGET_RATIO),
               xycoords=("axes fraction", "data"), fontsize=8, va="bottom")
    a.set_ylabel("bytes per learner per inner step (log)")
    a.set_title(f"{wire['params'] / 1e6:.0f}M params, P={wire['fragments']}, H={wire['sync_every']}, "
                f"N={wire['learners']}")
    a.margins(y=0.25)

    small, measured = fig_data["wire_bench_model"], fig_data["runs"]
    schemes = [k for k, v in measured.items() if v]
    if schemes:
        ups = [statistics.fmean(r["up_per_step"] for r in measured[k]) for k in schemes]
        downs = [statistics.fmean(r["down_per_step"] for r in measured[k]) for k in schemes]
        x = list(range(len(schemes)))
        c.axhline(small["ddp_per_step"], color=report.color("ddp"), lw=2)
        c.annotate(f"DDP {report_bytes(small['ddp_per_step'])} (each way)", (0.02, small["ddp_per_step"]),
                   xycoords=("axes fraction", "data"), fontsize=8, va="bottom")
        bu = c.bar([i - 0.2 for i in x], ups, 0.4, color=[report.color(k) for k in schemes], label="sent (up)")
        bd = c.bar([i + 0.2 for i in x], downs, 0.4, color="white", edgecolor=[report.color(k) for k in schemes],
                   hatch="..", label="received (down, fp32 fragments)")
        for bars in (bu, bd):
            for bar in bars:
                c.annotate(report_bytes(bar.get_height()), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                           ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
        c.set_yscale("log")
        c.set_xticks(x, schemes)
        c.set_ylabel("bytes per learner per inner step (log)")
        c.set_title(f"measured in the runs ({small['params'] / 1e6:.2f}M params, P={small['fragments']}, "
                    f"H={small['sync_every']})")
        c.legend(fontsize=7, loc="lower left")
        c.margins(y=0.3)
    else:
        c.text(0.5, 0.5, "no training runs in this mode", ha="center", va="center", transform=c.transAxes)
        c.set_axis_off()

    cost = fig_data["loss_cost"]
    if cost:
        schemes = [s for s in wire["schemes"] if s in cost]
        means = [100 * cost[s]["mean"] for s in schemes]
        errs = [100 * cost[s]["std"] for s in schemes]
        bars = b.bar(schemes, means, yerr=errs, capsize=4, color=[report.color(s) for s in schemes])
        for s, bar in zip(schemes, bars):
            for v in cost[s]["values"]:
                b.plot(bar.get_x() + bar.get_width() / 2, 100 * v, "k.", ms=5)
        b.axhline(100 * TARGET_LOSS, color="k", ls=":", lw=1)
        b.annotate(f"target ≤ +{100 * TARGET_LOSS:.1f}%", (0.02, 100 * TARGET_LOSS), xycoords=("axes fraction", "data"),
                   fontsize=8, va="bottom")
        b.axhline(0, color="#444444", lw=0.8)
        b.set_ylabel("val loss change vs none (%)")
        b.set_title(f"loss cost vs none ({max(c['n'] for c in cost.values())} seed(s), dots = seeds)")
    else:
        b.text(0.5, 0.5, "no training runs in this mode", ha="center", va="center", transform=b.transAxes)
        b.set_axis_off()
    return report.save(fig, path, "Bandwidth: what a learner sends per inner step, and what compression costs",
                       report.footnote(result))
