"""`diloco local`: a syncer and N learner processes on this machine, live progress, a run directory and a report.

The learners and the syncer are the same programs the container images run (`diloco learner`,
`diloco syncer`), started as real processes on loopback; this module only supervises and reports.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from diloco_trainer.config import TrainConfig
from diloco_trainer.protocol.runfiles import EVENTS
from diloco_trainer.runtime import launch, procs
from diloco_trainer.runtime.procs import Child, StopFlag, Supervisor
from diloco_trainer.runtime.rundir import open_run
from diloco_trainer.runtime.session import (DEFAULT_CONFIG, DEFAULT_MINUTES, DEFAULT_STEPS, RunSession, load_config,
                              parse_slowdown)
from diloco_trainer.runtime.shards import StandbyGroup, combine_final_checkpoints, syncer_names
from diloco_trainer.runtime.spares import SparePool
from diloco_trainer.runtime.standby import SyncerStandby
from diloco_trainer.protocol.tls import TlsFiles, make_authority



def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG),
                        help="run config YAML (default: configs/local.yaml, sized to finish in < 5 min on 2 cores)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set outer.compression=int8 (repeatable)")
    parser.add_argument("--learners", type=int, default=4, help="learner processes (default 4)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"inner steps per learner (default {DEFAULT_STEPS})")
    parser.add_argument("--minutes", type=float, default=DEFAULT_MINUTES,
                        help="wall-clock budget for training; learners are stopped when it runs out "
                             f"(default {DEFAULT_MINUTES:g})")
    parser.add_argument("--slowdown", default="1",
                        help="per-learner slowdown factors, e.g. 1,1,1,2 (one value applies to all)")
    parser.add_argument("--jitter", type=float, default=0.0,
                        help="random extra step time, as a fraction of the step time (imitates noisy hardware)")
    parser.add_argument("--restart-delay", type=float, default=0.5,
                        help="seconds before a learner (or the syncer) that died is started again; doubled for "
                             "each further crash soon after a start (crash-loop back-off, at most 60 s)")
    parser.add_argument("--spares", type=int, default=2,
                        help="warm spare learner processes (torch imported, waiting; forked from one warm process, "
                             "so a refill costs no import): a restarted learner takes one over instead of starting "
                             "from scratch (default 2; 0 = cold restarts)")
    parser.add_argument("--no-fork-spares", dest="fork_spares", action="store_false",
                        help="start every spare (and every standby syncer) as a process of its own (each imports "
                             "torch) instead of forking them from a warm process")
    parser.add_argument("--no-syncer-standby", dest="syncer_standby", action="store_false",
                        help="no warm standby syncer: a syncer that dies is restarted from scratch (~5-10 s on a busy "
                             "machine instead of well under 1 s; see runtime/standby.py)")
    parser.add_argument("--syncer-shards", type=int, default=None, metavar="N",
                        help="run the syncer as N shards (default: the config's syncer.shards): processes syncer-0 .. "
                             "syncer-{N-1}, shard i owning fragments p with p mod N = i, each with its own state "
                             "directory and warm standby; a dead shard stops only its own fragments")
    parser.add_argument("--no-restart", action="store_true", help="do not restart processes that die")
    parser.add_argument("--checkpoint-every-s", type=float, default=5.0,
                        help="the syncer checkpoints at most this often (what a syncer crash can cost)")
    parser.add_argument("--run-dir", default=None, help="where to write the run (default runs/<timestamp>/)")
    parser.add_argument("--log-every", type=int, default=5, help="learner metrics line every N steps")
    parser.add_argument("--snapshots", type=int, default=3,
                        help="global-model snapshots taken during the run and evaluated at the end")
    parser.add_argument("--eval-batches", type=int, default=32,
                        help="validation batches (of inner.batch_size windows) for each evaluation of the global model")
    parser.add_argument("--plain", action="store_true", help="plain progress lines instead of the live table")
    parser.add_argument("--tls", action="store_true",
                        help="HTTPS between learners and syncer, with a CA and certificate made for this run "
                             "(RUN_DIR/tls); loopback traffic never leaves the machine, so plain HTTP is the default")
    parser.add_argument("--syncer-host", default="127.0.0.1",
                        help="address the syncer listens on and the learners connect to (default loopback; the WAN "
                             "benchmark gives the syncer's network-namespace address)")
    launch.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Plan, start the syncer(s) and learners, supervise until --steps or --minutes, stop them, summarize."""
    started = time.monotonic()  # --minutes counts from here: start-up is part of the budget
    local = LocalRun(args, plan_run(args))
    run_dir, stop = local.run_dir, StopFlag()
    with Supervisor(run_dir / "processes.json", run_dir / EVENTS, run_dir / "holds") as sup, stop.installed():
        local.start(sup)
        reason = local.session.supervise(sup, stop, started, budget_s=args.minutes * 60, steps=args.steps)
        train_end = local.stop(sup, reason)
    local.collect_final_checkpoint()
    summary = local.session.finish(sup, train_end - started, stop_reason=reason)
    return 0 if summary.get("val_loss") is not None else 1


