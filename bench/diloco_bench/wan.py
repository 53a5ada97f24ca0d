"""Across the WAN: DDP, synchronous DiLoCo and Decoupled DiLoCo with every process behind an emulated slow link
(netns.py: a network namespace per process, tc rate limits, delay and jitter), at two link speeds scaled so that
communication weighs on this model what it weighs in the paper's 12B run over 2-5 Gbps; then one learner behind a
slower, longer link.

Scaling: a link's load is (bytes a worker moves per sync) / (link rate × compute time per inner step × H), i.e.
the required bandwidth over the link rate. The paper: data-parallel training needs 198 Gbps, its links have 5 and
2 Gbps, so DDP's load there is 198/5 ≈ 40 and 198/2 = 99. Here DDP's required bandwidth is the ring all-reduce of
fp32 gradients, 2·(N−1)/N · 4 B · params, every inner step of the step time measured in this run; each link gets
that divided by the paper's load. Every other method then sees the same link, as in the paper.

Synchronous methods compute the same thing whatever the link (the link only changes when): their loss per token
comes from a run on loopback, their tokens/s from a short run over the links, and their time to the target loss
is the one divided by the other. Decoupled's trajectory depends on timing, so it runs over the links until it
reaches the target (or its time runs out).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from diloco_trainer.config import ModelConfig

from . import netns, report, runs
from .bandwidth import _shapes
from .heterogeneity import time_to

NAME = "wan"
METHODS = ("ddp", "sync-diloco", "decoupled")
PAPER = {"model": "12B", "ddp_required_gbps": 198.0, "claim": "> 20× faster than synchronous training"}
LINKS_GBPS = (5.0, 2.0)  # the paper's link speeds, each becoming one emulated link speed here
DELAY_MS, JITTER_MS = 10.0, 2.0  # one way, each site to the hub: 40 ms ± 8 round trip between two sites
SLOW = {"rate": 0.5, "delay_ms": 30.0, "jitter_ms": 5.0}  # heterogeneity: the last learner: 2× slower link, 80 ms RTT
TARGET_RATIO = 0.6  # heterogeneity goal: Decoupled ≤ 0.6× synchronous DiLoCo's time to the loss
# Over a WAN Decoupled compresses both directions: int4 up (the benchmark config's default) and down (outer.downlink).
DECOUPLED_SETS = ("outer.downlink=int4",)
TINY_LINK_FACTOR = 10.0  # --tiny only exercises the code: links 10× faster than the scaling says, runs in minutes
GLOO_IFNAME = netns.NODE_IF


@dataclass(frozen=True)
class Setting:
    """One emulated network: a name, the learners' links (index = learner) and the syncer's."""

    name: str
    learners: tuple[netns.Link, ...]
    syncer: netns.Link

    def describe(self) -> str:
        parts = sorted({link.describe() for link in self.learners})
        return f"learners {' / '.join(parts)}; syncer {self.syncer.describe()}"

    def nodes(self, method: str) -> list[tuple[str, netns.Link]]:
        nodes = [(f"learner-{i}", link) for i, link in enumerate(self.learners)]
        return ([("syncer", self.syncer)] + nodes) if method == "decoupled" else nodes


def scaling(params: int, learners: int, step_s: float, sync_every: int) -> dict:
    """Link rates that give DDP on this model the load it has in the paper's setting, and how they were found."""
    ring = 2.0 * (learners - 1) / learners * 4.0 * params  # bytes per worker per DDP step
    required_mbit = ring * 8 / step_s / 1e6
    links = {}
    for gbps in LINKS_GBPS:
        load = PAPER["ddp_required_gbps"] / gbps
        links[f"{gbps:g} Gbps"] = {"paper_gbps": gbps, "ddp_load": load, "rate_mbit": required_mbit / load,
                                   "sync_diloco_load": load / sync_every}
    text = (f"DDP moves 2·(N−1)/N·4 B·params = {ring / 1e6:.2f} MB per worker per step; one inner step computes in "
            f"{step_s:.3f} s here (4 workers on this machine), so DDP needs {required_mbit:.1f} Mbit/s. The paper's "
            f"data-parallel run needs {PAPER['ddp_required_gbps']:g} Gbps over "
            + " and ".join(f"{g:g}" for g in LINKS_GBPS) + " Gbps links: a load of "
            + " and ".join(f"{v['ddp_load']:.0f}" for v in links.values()) + ". Same load here: "
            + " and ".join(f"{v['rate_mbit']:.2f} Mbit/s" for v in links.values())
            + f" per learner (sync DiLoCo, H={sync_every}: load "
            + " and ".join(f"{v['sync_diloco_load']:.1f}" for v in links.values()) + ").")
    return {"ddp_bytes_per_step": ring, "step_s": step_s, "ddp_required_mbit": required_mbit, "links": links,
            "text": text}


