"""summary.json and plot.png of a finished run, computed from the run directory alone."""

from __future__ import annotations

from pathlib import Path

from diloco_trainer.config import TrainConfig
from diloco_trainer.goodput import goodput
from diloco_trainer.protocol.messages import MetricsRecord
from diloco_trainer.protocol.runfiles import (FinalState, RunEvent, SyncerFinalState, read_events, read_final_state,
                                              starts_by_name)
from diloco_trainer.runtime import report
from diloco_trainer.runtime.ledger import run_ledger
from diloco_trainer.runtime.plot import Curve, plot_run
from diloco_trainer.runtime.rundir import (as_record, learner_slots, learner_totals, metrics_records, read_jsonl, split_incarnations,
                     write_json)


def learner_curve(name: str, records: list, starts: list[float], t0: float, deaths: list[float] = ()) -> Curve:
    """Training loss over the run with tokens accumulated across incarnations, outages marked."""
    curve = Curve(name, deaths_s=[d - t0 for d in deaths])
    carried = 0.0
    for i, group in enumerate(split_incarnations([as_record(r) for r in records], starts)):
        points = [rec for rec in group if rec.loss is not None]
        if i > 0 and points:
            curve.breaks.append(len(curve.time_s))
            curve.restarts_s.append(points[0].time - t0)
        for rec in points:
            curve.time_s.append(rec.time - t0)
            curve.tokens.append(carried + rec.tokens)
            curve.loss.append(rec.loss)
        if group:
            carried += group[-1].tokens
    return curve


def merged_by_learner(state: FinalState | None) -> dict[str, dict]:
    """Per-learner merged counters from the syncer's final state ({id: {tokens_merged, steps_merged}})."""
    learners = state.learners if isinstance(state, SyncerFinalState) else {}
    return {lid: {"tokens_merged": v.tokens_merged, "steps_merged": v.steps_merged} for lid, v in learners.items()}


def build_summary(run_dir: Path, cfg: TrainConfig, mode: str, n_learners: int, val_tokens, unigram: float | None,
                  wall_time_s: float, stop_reason: str, eval_batches: int, t0: float,
                  outer_gradient_bytes: float | None = None) -> tuple[dict, list[Curve], list[tuple]]:
    """Everything worth keeping about a run: losses, tokens, goodput, restarts, bytes vs DDP.

    Returns (summary, learner curves, global-model eval points) so the caller can also plot.
    """
    import torch

    from diloco_trainer.model.build import build_model, count_parameters

    events = read_events(run_dir)
    starts = starts_by_name(events)
    params = count_parameters(build_model(cfg.model, cfg.seed))
    if params < 5_000_000:  # small matmuls gain nothing from threads, and lose a lot on a busy machine
        torch.set_num_threads(1)
    per_learner, curves, final_lines = _per_learner(run_dir, events, starts, t0)
    steps = sum(v["step"] for v in per_learner.values())
    tokens = sum(v["tokens"] for v in per_learner.values())
    evals, val_loss = _global_evals(run_dir, cfg, val_tokens, eval_batches, t0, wall_time_s, tokens)
    summary: dict = {
        "mode": mode, "run_dir": str(run_dir), "learners": n_learners, "params": params,
        "stop_reason": stop_reason, "wall_time_s": wall_time_s, "val_loss": val_loss, "unigram_loss": unigram,
        "loss_unit": f"nats/{cfg.data.token_unit}",
        "steps_trained": steps, "tokens_trained": tokens,
        "restarts": {n: len(s) - 1 for n, s in starts.items() if len(s) > 1},
        "per_learner": per_learner,
        "global_evals": [{"time_s": t, "tokens": n, "val_loss": v} for t, n, v in evals],
    }
    if mode == "decoupled":
        slots = _merge_figures(summary, run_dir, cfg)
    else:
        summary.update(sync_job_figures(events, final_lines, cfg.inner.batch_size * cfg.model.seq_len))
        slots = learner_slots(run_dir, None)
    figures = goodput(slots.values())  # the project's one definition: see goodput.py
    summary["goodput"], summary["merged_fraction"] = figures["goodput"], figures["merged_fraction"]
    summary["bytes"] = _bytes(cfg, mode, n_learners, params, steps, per_learner, outer_gradient_bytes)
    return summary, curves, evals


def _per_learner(run_dir: Path, events: list[RunEvent], starts: dict, t0: float
                 ) -> tuple[dict[str, dict], list[Curve], dict[str, MetricsRecord]]:
    """Per learner: its totals (steps, tokens, bytes, final loss and parameter hash), its loss curve, its last
    metrics line."""
    per_learner, curves, final_lines = {}, [], {}
    for d in sorted((run_dir / "learners").iterdir()) if (run_dir / "learners").exists() else []:
        records = metrics_records(d / "metrics.jsonl")
        per_learner[d.name] = learner_totals(records, starts.get(d.name, []))
        lives = [g for g in split_incarnations(records, starts.get(d.name, [])) if g]
        per_learner[d.name]["bytes_up"] = sum(g[-1].bytes_up for g in lives)
        per_learner[d.name]["bytes_down"] = sum(g[-1].bytes_down for g in lives)
        per_learner[d.name]["final_loss"] = records[-1].loss if records else None
        if records:
            final_lines[d.name] = records[-1]
        if records and records[-1].param_sha256:
            per_learner[d.name]["param_sha256"] = records[-1].param_sha256
        deaths = [e.time for e in events if e.name == d.name and e.event == "exit" and e.code != 0]
        curves.append(learner_curve(d.name, records, starts.get(d.name, []), t0, deaths))
    return per_learner, curves, final_lines


