"""`diloco chaos`: run an experiment against a local run or a DilocoJob, validate one, or measure a run's goodput."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path

from diloco_trainer.protocol.chaos_record import ChaosEntry

from diloco_chaos.inject.experiment import load_experiment, parse_duration
from diloco_chaos.inject.metrics import ChaosMetrics
from diloco_chaos.inject.record import Record
from diloco_chaos.inject.runner import Progress, run_experiment
from diloco_chaos.inject.schedule import preview


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    r = sub.add_parser("run", help="run an experiment against a `diloco local` run or a DilocoJob")
    r.add_argument("experiment", help="experiment YAML (see chaos/examples/)")
    r.add_argument("--dry-run", action="store_true", help="decide and record every fault, touch nothing")
    where = r.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-dir", help="the run directory of a running `diloco local --run-dir RUN`")
    where.add_argument("--job", help="the DilocoJob whose pods are the targets (Kubernetes)")
    r.add_argument("--kubeconfig", help="kubeconfig (default: $KUBECONFIG, ~/.kube/config or in-cluster)")
    r.add_argument("--namespace", help="the DilocoJob's namespace (default: safety.namespace, else 'default')")
    r.add_argument("--record", help="where to write the JSON-lines record (default: RUN/chaos/<name>-<time>.jsonl "
                                    "or ./chaos-<name>-<time>.jsonl)")
    r.add_argument("--max-duration", help="stop injecting sooner than the experiment's safety.maxDuration")
    r.add_argument("--plain", action="store_true", help="one line per event instead of the live view")
    r.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus /metrics (faults, recoveries, measured goodput) on this port (0 = off)")

    v = sub.add_parser("validate", help="check an experiment and print its first scheduled faults")
    v.add_argument("experiment")
    v.add_argument("--units", type=int, default=4, help="learner units to preview an mtbf schedule with")
    v.add_argument("--horizon", default=None, help="preview this far ahead (default: safety.maxDuration)")

    g = sub.add_parser("goodput", help="goodput and system uptime of a run directory (or from Prometheus)")
    g.add_argument("run_dir", nargs="?", help="a `diloco local` run directory (live or finished)")
    g.add_argument("--json", action="store_true", help="print JSON")
    g.add_argument("--stall-threshold", type=float, default=None,
                   help="seconds without a merge that count as a stall (default: 5× the median gap, >= 3 s)")
    g.add_argument("--prometheus", help="Prometheus URL: compute from a cluster's metrics instead")
    g.add_argument("--selector", default="", help='PromQL label selector, e.g. namespace="team-a"')
    g.add_argument("--window", default="1h", help="with --prometheus: the window ending now (default 1h)")
    g.add_argument("--fragments", type=int, default=None, help="with --prometheus: the job's outer.fragments P")


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "validate":
            return _validate(args)
        if args.action == "goodput":
            return _goodput(args)
        return _run(args)
    except ValueError as exc:
        print(f"diloco chaos {args.action}: {exc}", file=sys.stderr)
        return 2


def _validate(args) -> int:
    exp = load_experiment(args.experiment)
    horizon = parse_duration(args.horizon) if args.horizon else exp.safety.max_duration_s
    units = [f"learner-{i}" for i in range(args.units)] if exp.target.kind != "syncer" else ["syncer"]
    now = time.time()
    ticks = preview(exp.schedule, now, now + horizon, units)
    print(f"{exp.name}: valid. {exp.action.type} on {exp.target.kind} targets, schedule {exp.schedule.kind}; "
          f"{len(ticks)} tick(s) in {horizon:g}s" + (f" with {args.units} units" if exp.schedule.kind == "mtbf" else ""))
    for t in ticks[:10]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t.at))
        print(f"  t+{t.at - now:8.1f}s ({when})  {t.unit or '(pick among eligible)'}  {t.why}")
    if len(ticks) > 10:
        print(f"  ... {len(ticks) - 10} more")
    return 0


def _goodput(args) -> int:
    from diloco_chaos import goodput

    if args.prometheus:
        if not args.fragments:
            raise ValueError("--prometheus needs --fragments (the job's outer.fragments)")
        end = time.time()
        result = asyncio.run(goodput.from_prometheus(args.prometheus, args.selector,
                                                     end - parse_duration(args.window), end, args.fragments))
    elif args.run_dir:
        result = goodput.from_run_dir(args.run_dir, args.stall_threshold)
    else:
        raise ValueError("give a run directory or --prometheus URL")
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for line in goodput_lines(result):
            print(line)
    return 0


def goodput_lines(g: dict) -> list[str]:
    """A short human summary of a goodput result."""
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    lines = [f"goodput {pct(g['goodput'])}  (useful {g['useful_s']:.1f}s of {g['allocated_s']:.1f}s allocated "
             f"learner time; in steps {pct(g['compute_fraction'])}, of which merged {pct(g['merged_fraction'])})"]
    if g.get("goodput_after_startup") is not None:
        lines.append(f"goodput after start-up {pct(g['goodput_after_startup'])}  (each slot counted from its first "
                     f"training report; restarts' start-up still counts)")
    stalls = g.get("stalls") or []
    lines.append(f"system uptime {pct(g.get('uptime'))}  ({len(stalls)} stall(s) longer than "
                 f"{g.get('stall_threshold_s') or 0:.1f}s without a merge, over {g['wall_s']:.0f}s)")
    for name, v in (g.get("learners") or {}).items():
        lines.append(f"  {name}: {v['incarnations']} incarnation(s), {v['steps']} steps, "
                     f"merged {pct(v['merged_fraction'])}, useful {v['useful_s']:.1f}s / {v['allocated_s']:.1f}s")
    return lines


def _run(args) -> int:
    exp = load_experiment(args.experiment)
    if args.max_duration:
        limit = parse_duration(args.max_duration)
        if limit <= 0:
            raise ValueError("--max-duration must be longer than zero")
        if limit < exp.safety.max_duration_s:
            exp = exp.model_copy(update={"safety": exp.safety.model_copy(update={"max_duration": f"{limit:g}s"})})
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.run_dir:
        from diloco_chaos.inject.targets.local import LocalTarget

        target = LocalTarget(args.run_dir)
        default_record = Path(args.run_dir) / "chaos" / f"{exp.name}-{stamp}.jsonl"
    else:
        from diloco_chaos.inject.targets.kubernetes import KubernetesTarget

        namespace = args.namespace or exp.safety.namespace or "default"
        if exp.safety.namespace and namespace != exp.safety.namespace:
            raise ValueError(f"--namespace {namespace} is outside the experiment's safety.namespace "
                             f"{exp.safety.namespace}")
        target = KubernetesTarget(job=args.job, namespace=namespace, kubeconfig=args.kubeconfig)
        default_record = Path(f"chaos-{exp.name}-{stamp}.jsonl")
    record = Record(Path(args.record) if args.record else default_record)
    metrics = ChaosMetrics()
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, registry=metrics.registry)
    display = Display(record, plain=args.plain or not sys.stdout.isatty(), metrics=metrics, experiment=exp.name,
                      run_dir=args.run_dir)
    dry = args.dry_run or exp.dry_run
    print(f"chaos experiment {exp.name}{' (DRY RUN: nothing will be touched)' if dry else ''} -> record {record.path}")
    try:
        summary = asyncio.run(_main(exp, target, record, dry, display, metrics))
    finally:
        display.close()
    end = next((e for e in reversed(record.entries) if e.event == "end"), None)
    if end is not None:
        print(f"experiment ended: {end.reason} (record: {record.path})")
    print(f"faults {summary['faults']}, skipped {summary['skipped']}, recovered {summary['recovered']}, "
          f"not recovered {summary['not_recovered']}")
    if summary["trained_again_s_median"] is not None:
        merged = summary["merged_again_s_median"]
        print(f"median time until the victim trained again {summary['trained_again_s_median']:.1f}s"
              + (f", until its contribution was merged again {merged:.1f}s" if merged is not None else ""))
    if args.run_dir:
        from diloco_chaos import goodput

        try:
            for line in goodput_lines(goodput.from_run_dir(args.run_dir)):
                print(line)
        except ValueError as exc:
            print(f"goodput: {exc}")
    return 0


async def _main(exp, target, record, dry_run, display, metrics) -> dict:
    stop = asyncio.Event()
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()

    def interrupt() -> None:
        if stop.is_set():
            task.cancel()  # second Ctrl+C: stop now (victims are still released on the way out)
        else:
            display.message("stopping: no more faults; waiting for open recoveries (Ctrl+C again to quit now)")
            stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupt)
    try:
        return await run_experiment(exp, target, record, dry_run=dry_run, stop=stop, on_progress=display.update,
                                    metrics=metrics)
    except asyncio.CancelledError:
        from diloco_chaos.inject.record import summarize

        return summarize(record.entries)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def describe(entry: ChaosEntry) -> str:
    """One line for a record entry."""
    kind = entry.event
    stamp = time.strftime("%H:%M:%S", time.localtime(entry.time))
    if kind == "fault":
        verb = "WOULD " + entry.action if entry.dry_run else entry.action
        code = f" (exit code {entry.exit_code})" if entry.exit_code else ""
        text = f"fault #{entry.fault}: {verb}{code} {', '.join(entry.members or [])} — {entry.why}"
    elif kind == "skipped":
        text = f"no fault for tick #{entry.tick}: {entry.reason}"
    elif kind == "recovery":
        if entry.recovered:
            merged = (f"merged again after {entry.merged_again_s:.1f}s" if entry.merged_again_s is not None
                      else entry.note or "merges not observed")  # a target without the syncer's status
            text = (f"fault #{entry.fault} {entry.unit} recovered: trained again after {entry.trained_again_s:.1f}s, "
                    f"{merged}")
        else:
            text = f"fault #{entry.fault} {entry.unit} NOT recovered: {entry.note}"
    elif kind == "held":
        text = f"fault #{entry.fault}: replacement of {entry.unit} held until its downtime ends"
    elif kind == "released":
        text = f"fault #{entry.fault}: {entry.unit} released"
    elif kind == "ending":
        text = f"no more faults: {entry.reason}"
    elif kind == "experiment":
        text = f"experiment {entry.name} against {entry.target}"
    else:
        fields = entry.model_dump(exclude_none=True, exclude={"event", "time"})
        text = f"{kind}: {', '.join(f'{k}={v}' for k, v in fields.items())}"
    return f"{stamp} {text}"


class Display:
    """Live view (rich) or one plain line per record entry; for a local run, its measured goodput every 10 s."""

    GOODPUT_EVERY_S = 10.0

    def __init__(self, record: Record, plain: bool, metrics: ChaosMetrics | None = None, experiment: str = "",
                 run_dir: str | None = None):
        self.record, self.plain = record, plain
        self.metrics, self.experiment, self.run_dir = metrics, experiment, run_dir
        self.goodput: dict | None = None
        self.goodput_at = 0.0
        self.shown = 0
        self.messages: list[str] = []
        self.live = None
        if not plain:
            from rich.live import Live

            self.live = Live(auto_refresh=False, transient=False)
            self.live.start()

    def message(self, text: str) -> None:
        self.messages.append(f"{time.strftime('%H:%M:%S')} {text}")
        if self.plain:
            print(self.messages[-1], flush=True)

    def _measure(self) -> None:
        if self.run_dir is None or time.monotonic() - self.goodput_at < self.GOODPUT_EVERY_S:
            return
        self.goodput_at = time.monotonic()
        from diloco_chaos import goodput

        try:
            self.goodput = goodput.from_run_dir(self.run_dir)
        except ValueError:
            return  # nothing trained yet
        if self.metrics is not None:
            self.metrics.goodput.labels(self.experiment).set(self.goodput["goodput"] or 0.0)
            self.metrics.uptime.labels(self.experiment).set(self.goodput.get("uptime") or 0.0)
        if self.plain:
            print(f"{time.strftime('%H:%M:%S')} run so far: {goodput_lines(self.goodput)[0]}; uptime "
                  f"{100 * (self.goodput.get('uptime') or 0):.1f}%", flush=True)

    def update(self, p: Progress) -> None:
        new = self.record.entries[self.shown:]
        self.shown = len(self.record.entries)
        self._measure()
        if self.plain:
            for entry in new:
                print(describe(entry), flush=True)
            return
        from rich.panel import Panel
        from rich.table import Table

        table = Table.grid(padding=(0, 2))
        nxt = "-" if p.next_fault_in_s is None else f"in {p.next_fault_in_s:.0f}s"
        table.add_row(f"[b]{p.experiment}[/b]{' [yellow](dry run)[/yellow]' if p.dry_run else ''}",
                      f"elapsed {p.elapsed_s:.0f}s / {p.max_duration_s:.0f}s", f"next fault {nxt}")
        table.add_row(f"faults {p.faults}", f"skipped {p.skipped}", f"recovered {p.recovered}",
                      f"down: {', '.join(p.down) or '-'}")
        lines = [describe(e) for e in self.record.entries[-8:]] + self.messages[-2:]
        body = Table.grid()
        body.add_row(table)
        for line in lines:
            body.add_row(line)
        if self.goodput is not None:
            body.add_row(f"run so far: {goodput_lines(self.goodput)[0]}; uptime "
                         f"{100 * (self.goodput.get('uptime') or 0):.1f}%")
        if p.ending:
            body.add_row(f"[b]ending:[/b] {p.ending} (waiting for open recoveries)")
        self.live.update(Panel(body, title="diloco chaos"), refresh=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
        elif self.plain:
            for entry in self.record.entries[self.shown:]:
                print(describe(entry), flush=True)
            self.shown = len(self.record.entries)