def settings(scale: dict, learners: int, factor: float = 1.0) -> list[Setting]:
    """Both link speeds with every learner alike, then the faster one with the last learner behind a slow link."""
    out = []
    for name, link in scale["links"].items():
        rate = link["rate_mbit"] * factor
        learner = netns.Link(rate, DELAY_MS, JITTER_MS)
        # The syncer is a CPU service in a well-connected site: the learners' aggregate bandwidth, the same delay.
        out.append(Setting(name, (learner,) * learners, netns.Link(rate * learners, DELAY_MS, JITTER_MS)))
    fast = out[0]
    slow = netns.Link(fast.learners[0].rate_mbit * SLOW["rate"], SLOW["delay_ms"], SLOW["jitter_ms"])
    out.append(Setting(f"{fast.name}, one slow link", fast.learners[:-1] + (slow,), fast.syncer))
    return out


def launch(net: netns.Network, setting: Setting, method: str) -> runs.Launch:
    """Decoupled: the `diloco local` supervisor runs in the syncer's namespace (its status and snapshot reads stay off
    the links), each learner in its own. Baselines: each worker in its own, meeting at rank 0's address."""
    flags = []
    for i in range(len(setting.learners)):
        flags += ["--exec-prefix", f"learner-{i}={shlex.join(net.launch(f'learner-{i}'))}"]
    if method == "decoupled":
        return runs.Launch(prefix=tuple(net.launch("syncer")),
                           flags=("--syncer-host", net.address("syncer"), "--spares", "0", *flags))
    return runs.Launch(flags=("--master-addr", net.address("learner-0"), *flags),
                       env=(("GLOO_SOCKET_IFNAME", GLOO_IFNAME),))


def over(ctx: report.Context, setting: Setting, spec: runs.RunSpec) -> dict:
    """Run `spec` with its processes behind the setting's links; the network exists only for the run. Before the
    run, a probe measures what the last learner's link really does (round trip and throughput to its peer)."""
    check_path = ctx.out_dir / "runs" / f"{spec.key}.link.json"
    if (ctx.out_dir / "runs" / spec.key / "summary.json").exists() and check_path.exists():  # done before
        return {**runs.ensure(ctx, spec), "link_check": json.loads(check_path.read_text())}
    plan = netns.new_plan(setting.nodes(spec.method))
    (ctx.out_dir / "runs").mkdir(parents=True, exist_ok=True)
    with netns.Network(plan, log_path=ctx.out_dir / "runs" / "delayline.log") as net:
        last = f"learner-{len(setting.learners) - 1}"
        peer = "syncer" if spec.method == "decoupled" else "learner-0"
        link = setting.learners[-1]
        measured = netns.probe(net, last, peer, max(20_000, int(link.rate_mbit * 1e6 / 8 * 1.5)))
        ctx.log(f"  link check, {spec.label}: {last} -> {peer} RTT {1000 * measured['rtt_s']:.0f} ms, "
                f"{measured['mbit_per_s']:.2f} Mbit/s (links set: {last} {link.describe()}; {peer} "
                f"{plan.link(peer).describe()})")
        report.write_json(check_path, measured)
        summary = runs.ensure(ctx, spec, launch=launch(net, setting, spec.method))
    summary["link_check"] = measured
    return summary


