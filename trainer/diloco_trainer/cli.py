"""The `diloco` command. Subcommands live in their own modules and are imported only when used,
so `diloco --help` is fast and the operator image works without torch."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

# name -> (module, one-line help). Each module defines `configure(parser)` and `run(args) -> int`.
COMMANDS: dict[str, tuple[str, str]] = {
    "local": ("diloco_trainer.runtime.local", "train on this machine: a syncer and N learner processes"),
    "syncer": ("diloco_trainer.syncer.main", "run the syncer service (what the syncer image runs)"),
    "learner": ("diloco_trainer.learner.main", "run one learner unit (what the learner image runs)"),
    "pod-learner": ("diloco_trainer.runtime.podsup",
                    "a learner pod's entrypoint: the learner, restarted in place from a warm spare when it dies"),
    "baseline": ("diloco_trainer.baselines.train", "run a baseline: DDP or synchronous DiLoCo"),
    "data": ("diloco_trainer.data.cli", "tokenizers and token shards: train a BPE, prepare text/JSONL/Parquet"),
    "operator": ("diloco_operator.main", "run the Kubernetes operator (kopf)"),
    "devcluster": ("diloco_devcluster.cli", "a local Kubernetes control plane for trying the operator"),
    "chaos": ("diloco_chaos.cli", "run a chaos experiment against local learners or a DilocoJob"),
    "simulate": ("diloco_chaos.simulate.cli", "goodput simulator and WAN bandwidth calculator"),
    "bench": ("diloco_bench.cli", "benchmarks: Decoupled DiLoCo vs DDP and synchronous DiLoCo"),
    "export": ("diloco_trainer.model.export", "write the global model of a checkpoint as a transformers directory"),
}


def _top_level_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diloco",
        description="Decoupled DiLoCo: asynchronous, failure-tolerant distributed training.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {n:<11} {h}" for n, (_, h) in COMMANDS.items())
        + "\n\nRun 'diloco COMMAND --help' for a command's options.",
    )
    parser.add_argument("command", nargs="?", choices=sorted(COMMANDS), metavar="COMMAND")
    return parser


def stop_on_sigterm_as_pid_1() -> None:
    """As a container's PID 1 (a syncer pod's `diloco syncer`, a learner pod's `diloco pod-learner`), SIGTERM ends
    the process until its command installs a handler of its own. The kernel drops every signal PID 1 has no handler
    for, so a pod deleted while its command was still importing waited out its whole grace period to be SIGKILLed
    (a refused job's restarted syncer held its pod's deletion 32 s). Anywhere else SIGTERM's default stays."""
    if os.getpid() == 1 and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm_as_pid_1()
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_level_parser()
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        top.error(f"unknown command {name!r}; choose from {', '.join(COMMANDS)}")
    module_name, help_text = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        print(f"diloco {name}: needs {exc.name!r}, which is not installed ({exc})", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"diloco {name}", description=help_text)
    module.configure(parser)
    args = parser.parse_args(rest)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
