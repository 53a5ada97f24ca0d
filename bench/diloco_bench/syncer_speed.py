"""Syncer speed: accept (decode + spool) and merge + outer step per fragment through the syncer's own code,
each as a ratio to one plain `torch.add` pass over the same tensors timed alternately in the same run.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch

from diloco_trainer.config import MODEL_PRESETS, OuterConfig, TrainConfig
from diloco_trainer.model.gpt import build_model
from diloco_trainer.syncer.state import SyncerState
from diloco_trainer.protocol.wire import SubmissionMeta, decode_submission, encode_submission, quantize

from . import report

NAME = "syncer_speed"
BLOCK = 64
DELTA_STD = 1e-3  # typical size of an outer gradient element after H inner AdamW steps


def make_state(preset: str, fragments: int, directory: Path) -> SyncerState:
    """A real syncer state (Θ₀ of the preset, P fragments) in `directory`, with outer momentum buffers present
    as in a running syncer."""
    model_cfg = MODEL_PRESETS[preset].model_copy()
    with torch.device("meta"):  # count tensors without allocating: P can be at most that
        fragments = min(fragments, sum(1 for _ in build_model(model_cfg).parameters()))
    cfg = TrainConfig(model=model_cfg,
                      outer=OuterConfig(fragments=fragments, sync_every=max(fragments, 24), compression="int4",
                                        block_size=BLOCK))
    state = SyncerState(cfg, directory)
    for p in range(state.num_fragments):  # momentum as after some merges: Nesterov then reads its buffer too
        state.outer[p].load_state_dict({n: torch.full_like(t, DELTA_STD) for n, t in state.fragment(p).items()})
    return state


def submission(state: SyncerState, p: int, learner: str, scheme: str, gen: torch.Generator) -> bytes:
    """An outer-gradient body for fragment p as a learner encodes it (random Δ of a realistic scale)."""
    shapes = state.fragment_shapes(p)
    parts = {n: quantize(torch.randn(s, generator=gen) * DELTA_STD, scheme, BLOCK) for n, s in shapes.items()}
    meta = SubmissionMeta(learner, f"{learner}-{p}-{state.versions[p]}", p, state.versions[p], 24, 24 * 2048)
    return encode_submission(meta, parts, scheme, BLOCK, shapes)


def contributions(state: SyncerState, p: int, bodies: list[bytes]):
    return [state.new_contribution(p, *decode_submission(b, state.fragment_shapes(p))) for b in bodies]


def add_pass(tensors: list[dict[str, torch.Tensor]], current: dict[str, torch.Tensor]):
    """The memory-bandwidth reference: one torch.add per submitted tensor (read Δ and Θ, write one output)."""
    out = {n: torch.empty_like(t) for n, t in current.items()}

    def run():
        for d in tensors:
            for n, t in d.items():
                torch.add(current[n], t, out=out[n])
    return run


def time_merge(state: SyncerState, p: int, contribs, repeats: int) -> dict:
    """compute_merge (re-anchor, token weights, RDA/mean, Nesterov on copies) vs the add pass over the deltas."""
    current = state.fragment(p)
    merge = lambda: state.compute_merge(p, contribs, current, state.outer[p])  # noqa: E731
    ref = add_pass([c.delta for c in contribs], current)
    r = report.paired(merge, ref, repeats)
    n = sum(t.numel() for t in current.values())
    r["reference_gbps"] = 3 * 4 * n * len(contribs) / r["reference_s"] / 1e9  # read Δ, read Θ, write
    return r


def time_accept(state: SyncerState, p: int, body: bytes, repeats: int) -> dict:
    """What the syncer does per submission before its 202: decode_submission (parse, validate, dequantize)
    and the fsynced spool write of θ_m, each vs one add pass over the fragment."""
    shapes = state.fragment_shapes(p)
    current = state.fragment(p)
    ref = add_pass([current], current)
    decode = report.paired(lambda: decode_submission(body, shapes), ref, repeats)
    c = contributions(state, p, [body])[0]
    spool = report.paired(lambda: state.spool.write("bench.safetensors", c.learner_params(), c.spool_meta()),
                          ref, repeats)
    return {"decode": decode, "spool": spool}


def run(ctx: report.Context) -> dict:
    """One thread, as a ratio is only steady when the measured code and its reference get the same CPU: with
    two threads on a shared machine, every op waits for whichever thread was descheduled."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(ctx)
    finally:
        torch.set_num_threads(threads)