def tokens_to(curve: tuple[list[float], list[float], list[float]], level: float) -> float | None:
    """Tokens at which the validation curve first reaches `level` (linear between evaluations), else None."""
    _, tokens, losses = curve
    return time_to((tokens, tokens, losses), level)


def run(ctx: report.Context) -> dict:
    result = report.new_result(NAME, ctx.mode)
    cfg = runs.BENCH_CONFIG
    n = 4
    steps = ctx.pick(12, 48, 96)  # per learner on loopback: ~1-2 minutes a run on 2 shared cores
    snapshots = ctx.pick(2, 6, 10)
    params = sum(t.numel() for t in _shapes(ModelConfig(**cfg["model"])).values())
    task = ctx.task("wan runs", 2 + 3 * 3)

    # 1. Loopback references: the synchronous methods' loss per token, the step time, the target loss.
    refs = {}
    for m in ("sync-diloco", "ddp"):
        refs[m] = runs.ensure(ctx, runs.RunSpec(m, steps, snapshots=snapshots, label=f"{m} on loopback (reference)"))
        task.advance()
    tokens_per_step = cfg["inner"]["batch_size"] * cfg["model"]["seq_len"]
    step_s = n * tokens_per_step / runs.learner_tokens_per_s(refs["sync-diloco"])
    scale = scaling(params, n, step_s, cfg["outer"]["sync_every"])
    level = refs["sync-diloco"]["val_loss"]
    ctx.log(f"  scaling: {scale['text']}")

    # 2. Over the links. Synchronous runs only need their tokens/s: one DDP step takes ~the paper's load × a compute
    # step, so a few steps do (sync DiLoCo: two outer rounds). Decoupled trains until the loopback references' wall
    # time allows it to reach the target.
    ref_span = runs.training_span(refs["sync-diloco"])
    rows: dict[str, dict[str, dict]] = {}
    described: dict[str, str] = {}
    factor = TINY_LINK_FACTOR if ctx.mode == "tiny" else 1.0
    if factor != 1.0:
        result["notes"].append(f"--tiny: links {factor:g}× faster than the scaling says (only exercises the code)")
    for k, setting in enumerate(settings(scale, n, factor)):
        hetero = k == len(LINKS_GBPS)  # the last setting: one learner behind a slow link
        rows[setting.name], described[setting.name] = {}, setting.describe()
        for m in METHODS:
            if hetero and m == "ddp":
                continue
            common = dict(network=f"{setting.describe()}", label=f"{m} over {setting.name}")
            if m == "decoupled":
                # 1.6× the synchronous reference's training time (Decoupled learns less per token at this size), plus
                # start-up (--minutes counts from the launch): ~90 s on this loaded machine, and each learner first
                # fetches the whole model (fp32) through its own link.
                fetch_s = 4.0 * params * 8 / (min(x.rate_mbit for x in setting.learners) * 1e6)
                minutes = round((1.6 * (ref_span[1] - ref_span[0]) + 90.0 + fetch_s) / 60.0, 2)
                spec = runs.RunSpec(m, 4 * steps, snapshots=snapshots, minutes=minutes, sets=DECOUPLED_SETS, **common)
            else:
                # Each step (DDP) or outer round (sync DiLoCo) moves the same bytes: two steps, one round do.
                few = 2 if m == "ddp" else cfg["outer"]["sync_every"]
                spec = runs.RunSpec(m, few, snapshots=1, minutes=30.0, extra=("--log-every", "1"), **common)
            s = over(ctx, setting, spec)
            rows[setting.name][m] = _row(m, s, refs.get(m), level)
            task.advance()
    task.done()
    result["figures"]["links"] = described
    _fill(result, scale, level, refs, rows)
    plot(result, ctx.out_dir / f"{NAME}.png")
    return result


