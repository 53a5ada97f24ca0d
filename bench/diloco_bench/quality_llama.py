"""Quality on the real-model path: a Llama-style transformers model (inline config: RoPE, RMSNorm, SwiGLU, grouped-query
attention, tied embeddings) on BPE token shards, trained by DDP, synchronous DiLoCo and Decoupled DiLoCo at the same
tokens; validation loss in nats/token beside the unigram baseline of those tokens, tokens/s and wall time.

The data is made with the public commands a user runs: `diloco data tokenizer` (a byte-level BPE) and `diloco data
prepare` (memory-mapped shards) on the Python standard library's top-level modules (on every machine with Python)."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

from diloco_trainer.data.corpus import stdlib_root
from diloco_trainer.runtime import procs

from . import report, runs
from .quality import TARGET_VS_DDP, TARGET_VS_SYNC, relative

NAME = "quality_llama"
METHODS = ("ddp", "sync-diloco", "decoupled")


def llama(ctx: report.Context) -> dict:
    """The model.hf config: ~0.86M parameters in full mode (the byte GPT benchmark model's size), smaller otherwise."""
    hidden, layers, vocab = ctx.pick((32, 2, 384), (64, 2, 512), (128, 4, 1024))
    return {"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": hidden * 8 // 3,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 128, "tie_word_embeddings": True}


def steps(ctx: report.Context) -> int:
    return ctx.pick(12, 64, 112)  # full: ~0.9M tokens, the three methods in ~10 min on 2 cores


def corpus_files(ctx: report.Context) -> list[Path]:
    """The stdlib's top-level modules (168 files, 4.7 MB on CPython 3.11); the first 20 in tiny mode."""
    files = sorted(p for p in stdlib_root().glob("*.py") if p.is_file())
    return files[:ctx.pick(20, len(files), len(files))]


def prepare_data(ctx: report.Context) -> Path:
    """tokenizer.json and shards/ under the results directory, made by `diloco data tokenizer` and `diloco data
    prepare` (a re-run of the suite into the same directory reuses both)."""
    data = ctx.out_dir / "llama-data"
    data.mkdir(parents=True, exist_ok=True)
    files = [str(f) for f in corpus_files(ctx)]
    tokenizer = data / "tokenizer.json"
    if not tokenizer.exists():
        _diloco("data", "tokenizer", *files, "--vocab", str(llama(ctx)["vocab_size"]), "--out", str(tokenizer))
    # Several shard files: validation is the last val_fraction of every file, so it samples the whole corpus.
    _diloco("data", "prepare", *files, "--tokenizer", str(tokenizer), "--out", str(data / "shards"),
            "--shard-tokens", str(ctx.pick(1 << 14, 1 << 18, 1 << 18)), "--no-progress")
    return data


def _diloco(*args: str) -> None:
    out = subprocess.run(procs.diloco_argv(*args), env=procs.child_env(), capture_output=True, text=True,
                         cwd=report.REPO, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"diloco {args[0]} {args[1]} failed (exit {out.returncode}): {out.stderr[-2000:]}")


def spec(ctx: report.Context, method: str, seed: int, data: Path) -> runs.RunSpec:
    """The benchmark's outer and inner settings (runs.BENCH_CONFIG) with the Llama, the shards and the BPE."""
    model = {"seq_len": ctx.pick(64, 128, 128), "hf": llama(ctx)}
    source = {"source": "shards", "path": str(data / "shards"), "tokenizer": str(data / "tokenizer.json"),
              "val_fraction": 0.05}
    sets = (f"model={json.dumps(model)}", f"data={json.dumps(source)}",
            f"inner.batch_size={ctx.pick(8, 16, 16)}", f"outer.sync_every={ctx.pick(4, 16, 16)}")
    return runs.RunSpec(method, steps(ctx), seed=seed, sets=sets, label=f"llama {method} seed {seed}")


def run(ctx: report.Context) -> dict:
    result = report.new_result(NAME, ctx.mode)
    data = prepare_data(ctx)
    ctx.log(f"  llama data: {data}")
    seeds = list(range(ctx.seeds or 1))  # one seed unless --seeds asks for more: three runs keep the suite < 1.5 h
    todo = [(method, seed) for seed in seeds for method in METHODS]
    task = ctx.task("quality (llama) runs", len(todo))
    per: dict[str, list[dict]] = {}
    for method, seed in todo:
        s = runs.ensure(ctx, spec(ctx, method, seed, data))
        per.setdefault(method, []).append({
            "seed": seed, "val_loss": s["val_loss"], "unigram": s["unigram_loss"], "tokens": s["tokens_trained"],
            "wall_time_s": s["wall_time_s"], "tokens_per_s": runs.learner_tokens_per_s(s), "params": s["params"],
            "cpu_s": (s.get("usage") or {}).get("cpu_s"),  # the run's own processes: load-independent, unlike wall time
            "merged_fraction": s.get("merged_fraction"), "stop_reason": s["stop_reason"],
            "curve": dict(zip(("time_s", "tokens", "val_loss"), runs.val_curve(s))), "run": s["run_dir"]})
        task.advance()
    task.done()
    fig = result["figures"]
    fig.update(runs=per, steps_per_learner=steps(ctx), learners=4, model=llama(ctx), data=str(data),
               corpus_files=len(corpus_files(ctx)))
    _summarize(result, per)
    plot(result, ctx.out_dir / f"{NAME}.png")
    return result


def _summarize(result: dict, per: dict[str, list[dict]]) -> None:
    fig = result["figures"]
    t = result["table"]
    first = next(iter(per.values()))[0]
    t["title"] = (f"quality, Llama-style model ({first['params']:,} parameters, BPE {fig['model']['vocab_size']}) — "
                  f"final validation loss (nats/token), 4 learners × {fig['steps_per_learner']} steps, "
                  f"{max(len(rs) for rs in per.values())} seed(s)")
    t["columns"] = ["method", "val loss", "unigram", "vs DDP", "vs sync DiLoCo", "tokens", "tokens/s", "wall time",
                    "CPU time"]
    fig["summary"] = {}
    for method, rs in per.items():
        sp = report.spread([r["val_loss"] for r in rs if r["val_loss"] is not None])
        row = {"val_loss": sp, "unigram": statistics.fmean(r["unigram"] for r in rs),
               "vs_ddp": relative(per, method, "ddp"), "vs_sync": relative(per, method, "sync-diloco"),
               "tokens": statistics.fmean(r["tokens"] for r in rs),
               "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in rs),
               "wall_time_s": statistics.fmean(r["wall_time_s"] for r in rs),
               "cpu_s": statistics.fmean(r["cpu_s"] for r in rs) if all(r["cpu_s"] for r in rs) else None}
        fig["summary"][method] = row
        t["rows"].append([method, f"{sp['mean']:.4f}" + (f" ± {sp['std']:.4f}" if sp["n"] > 1 else ""),
                          f"{row['unigram']:.4f}", _pct(row["vs_ddp"]), _pct(row["vs_sync"]), f"{row['tokens']:,.0f}",
                          f"{row['tokens_per_s']:,.0f}", f"{row['wall_time_s']:.0f} s",
                          f"{row['cpu_s']:.0f} s" if row["cpu_s"] else "-"])
    tokens = {m: s["tokens"] for m, s in fig["summary"].items()}
    if max(tokens.values()) > 1.02 * min(tokens.values()):
        result["notes"].append(f"runs did not all train the same tokens (a time budget cut some short): {tokens}")
    s = fig["summary"].get("decoupled", {})
    if s.get("vs_ddp"):
        report.target(result, "llama: decoupled vs DDP", f"val loss within {100 * TARGET_VS_DDP:.0f}% of DDP",
                      _pct(s["vs_ddp"]), report.decide(s["vs_ddp"], TARGET_VS_DDP),
                      "BPE tokens on a Llama-style transformers model; same settings as `quality`")
    if s.get("vs_sync"):
        report.target(result, "llama: decoupled vs sync DiLoCo", f"within {100 * TARGET_VS_SYNC:.0f}%",
                      _pct(s["vs_sync"]), report.decide(s["vs_sync"], TARGET_VS_SYNC))
    beaten = all(r["val_loss"] is not None and r["val_loss"] < r["unigram"] for rs in per.values() for r in rs)
    report.target(result, "llama: every method learns", "validation loss below the unigram baseline",
                  f"unigram {statistics.fmean(r['unigram'] for rs in per.values() for r in rs):.3f} nats/token",
                  beaten)


def _pct(sp: dict | None) -> str:
    if not sp:
        return "-"
    return f"{100 * sp['mean']:+.2f}%" + (f" ± {100 * sp['std']:.2f}" if sp["n"] > 1 else "")


def plot(result: dict, path: Path) -> Path:
    """Validation loss of the global model against tokens trained, one curve per method (seed 0), and the unigram
    baseline."""
    per = result["figures"]["runs"]
    fig, (ax,) = report.figure(1, 1, width=8.0, height=5.0)
    later = []  # every evaluation after Θ₀'s
    for method, rs in per.items():
        c = rs[0]["curve"]
        if c["tokens"]:
            ax.plot(c["tokens"], c["val_loss"], "o-", ms=3, color=report.color(method), label=method)
            later += c["val_loss"][1:]
    uni = per[next(iter(per))][0]["unigram"]
    ax.axhline(uni, color="k", ls=":", lw=1)
    ax.annotate("unigram baseline", (0.6, uni), xycoords=("axes fraction", "data"), fontsize=8, va="bottom")
    if later:  # Θ₀'s loss (~ln vocab) would flatten everything else
        ax.set_ylim(min(later) - 0.1, max(uni * 1.15, min(max(later), uni * 1.6)) + 0.05)
    ax.set_xlabel("tokens trained (all learners)")
    ax.set_ylabel("validation loss of the global model (nats/token)")
    ax.set_title(f"Llama-style model, BPE {result['figures']['model']['vocab_size']}, "
                 f"4 learners × {result['figures']['steps_per_learner']} steps (seed 0)")
    ax.legend(fontsize=8)
    return report.save(fig, path, "Llama path: Decoupled DiLoCo vs DDP vs sync DiLoCo",
                       report.footnote(result))