@dataclass
class Plan:
    """What the arguments ask for, checked before anything is written or started."""

    cfg: TrainConfig
    syncers: list[str]  # the syncer processes: "syncer", or one per shard
    slowdown: list[float]
    prefixes: dict[str, list[str]]  # --exec-prefix by process name


def plan_run(args: argparse.Namespace) -> Plan:
    """The validated run; a bad argument exits with a message naming it."""
    cfg = load_config(args.config, args.set)
    if args.syncer_shards is not None:
        cfg = load_config(args.config, [*args.set, f"syncer.shards={args.syncer_shards}"])  # validated as the config
    names = syncer_names(cfg.syncer.shards)
    if args.learners < 1:
        raise SystemExit("diloco local: --learners must be >= 1")
    slowdown = parse_slowdown(args.slowdown, args.learners)
    if args.steps < 1 or args.minutes <= 0:
        raise SystemExit("diloco local: --steps must be >= 1 and --minutes > 0")
    if not 0 <= args.jitter < 1 or args.restart_delay < 0 or not args.checkpoint_every_s > 0 or args.spares < 0:
        raise SystemExit("diloco local: --jitter must be in [0, 1), --restart-delay >= 0, --checkpoint-every-s > 0, "
                         "--spares >= 0")
    try:
        children = names + [f"learner-{i}" for i in range(args.learners)]
        prefixes = launch.parse_exec_prefixes(args.exec_prefix, children)
    except ValueError as exc:
        raise SystemExit(f"diloco local: {exc}") from None
    if prefixes and args.spares and not args.no_restart:
        raise SystemExit("diloco local: --exec-prefix needs --spares 0 (a warm spare runs without the prefix)")
    if any(n in prefixes for n in names) and args.syncer_standby and args.fork_spares and not args.no_restart:
        raise SystemExit("diloco local: --exec-prefix syncer=... needs --no-syncer-standby or --no-fork-spares (a "
                         "forked standby syncer runs without the prefix)")
    return Plan(cfg, names, slowdown, prefixes)