def _run(ctx: report.Context) -> dict:
    result = report.new_result(NAME, ctx.mode)
    result["env"]["torch_threads"] = 1
    preset = ctx.pick("tiny", "base", "100m")
    P = ctx.pick(4, 24, 24)
    M = 4
    repeats = ctx.pick(1, 3, 3)
    sweep_m = ctx.pick([2, 4], [2, 4, 8, 16], [2, 4, 8, 16])
    sizes = ctx.pick(["tiny"], ["tiny", "small"], ["tiny", "small", "base", "100m"])
    sample = ctx.pick(4, 6, 24)  # fragments timed one by one (evenly spread over the plan)
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="diloco-bench-") as tmp:
        ctx.log(f"syncer speed: building the {preset} syncer state ({P} fragments)")
        state = make_state(preset, P, Path(tmp) / preset)
        nfrag = state.num_fragments
        frags = sorted({round(i * (nfrag - 1) / max(1, sample - 1)) for i in range(min(sample, nfrag))})
        params = sum(t.numel() for t in state.theta.values())
        result["figures"]["model"] = {"preset": preset, "params": params, "fragments": state.num_fragments,
                                      "learners": M, "compression": "int4", "block_size": BLOCK}

        task = ctx.task(f"merge + outer step per fragment ({preset}, M={M})", len(frags))
        per_fragment = []
        for p in frags:
            bodies = [submission(state, p, f"learner-{m}", "int4", gen) for m in range(M)]
            merge = time_merge(state, p, contributions(state, p, bodies), repeats)
            accept = time_accept(state, p, bodies[0], repeats)
            numel = sum(t.numel() for t in state.fragment(p).values())
            per_fragment.append({"fragment": p, "params": numel, "body_bytes": len(bodies[0]), "merge": merge,
                                 **accept})
            task.advance()
        task.done()
        result["figures"]["per_fragment"] = per_fragment

        biggest = max(range(state.num_fragments), key=lambda q: sum(t.numel() for t in state.fragment(q).values()))
        task = ctx.task(f"merge time vs learners (fragment {biggest})", len(sweep_m))
        by_m = []
        pool = [submission(state, biggest, f"learner-{i}", "int4", gen) for i in range(max(sweep_m))]
        for m in sweep_m:
            bodies = pool[:m]
            by_m.append({"learners": m, **time_merge(state, biggest, contributions(state, biggest, bodies), repeats)})
            task.advance()
        task.done()
        result["figures"]["by_learners"] = by_m
        del state, pool

        task = ctx.task("whole-model merge vs model size", len(sizes))
        by_size = []
        for name in sizes:
            if name == preset and len(per_fragment) == nfrag:  # every fragment was timed above: the whole model
                total = {k: sum(f["merge"][k] for f in per_fragment) for k in ("time_s", "reference_s")}
                n, nf = params, nfrag
            else:
                st = make_state(name, min(P, 24), Path(tmp) / f"size-{name}")
                total = {"time_s": 0.0, "reference_s": 0.0}
                for p in range(st.num_fragments):
                    bodies = [submission(st, p, f"learner-{i}", "int4", gen) for i in range(M)]
                    r = time_merge(st, p, contributions(st, p, bodies), max(1, repeats - 1))
                    total["time_s"] += r["time_s"]
                    total["reference_s"] += r["reference_s"]
                n, nf = sum(t.numel() for t in st.theta.values()), st.num_fragments
                del st
            by_size.append({"preset": name, "params": n, "fragments": nf, **total,
                            "ratio": total["time_s"] / total["reference_s"], "ns_per_param": 1e9 * total["time_s"] / n})
            task.advance()
        result["figures"]["by_size"] = by_size

    _summarize(result, per_fragment, by_m, by_size, M)
    plot(result, ctx.out_dir / f"{NAME}.png")
    return result