def _global_evals(run_dir: Path, cfg: TrainConfig, val_tokens, eval_batches: int, t0: float, wall_time_s: float,
                  tokens: int) -> tuple[list[tuple[float, float, float]], float | None]:
    """The global model's validation loss at each snapshot (a quarter of the final evaluation's batches is plenty
    for a plot point) and at the end: (points, final loss)."""
    evals: list[tuple[float, float, float]] = []
    for snap in read_jsonl(run_dir / "snapshots" / "index.jsonl"):
        theta = report.load_theta(run_dir / "snapshots" / snap["file"])
        loss = report.evaluate_theta(cfg, theta, val_tokens, max(1, eval_batches // 4), cfg.inner.batch_size)
        evals.append((float(snap["time"]) - t0, float(snap.get("tokens", 0)), loss))
    val_loss = None
    final = run_dir / "final" / "theta.safetensors"
    if final.exists():
        val_loss = report.evaluate_theta(cfg, report.load_theta(final), val_tokens, eval_batches,
                                         cfg.inner.batch_size)
        evals.append((wall_time_s, float(tokens), val_loss))
    return evals, val_loss


def _merge_figures(summary: dict, run_dir: Path, cfg: TrainConfig) -> dict:
    """A decoupled run's syncer figures into `summary` (outer steps, what was merged of each learner); returns the
    learners' goodput slots."""
    state = read_final_state(run_dir)
    merged = merged_by_learner(state)
    summary["syncer"] = ({"outer_steps": state.outer_steps, "versions": state.versions}
                         if isinstance(state, SyncerFinalState) else {})
    summary["syncer"]["shards"] = cfg.syncer.shards
    summary["merged"] = merged
    summary["tokens_merged"] = sum(m["tokens_merged"] for m in merged.values())  # summed over the fragments
    summary["fragments"] = cfg.outer.fragments
    summary["tokens_merged_per_fragment"] = summary["tokens_merged"] / cfg.outer.fragments  # vs tokens_trained
    learners = state.learners if isinstance(state, SyncerFinalState) else {}
    ledger = run_ledger(run_dir, {lid: {"steps_merged": v.steps_merged,
                                        "lives": [{"id": w.id, "steps_merged": w.steps_merged} for w in v.lives]}
                                  for lid, v in learners.items()})
    if ledger is not None:
        summary["ledger"] = ledger
    return learner_slots(run_dir, {lid: m["steps_merged"] for lid, m in merged.items()}, cfg.outer.fragments)


def _bytes(cfg: TrainConfig, mode: str, n_learners: int, params: int, steps: int, per_learner: dict[str, dict],
           outer_gradient_bytes: float | None) -> dict:
    """Bytes sent and received per learner step, beside what DDP's ring all-reduce would send."""
    measured = sum(v["bytes_up"] for v in per_learner.values())
    received = sum(v["bytes_down"] for v in per_learner.values())
    if mode == "decoupled":
        source = "measured by the learners" if measured else "measured at the syncer"
        sent = measured or outer_gradient_bytes
    else:
        source, sent = f"ring all-reduce formula, N={n_learners}", measured
    ddp = report.ddp_bytes_per_step(params, n_learners)
    return {
        "sent_per_learner_step": sent / steps if sent and steps else None,
        "received_per_learner_step": received / steps if received and steps else None,
        "received_over_sent": received / sent if received and sent else None,
        "downlink": cfg.outer.downlink if mode == "decoupled" else None,
        "source": source,
        "ddp_per_learner_step": ddp,
        "ddp_formula": f"2·(N−1)/N · 4 B · params = 2·{n_learners - 1}/{n_learners} · 4 · {params:,} "
                       f"= {ddp:,.0f} B (ring all-reduce of fp32 gradients every step)",
        "wire_estimate_per_learner_step": report.wire_bytes_estimate(
            params, cfg.outer.compression, cfg.outer.block_size, cfg.outer.sync_every),
    }


def sync_job_figures(events: list[RunEvent], final_lines: dict[str, MetricsRecord], tokens_per_step: int) -> dict:
    """A synchronous baseline's restarts and lost work.

    Work kept is what the final model holds: each worker's steps synced up to its last line (the checkpoint step
    its incarnation resumed from plus what it synced since); `lost_steps` (from the job_restart events) were
    trained and thrown away by a restart. Goodput and the merged fraction come from goodput.py like every run's.
    """
    restarts = [e for e in events if e.event == "job_restart"]
    useful = sum(r.resumed_from_step + r.acked_steps for r in final_lines.values())
    lost = sum(e.lost_steps or 0 for e in restarts)
    return {"restarts": len(restarts), "lost_steps": lost, "lost_tokens": lost * tokens_per_step,
            "tokens_merged": useful * tokens_per_step}


def write_outputs(run_dir: Path, summary: dict, curves: list[Curve], evals: list[tuple], title: str) -> None:
    """summary.json and plot.png."""
    write_json(run_dir / "summary.json", summary)
    plot_run(run_dir / "plot.png", curves, evals, summary.get("unigram_loss"), title,
             unit=summary.get("loss_unit", "nats/byte"))