def _row(method: str, s: dict, ref: dict | None, level: float) -> dict:
    """Tokens/s over the link and the time to `level`: measured (Decoupled) or tokens-to-level on loopback ÷ tokens/s."""
    tps = runs.learner_tokens_per_s(s)
    row = {"tokens_per_s": tps, "run": s["run_dir"], "val_loss": s["val_loss"], "link_check": s.get("link_check"),
           "tokens": s["tokens_trained"], "bytes": s.get("bytes", {})}
    if method == "decoupled":
        curve = runs.val_curve(s)
        row.update(time_to_target_s=time_to(curve, level), how="measured", limit_s=curve[0][-1],
                   curve=dict(zip(("time_s", "tokens", "val_loss"), curve)))
    else:
        need = tokens_to(runs.val_curve(ref), level)
        row.update(tokens_to_target=need, time_to_target_s=need / tps if need and tps else None,
                   how="loopback tokens to the loss ÷ tokens/s over the link")
    return row


def _fill(result: dict, scale: dict, level: float, refs: dict, rows: dict) -> None:
    fig = result["figures"]
    fig.update({"paper": PAPER, "scaling": scale, "target_loss": level, "decoupled_sets": DECOUPLED_SETS,
                "references": {m: {"run": s["run_dir"], "val_loss": s["val_loss"],
                                   "tokens_per_s": runs.learner_tokens_per_s(s),
                                   "curve": dict(zip(("time_s", "tokens", "val_loss"), runs.val_curve(s)))}
                               for m, s in refs.items()},
                "settings": rows})
    result["notes"].append(f"scaling: {scale['text']}")
    result["notes"].append("DDP and sync DiLoCo: time to the loss = tokens they need for it on loopback ÷ their "
                           "tokens/s over the link (a synchronous method computes the same values whatever the link); "
                           "Decoupled: measured over the link")
    t = result["table"]
    t["title"] = (f"wan — time to val loss {level:.4f} (sync DiLoCo's on loopback) and tokens/s, 4 learners over "
                  "emulated links")
    t["columns"] = ["link (paper-equivalent)", "method", "tokens/s", "× DDP", "time to loss", "× DDP", "× sync DiLoCo",
                    "how"]
    for name, by_method in rows.items():
        ddp = by_method.get("ddp") or rows[next(iter(rows))]["ddp"]
        sync = by_method["sync-diloco"]
        for m, r in by_method.items():
            t_m = r["time_to_target_s"]
            t["rows"].append([name, m, f"{r['tokens_per_s']:,.0f}", _x(r["tokens_per_s"], ddp["tokens_per_s"]),
                              _seconds(r, t_m), _x(t_m, ddp["time_to_target_s"]) if by_method.get("ddp") else "-",
                              _x(t_m, sync["time_to_target_s"]), r["how"]])
    hetero = list(rows)[-1]
    for name in list(rows)[:-1]:
        d = rows[name]["decoupled"]["time_to_target_s"]
        for base, who in (("ddp", "DDP (conventional data-parallel)"), ("sync-diloco", "synchronous DiLoCo")):
            b = rows[name][base]["time_to_target_s"]
            speedup = b / d if b and d else None
            report.target(result, f"decoupled vs {who}, {name}-equivalent links",
                          "> 20× faster (the paper: 12B over 2-5 Gbps, vs conventional synchronous training)",
                          f"{speedup:.1f}× faster" if speedup else "not reached", None if speedup is None else
                          speedup > 20, "" if base == "ddp" or speedup is None or speedup > 20 else
                          "synchronous DiLoCo already divides DDP's traffic by H: at this load its all-reduce "
                          "costs a few of its rounds' compute, not tens")
    d, s = rows[hetero]["decoupled"], rows[hetero]["sync-diloco"]
    ratio = d["time_to_target_s"] / s["time_to_target_s"] if d["time_to_target_s"] and s["time_to_target_s"] else None
    report.target(result, "decoupled vs sync DiLoCo, one learner behind a slow link",
                  f"≤ {TARGET_RATIO}× the synchronous time to the loss", f"{ratio:.2f}×" if ratio else "not reached",
                  None if ratio is None else ratio <= TARGET_RATIO)