def _summarize(result: dict, per_fragment: list[dict], by_m: list[dict], by_size: list[dict], M: int) -> None:
    fig = result["figures"]
    merge_ms = [f["merge"]["time_s"] * 1e3 for f in per_fragment]
    ratios = [f["merge"]["ratio"] for f in per_fragment]
    decode_ratio = [f["decode"]["ratio"] for f in per_fragment]
    fig["summary"] = {
        "merge_ms_median": statistics.median(merge_ms), "merge_ms_max": max(merge_ms),
        "merge_ratio_median": statistics.median(ratios),
        "decode_ms_median": statistics.median(f["decode"]["time_s"] * 1e3 for f in per_fragment),
        "decode_ratio_median": statistics.median(decode_ratio),
        "spool_ms_median": statistics.median(f["spool"]["time_s"] * 1e3 for f in per_fragment),
        "reference_gbps_median": statistics.median(f["merge"]["reference_gbps"] for f in per_fragment),
        # A round: every fragment merged once (M submissions each), i.e. what the syncer does per H steps.
        "round_s_estimate": statistics.mean(merge_ms) * fig["model"]["fragments"] / 1e3,
    }
    s = fig["summary"]
    m16 = next((r for r in by_m if r["learners"] == max(x["learners"] for x in by_m)), None)
    t = result["table"]
    t["title"] = (f"syncer speed — {fig['model']['preset']} ({fig['model']['params'] / 1e6:.1f}M params, "
                  f"P={fig['model']['fragments']}, int4)")
    t["columns"] = ["what", "time (best of N)", "× add pass", "note"]
    t["rows"] = [
        [f"merge + outer step, 1 fragment, M={M}", f"{s['merge_ms_median']:.0f} ms",
         f"{s['merge_ratio_median']:.1f}×", f"add pass at {s['reference_gbps_median']:.1f} GB/s"],
        ["decode_submission (int4), 1 fragment", f"{s['decode_ms_median']:.0f} ms", f"{s['decode_ratio_median']:.1f}×",
         "parse + validate + dequantize"],
        ["spool write (fsync), 1 fragment", f"{s['spool_ms_median']:.0f} ms", "", "before the 202"],
        [f"whole model, M={M} (one round)", f"{s['round_s_estimate']:.2f} s", "", "every fragment once"],
    ]
    for r in by_m:
        t["rows"].append([f"merge, biggest fragment, M={r['learners']}", f"{r['time_s'] * 1e3:.0f} ms",
                          f"{r['ratio']:.1f}×", ""])
    for r in by_size:
        t["rows"].append([f"whole-model merge, {r['preset']} ({r['params'] / 1e6:.2f}M)", f"{r['time_s'] * 1e3:.0f} ms",
                          f"{r['ratio']:.1f}×", f"{r['ns_per_param']:.1f} ns/param"])
    if m16 is not None:
        ok = m16["time_s"] < 1.0
        report.target(result, "syncer keeps up (suite's own target; the issue sets none)",
                      f"merge of one fragment with M={m16['learners']} < 1 s (P=H=24: one fragment per 1 s step)",
                      f"{m16['time_s'] * 1e3:.0f} ms ({m16['ratio']:.1f}× an add pass)", ok,
                      "" if ok else "merge slower than one fragment per second on this CPU")
    report.target(result, "merge cost vs memory bandwidth", "reported (no target)",
                  f"{s['merge_ratio_median']:.1f}× one add pass over the same deltas", None,
                  "the merge reads each Δ several times (re-anchor, norm, normalize, accumulate) and steps Nesterov")


def plot(result: dict, path: Path) -> Path:
    fig_data = result["figures"]
    fig, (a, b, c) = report.figure(3, 1, width=5.2, height=4.2)
    pf = fig_data["per_fragment"]
    x = list(range(len(pf)))  # categorical: the timed fragments may be a sample of the plan
    a.bar([i - 0.2 for i in x], [f["merge"]["time_s"] * 1e3 for f in pf], 0.4, label="merge + outer step",
          color=report.color("decoupled"))
    a.bar([i + 0.2 for i in x], [f["merge"]["reference_s"] * 1e3 for f in pf], 0.4,
          label="add pass over same Δs", color="#bbbbbb")
    a.plot(x, [f["decode"]["time_s"] * 1e3 for f in pf], "o-", color=report.color("int8"), ms=3,
           label="decode (int4), one body")
    step = max(1, len(pf) // 12)
    a.set_xticks(x[::step], [f"{pf[i]['fragment']}\n{pf[i]['params'] / 1e6:.1f}M" for i in x[::step]], fontsize=7)
    a.set_xlabel("fragment (parameters)")
    a.set_ylabel("ms")
    a.set_title(f"per fragment, M={fig_data['model']['learners']}: "
                f"{fig_data['summary']['merge_ratio_median']:.1f}× an add pass")
    a.legend(fontsize=8)

    bm = fig_data["by_learners"]
    ms = [r["learners"] for r in bm]
    b.plot(ms, [r["time_s"] * 1e3 for r in bm], "o-", color=report.color("decoupled"), label="merge + outer step")
    b.plot(ms, [r["reference_s"] * 1e3 for r in bm], "s--", color="#999999", label="add pass")
    for r in bm:
        b.annotate(f"{r['ratio']:.1f}×", (r["learners"], r["time_s"] * 1e3), xytext=(4, 4),
                   textcoords="offset points", fontsize=8)
    b.set_xscale("log", base=2)
    b.set_xticks(ms, [str(m) for m in ms])
    b.set_xlabel("learners (submissions merged)")
    b.set_ylabel("ms")
    b.set_title("largest fragment: time vs learners")
    b.legend(fontsize=8)

    bs = fig_data["by_size"]
    n = [r["params"] for r in bs]
    c.loglog(n, [r["time_s"] for r in bs], "o-", color=report.color("decoupled"), label="whole-model merge (M=4)")
    c.loglog(n, [r["reference_s"] for r in bs], "s--", color="#999999", label="add pass")
    for r in bs:
        c.annotate(r["preset"], (r["params"], r["time_s"]), xytext=(4, -10), textcoords="offset points", fontsize=8)
    c.set_xlabel("parameters")
    c.set_ylabel("seconds")
    c.set_title("whole model vs size")
    c.legend(fontsize=8)
    return report.save(fig, path, "Syncer speed: merge + outer Nesterov step (real syncer code path)",
                       report.footnote(result))