class LocalRun:
    """One run: its directory, token and session, and the processes it starts under the caller's Supervisor."""

    def __init__(self, args: argparse.Namespace, plan: Plan):
        self.args, self.plan = args, plan
        self.run_dir, self.config_path = open_run(args.run_dir, plan.cfg, "diloco local")
        self.token = secrets.token_urlsafe(24)
        self.env = procs.child_env({"DILOCO_TOKEN": self.token})
        self.session = RunSession(self.run_dir, plan.cfg, mode="decoupled", learners=args.learners, plain=args.plain,
                                  eval_batches=args.eval_batches, snapshots=args.snapshots)
        self.syncer_dirs = [self.run_dir / name for name in plan.syncers]  # "syncer", or one directory per shard
        self.tls: TlsFiles | None = None

    def start(self, sup: Supervisor) -> None:
        """The syncer(s), then (once they serve) the learners and the warm spares."""
        self._start_syncers(sup)
        # While the syncer starts: cache the corpus once (learners then load it fast), check the shards, and
        # compute the unigram baseline.
        self.session.prepare_data()
        syncer_urls = self._await_syncers(sup)
        self._start_learners(sup, syncer_urls)
        self._start_spares(sup)

    def _start_syncers(self, sup: Supervisor) -> None:
        args, names = self.args, self.plan.syncers
        hosts = sorted({args.syncer_host, "127.0.0.1", "localhost"})
        self.tls = make_authority(self.run_dir / "tls", hosts) if args.tls else None
        tls_syncer = ["--tls-cert", str(self.tls.cert), "--tls-key", str(self.tls.key)] if self.tls else []
        for i, (name, syncer_dir) in enumerate(zip(names, self.syncer_dirs)):
            shard = ["--shard", str(i)] if len(names) > 1 else []
            sup.add(Child(name, "syncer", self.plan.prefixes.get(name, []) + procs.diloco_argv(
                "syncer", "--config", str(self.config_path), "--host", args.syncer_host, "--port", "0",
                "--state-dir", str(syncer_dir), "--token-env", "DILOCO_TOKEN",
                "--checkpoint-every-s", f"{args.checkpoint_every_s:g}", *shard, *tls_syncer),
                self.env, self.run_dir / "logs" / f"{name}.log", restart=not args.no_restart,
                restart_delay=args.restart_delay,
                meta={"state_dir": str(syncer_dir), **({"shard": i} if shard else {})}))
            sup.start(name)

    def _await_syncers(self, sup: Supervisor) -> str:
        """Wait for every syncer's endpoint, pin its port for restarts, start its warm standby; the learners'
        --syncer (the URLs in shard order)."""
        args, names = self.args, self.plan.syncers
        endpoints = self.session.wait_for_shards(sup, names, [d / "endpoint.json" for d in self.syncer_dirs],
                                                 self.token, ca=self.tls.ca if self.tls else None)
        standbys = []
        for name, syncer_dir, endpoint in zip(names, self.syncer_dirs, endpoints):
            # A restarted syncer must come back on the same port: the learners know only this URL.
            syncer = sup.children[name]
            syncer.argv[syncer.argv.index("--port") + 1] = str(endpoint["port"])
            syncer.meta["url"] = endpoint["url"]
            if args.syncer_standby and not args.no_restart:
                # Waits on the state directory's lock and serves the moment the syncer dies; the supervisor then only
                # books it (hence the tiny restart delay) and starts the next standby. First started by the next poll.
                standbys.append(SyncerStandby(syncer.argv, self.env, syncer.log_path, sup.spawn, syncer_dir,
                                              fork=args.fork_spares, hold_file=sup.hold_dir / f"{name}.json"))
                syncer.restart_delay = min(syncer.restart_delay, 0.05)
        if standbys:
            sup.syncer_standby = standbys[0] if len(standbys) == 1 else StandbyGroup(standbys)
        return ",".join(e["url"] for e in endpoints)

    def _start_learners(self, sup: Supervisor, syncer_urls: str) -> None:
        args, slowdown = self.args, self.plan.slowdown
        for i in range(args.learners):
            name = f"learner-{i}"
            state_dir = self.run_dir / "learners" / name
            learner_argv = self.plan.prefixes.get(name, []) + procs.diloco_argv(
                "learner", "--syncer", syncer_urls, "--learner-id", name,
                "--unit", str(i), "--units", str(args.learners), "--state-dir", str(state_dir),
                "--steps", str(args.steps), "--slowdown", f"{slowdown[i]:g}", "--log-every", str(args.log_every),
                "--device", "cpu", "--drain-s", "20")
            if args.jitter:
                learner_argv += ["--jitter", f"{args.jitter:g}"]
            if self.tls:
                learner_argv += ["--ca", str(self.tls.ca)]
            sup.add(Child(name, "learner", learner_argv, self.env, self.run_dir / "logs" / f"{name}.log",
                          restart=not args.no_restart, restart_delay=args.restart_delay,
                          meta={"state_dir": str(state_dir), "slowdown": slowdown[i]}))
            self.session.add_learner(name, state_dir, args.steps, slowdown[i])
            sup.start(name)
        sup.write_processes_json()

    def _start_spares(self, sup: Supervisor) -> None:
        args = self.args
        if args.spares and not args.no_restart:
            sup.spares = SparePool(self.run_dir / "spares", args.spares, procs.diloco_argv("learner"), self.env,
                                   sup.spawn, fork=args.fork_spares,
                                   zygote_args=("--warm-config", str(self.config_path)))
            sup.spares.refill()

    def stop(self, sup: Supervisor, reason: str) -> float:
        """Stop the learners, then the syncer(s) once they merged what they got; returns when training ended."""
        self.session.message(f"stopping: {reason}")
        train_end = time.monotonic()
        # Learners drain their last submissions (bounded by their --drain-s) and exit; on a busy machine that can
        # take a while, and a learner killed here would lose the acknowledgements it has not logged yet.
        sup.stop([c.name for c in sup.children.values() if c.role == "learner"], timeout=60.0)
        self.session.drain_syncer(sup, timeout=20.0)
        sup.stop(self.plan.syncers, timeout=60.0)  # SIGTERM: each syncer (shard) writes its final checkpoint
        sup.poll()
        self.session.close_display()
        for event in sup.events:
            if event.event == "kill":
                print(f"warning: {event.name} had to be killed: {event.reason}", file=sys.stderr)
        return train_end

    def collect_final_checkpoint(self) -> None:
        """RUN_DIR/final: the syncer's last checkpoint, or the shards' combined."""
        if len(self.syncer_dirs) == 1:
            _copy_final_checkpoint(self.syncer_dirs[0], self.run_dir / "final")
        else:
            combine_final_checkpoints(self.syncer_dirs, self.run_dir / "final")


def _copy_final_checkpoint(syncer_dir: Path, final: Path) -> None:
    """final/ gets the syncer's newest whole checkpoint (a damaged one passed over, as the syncer would); nothing if
    it has none. Imported here: `diloco local` checks its arguments before it pays for torch."""
    from diloco_trainer.syncer.store import load_checkpoint

    try:
        loaded = load_checkpoint(syncer_dir)
    except ValueError as exc:
        print(f"diloco local: no final model: {exc}", file=sys.stderr)
        return
    if loaded is None:
        return
    for name in ("theta.safetensors", "state.json"):
        shutil.copy2(loaded.path / name, final / name)