def _x(value, base) -> str:
    return f"{value / base:.2f}" if value and base else "-"


def _seconds(row: dict, t: float | None) -> str:
    if t is None:
        return f"not in {row.get('limit_s', 0):.0f} s" if row["how"] == "measured" else "-"
    return f"{t:,.0f} s" if t < 3600 else f"{t / 3600:.1f} h"


def plot(result: dict, path: Path) -> Path:
    fig_data = result["figures"]
    rows = fig_data["settings"]
    names = list(rows)
    fig, axes = report.figure(2, 2, width=6.4, height=4.4)
    level = fig_data["target_loss"]
    # Top: validation loss against wall time over each equal-links setting (baselines: their loopback curves at the
    # tokens/s measured over the link).
    for ax, name in zip(axes[:2], names[:2]):
        for m in METHODS:
            r = rows[name][m]
            if m == "decoupled":
                c = r["curve"]
                times, losses = c["time_s"], c["val_loss"]
            else:
                c = fig_data["references"][m]["curve"]
                times, losses = [tok / r["tokens_per_s"] for tok in c["tokens"]], c["val_loss"]
            ax.plot(times, losses, "o-", ms=3, color=report.color(m), label=m)
        ax.axhline(level, color="k", ls=":", lw=1)
        ax.set_xscale("symlog", linthresh=10.0)
        ax.set_xlim(left=0)
        ax.set_xlabel("wall time of training (s, log past 10; baselines: loopback curve ÷ tokens/s over the link)")
        ax.set_ylabel("validation loss of the global model")
        rate = fig_data["scaling"]["links"][name]["rate_mbit"]
        ax.set_title(f"links ≙ {name}: {rate:.2f} Mbit/s, {2 * 2 * DELAY_MS:.0f} ms RTT")
        ax.legend(fontsize=8)
    # Bottom left: time to the loss, per setting and method (log).
    ax = axes[2]
    width = 0.26
    for k, m in enumerate(METHODS):
        xs, ys = [], []
        for i, name in enumerate(names):
            r = rows[name].get(m)
            if r and r["time_to_target_s"]:
                xs.append(i + (k - 1) * width)
                ys.append(r["time_to_target_s"])
        bars = ax.bar(xs, ys, width, color=report.color(m), label=m)
        report.bar_labels(ax, bars, "{:,.0f}")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), [n.replace(", ", "\n") for n in names])
    ax.set_ylabel("seconds to the target loss (log)")
    ax.set_title(f"time to val loss {level:.3f}")
    ax.legend(fontsize=8)
    # Bottom right: speed-up of Decoupled over each baseline.
    ax = axes[3]
    for k, m in enumerate(("ddp", "sync-diloco")):
        xs, ys = [], []
        for i, name in enumerate(names):
            d, b = rows[name]["decoupled"]["time_to_target_s"], (rows[name].get(m) or {}).get("time_to_target_s")
            if d and b:
                xs.append(i + (k - 0.5) * 0.38)
                ys.append(b / d)
        bars = ax.bar(xs, ys, 0.38, color=report.color(m), label=f"{m} time ÷ decoupled time")
        report.bar_labels(ax, bars, "{:.1f}×")
    ax.axhline(20, color="k", ls=":", lw=1)
    ax.annotate("paper: > 20× (12B, 2-5 Gbps)", (0.02, 20), xycoords=("axes fraction", "data"), fontsize=8,
                va="bottom")
    ax.axhline(1, color="#444444", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), [n.replace(", ", "\n") for n in names])
    ax.set_ylabel("× faster to the loss (log)")
    ax.set_title("Decoupled's speed-up")
    ax.legend(fontsize=8)
    return report.save(fig, path, "Across the WAN: emulated links scaled to the paper's communication load",
                       report.footnote(result))
