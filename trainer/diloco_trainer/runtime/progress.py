"""Live progress for a local run: a rich table per learner plus a syncer line, or plain lines when not a TTY.

Pure rendering: the caller gathers a `View` (from metrics.jsonl tails, the supervisor and `/v1/status`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Group
from rich.table import Table
from rich.text import Text

from diloco_trainer.protocol.messages import MetricsRecord, SyncerStatus


@dataclass
class LearnerView:
    name: str
    status: str  # running | restarting | done | stopped | starting
    restarts: int = 0
    last: MetricsRecord | None = None  # the last metrics.jsonl record of the current incarnation
    total_steps: int = 0  # over all incarnations
    target_steps: int | None = None
    slowdown: float = 1.0
    rate: float | None = None  # tokens/s of the last non-empty log window


@dataclass
class View:
    title: str
    elapsed_s: float
    budget_s: float | None
    learners: list[LearnerView] = field(default_factory=list)
    syncer: SyncerStatus | None = None  # the last /v1/status answer, None while the syncer is away
    syncer_restarts: int = 0
    shards_up: list[bool] | None = None  # a sharded syncer: which shards answered the last sample
    no_syncer: str | None = None  # baselines: what stands in for the syncer line (e.g. "all-reduce every step")
    goodput: float | None = None
    tokens_trained: int = 0
    messages: list[str] = field(default_factory=list)  # recent events (restarts, exits)
    ledger: dict | None = None  # the run's ledger so far (runtime/ledger.py), None while unknown


def human(n: float | int | None, unit: str = "") -> str:
    """1234567 -> '1.23M', 683920 -> '684k' (three significant digits, SI prefixes), None -> '-'."""
    if n is None:
        return "-"
    n = float(n)
    for prefix in ("", "k", "M", "G", "T"):
        if abs(n) < 999.5 or prefix == "T":
            if prefix == "":
                return f"{n:.0f}{unit}"
            digits = 2 if abs(n) < 10 else 1 if abs(n) < 100 else 0
            return f"{n:.{digits}f}{prefix}{unit}"
        n /= 1000
    raise AssertionError("unreachable")


def versions_text(versions: dict | None) -> str:
    """Adopted fragment versions, compactly: 'v3..5' (min..max over fragments)."""
    if not versions:
        return "-"
    vals = [int(v) for v in versions.values()]
    lo, hi = min(vals), max(vals)
    return f"v{lo}" if lo == hi else f"v{lo}..{hi}"


def _status_style(status: str) -> str:
    return {"running": "green", "done": "cyan", "restarting": "yellow", "stopped": "dim"}.get(status, "red")


def render(view: View) -> Group:
    """The rich renderable: header, learner table, syncer line, recent events."""
    budget = f" / {view.budget_s / 60:.1f} min" if view.budget_s else ""
    header = Text.assemble((view.title, "bold"), f"   elapsed {view.elapsed_s / 60:.1f} min{budget}")
    table = Table(expand=False, pad_edge=False, box=None, header_style="bold")
    for col, justify in [("learner", "left"), ("state", "left"), ("step", "right"), ("loss", "right"),
                         ("tok/s", "right"), ("versions", "left"), ("sent/ack", "right"),
                         ("bytes up/down", "right"), ("syncer", "left")]:
        table.add_column(col, justify=justify, no_wrap=True)
    for lv in view.learners:
        m = lv.last
        target = f"/{lv.target_steps}" if lv.target_steps else ""
        restarts = f" ↻{lv.restarts}" if lv.restarts else ""
        slow = f" ×{lv.slowdown:g}" if lv.slowdown != 1 else ""
        table.add_row(
            lv.name + slow,
            Text(lv.status + restarts, style=_status_style(lv.status)),
            f"{lv.total_steps}{target}",
            f"{m.loss:.3f}" if m is not None and m.loss is not None else "-",
            human(lv.rate),
            versions_text(m.versions if m is not None else None),
            f"{m.sent}/{m.acked}" if m is not None else "-/-",
            f"{human(m.bytes_up)}/{human(m.bytes_down)}" if m is not None else "-",
            "-" if m is None else Text("up", style="green") if m.syncer_up else Text("away", style="yellow"),
        )
    extra = [Text(ledger_text(view.ledger))] if view.ledger else []
    return Group(header, table, syncer_text(view), *extra, *[Text(msg, style="dim") for msg in view.messages[-4:]])


def ledger_text(ledger: dict) -> str:
    """The ledger so far in fragment-steps (P per learner step): each bucket's share of the trained. `open` is what
    no bucket holds yet (trained by running learners and not yet merged, discarded or refused; the summary splits
    it into lost and unsent at the end)."""
    trained = ledger["trained"]
    # While a life runs, its acknowledged Δs not merged yet wait at the syncer: open, not dropped.
    refused = ledger["refused"] - (ledger.get("refused_by_class") or {}).get("dropped", 0)
    open_ = trained - ledger["merged"] - ledger["discarded"] - refused
    share = (lambda n: f" {100 * n / trained:.0f}%") if trained else (lambda n: "")
    return (f"ledger: trained {human(trained)} = merged {human(ledger['merged'])}{share(ledger['merged'])} + discarded "
            f"{human(ledger['discarded'])}{share(ledger['discarded'])} + refused {human(refused)}"
            f"{share(refused)} + open {human(open_)}{share(open_)}")


def merged_per_fragment(tokens_merged: int, fragments: int) -> str:
    """The syncer's merged-token count made readable against tokens trained: it sums every fragment's merges (each
    covers the tokens trained since that learner last sent that fragment), so its mean over the fragments is what
    compares with the tokens trained."""
    return f"{human(tokens_merged / max(fragments, 1))} per fragment"


def syncer_text(view: View) -> Text:
    if view.no_syncer:
        return Text(view.no_syncer)
    s = view.syncer
    goodput = f"{100 * view.goodput:.1f}%" if view.goodput is not None else "-"
    restarts = f", restarts {view.syncer_restarts}" if view.syncer_restarts else ""
    if s is None:
        return Text(f"syncer: away{restarts}", style="yellow")
    live = sum(1 for ls in s.learners.values() if ls.live)
    shards = "" if view.shards_up is None else f"{sum(view.shards_up)}/{len(view.shards_up)} shards up, "
    style = "yellow" if view.shards_up is not None and not all(view.shards_up) else None
    return Text(
        f"syncer: {shards}outer steps {s.outer_steps}, merges {s.merges}, goodput {goodput} "
        f"(tokens merged {merged_per_fragment(s.tokens_merged, s.fragments)} of {human(view.tokens_trained)} "
        f"trained), live learners {live}, pending {s.pending_total}, "
        f"grace {s.grace_s:.2f}s{restarts}", style=style or ""
    )


def plain_line(view: View) -> str:
    """One log line for non-interactive output (CI logs, tests)."""
    parts = [f"[{view.elapsed_s:6.1f}s]"]
    for lv in view.learners:
        m = lv.last
        loss = f"{m.loss:.3f}" if m is not None and m.loss is not None else "-"
        code = {"restarting": "R"}.get(lv.status, lv.status[0])
        parts.append(f"{lv.name}:{code} s{lv.total_steps} L{loss} {versions_text(m.versions if m else None)}")
    s = view.syncer
    if view.no_syncer:
        parts.append(f"| {view.no_syncer}")
    else:
        shards = "" if view.shards_up is None else f" shards_up={sum(view.shards_up)}/{len(view.shards_up)}"
        parts.append(f"| syncer{shards} outer={s.outer_steps} merges={s.merges}" if s else "| syncer away")
    if view.ledger:
        parts.append("| " + ledger_text(view.ledger))
    return " ".join(parts)
