"""`diloco learner`: one learner unit (what the learner image runs; contract in docs/protocol.md), and its
Prometheus `/metrics` endpoint."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--syncer", help="syncer URL, e.g. http://syncer:8470 (required); for a sharded syncer "
                                         "(syncer.shards N > 1) every shard's URL in shard order, comma-separated")
    parser.add_argument("--learner-id", help="this unit's id ([A-Za-z0-9_.:-], at most 128; required)")
    parser.add_argument("--unit", type=int, default=0, help="index of this unit: it trains data shard UNIT of UNITS")
    parser.add_argument("--units", type=int, default=None,
                        help="number of learner units sharing the corpus (required when --unit > 0)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "xla"])
    parser.add_argument("--state-dir", default=None,
                        help="keeps position.json (the data position, resumed on restart) and metrics.jsonl")
    parser.add_argument("--steps", type=int, default=None, help="inner steps to train, then drain and exit 0")
    parser.add_argument("--slowdown", type=float, default=1.0,
                        help="each step takes F x its compute time (sleeps the rest): imitates slower hardware")
    parser.add_argument("--jitter", type=float, default=0.0,
                        help="random spread of the slowdown: factor F*(1+J*u), u uniform in [-1, 1]")
    parser.add_argument("--log-every", type=int, default=10, help="a metrics line every N steps")
    parser.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics here (0 = off)")
    parser.add_argument("--drain-s", type=float, default=10.0,
                        help="at the end, wait at most this long for in-flight submissions")
    parser.add_argument("--seed", type=int, default=0, help="seeds the jitter (the data order follows the run seed)")
    parser.add_argument("--token-env", default="DILOCO_TOKEN", help="environment variable holding the shared token")
    parser.add_argument("--token-file", default=None, metavar="FILE",
                        help="read the token from FILE instead (once, at start; e.g. a mounted Secret's key)")
    parser.add_argument("--data-cache", default=None,
                        help="where corpora are cached as token files (default $DILOCO_DATA_CACHE or "
                             "~/.cache/diloco/data)")
    parser.add_argument("--poll-s", type=float, default=0.25, help="how often to look for newer fragment versions")
    parser.add_argument("--save-params", default=None, metavar="DIR",
                        help="at exit, write this process's final parameters to DIR/params-rank{R}.safetensors")
    parser.add_argument("--ca", default=None, metavar="FILE",
                        help="verify an https syncer's certificate against this CA (PEM, e.g. a Secret's ca.crt); "
                             "default: the system's CAs")
    parser.add_argument("--restore-inner-state", action=argparse.BooleanOptionalAction, default=None,
                        help="on start, resume AdamW moments and step and the error-feedback residuals from "
                             "--state-dir's last snapshot (written every 10 steps; default: on); the parameters "
                             "come from the syncer, except a sharded syncer's fragments whose shard is down: those "
                             "the snapshot holds (a version that shard issued), until it answers again")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--process-restarts", type=int, default=0, metavar="N",
                        help="set by `diloco pod-learner`: how often this learner's process was restarted in place "
                             "(exported as diloco_learner_process_restarts)")
    parser.add_argument("--standby", default=None, metavar="DIR",
                        help="warm spare: import everything, then wait for DIR/assignment.json (the learner "
                             "arguments a supervisor hands over) and become that learner")
    parser.add_argument("--zygote", default=None, metavar="DIR",
                        help="warm up once, then fork a warm spare for every DIR/fork-*.json request (the local "
                             "runtime's spare pool, runtime/zygote.py)")
    parser.add_argument("--warm-hf", action="store_true",
                        help="--zygote: warm up on a tiny transformers Llama instead of the built-in GPT, so transformers "
                             "is imported ahead too (a learner pod's spares, which learn the model only from the syncer)")
    parser.add_argument("--warm-config", default=None, metavar="YAML",
                        help="--zygote: warm up on a model of this run config's size (the local runtime's "
                             "config.yaml) instead of a tiny one")


def options_from_args(args: argparse.Namespace):
    """LearnerOptions from parsed arguments; a bad value raises ValueError naming the flag."""
    from diloco_trainer.learner.loop import LearnerOptions
    from diloco_trainer.protocol.shardmap import split_syncer_urls
    from diloco_trainer.protocol.tokens import read_bearer_token
    from diloco_trainer.protocol.wire import SubmissionMeta

    token = read_bearer_token(args.token_file, args.token_env)
    units = args.units if args.units is not None else (1 if args.unit == 0 else None)
    if units is None:
        raise ValueError(f"--unit {args.unit} needs --units (how many units share the corpus, shards must not overlap)")
    if units < 1 or not 0 <= args.unit < units:
        raise ValueError(f"--unit must be in 0..UNITS-1, got --unit {args.unit} --units {units}")
    for flag, value, low in (("--slowdown", args.slowdown, 1.0), ("--jitter", args.jitter, 0.0),
                             ("--drain-s", args.drain_s, 0.0)):
        if not value >= low:
            raise ValueError(f"{flag} must be >= {low:g}, got {value}")
    if args.jitter >= 1.0:
        raise ValueError(f"--jitter must be < 1, got {args.jitter}")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.process_restarts < 0:
        raise ValueError(f"--process-restarts must be >= 0, got {args.process_restarts}")
    if args.log_every < 1:
        raise ValueError(f"--log-every must be >= 1, got {args.log_every}")
    if not args.poll_s > 0:
        raise ValueError(f"--poll-s must be > 0, got {args.poll_s}")
    if not 0 <= args.metrics_port < 65536:
        raise ValueError(f"--metrics-port must be a TCP port or 0, got {args.metrics_port}")
    urls = split_syncer_urls(args.syncer)  # ValueError naming the bad one
    if args.ca and not Path(args.ca).is_file():
        raise ValueError(f"--ca {args.ca}: no such file")
    if args.ca and not all(u.startswith("https://") for u in urls):
        raise ValueError(f"--ca needs an https --syncer URL, got {args.syncer!r}")
    SubmissionMeta(args.learner_id, "check", 0, 0, 1, 1)  # the id must be valid on the wire (WireError otherwise)
    return LearnerOptions(
        syncer=args.syncer, learner_id=args.learner_id, token=token, unit=args.unit, units=units,
        device=args.device, state_dir=Path(args.state_dir) if args.state_dir else None, steps=args.steps,
        slowdown=args.slowdown, jitter=args.jitter, log_every=args.log_every, metrics_port=args.metrics_port,
        drain_s=args.drain_s, seed=args.seed, data_cache=Path(args.data_cache) if args.data_cache else None,
        poll_s=args.poll_s, save_params=Path(args.save_params) if args.save_params else None,
        ca=Path(args.ca) if args.ca else None, process_restarts=args.process_restarts,
        **({} if args.restore_inner_state is None else {"restore_inner": args.restore_inner_state}))


# --warm-hf: the smallest Llama transformers builds (importing transformers and its Llama code: ~5-7 s on 2 busy cores)
TINY_HF = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 8}


def _warm_up(config: str | None = None, hf: bool = False) -> None:
    """What a learner start spends most of its time on, done ahead: importing torch and our modules, and the lazy
    initialisation of a first forward, backward and AdamW step (measured on a busy 2-core machine: 13 s of imports,
    5 s for the first AdamW, 1.3 s for the first step; the first AdamW's share, torch.optim importing torch._dynamo,
    is gone since model/adamw.py). With the run's `config` (a YAML file), that step is taken
    by a throw-away model of the run's own size and batch, so the learner's first real step finds every buffer
    size it needs already allocated once, and the corpus is loaded ahead (`data.preload`); without it, a tiny
    model."""
    import torch

    from diloco_trainer.learner import client  # noqa
    from diloco_trainer.data import corpus as data  # noqa
    from diloco_trainer.learner import loop as learner  # noqa
    from diloco_trainer.config import MODEL_PRESETS, TrainConfig
    from diloco_trainer.model.build import build_model
    from diloco_trainer.model.optimizer import inner_optimizer

    if config:
        import yaml

        cfg = TrainConfig.model_validate(yaml.safe_load(Path(config).read_text()))
        shape = (cfg.inner.batch_size, cfg.model.seq_len)
        data.preload(cfg.data)  # the learners of `diloco local` read the default data cache
    elif hf:
        cfg, shape = TrainConfig(model={"hf": TINY_HF, "seq_len": 8}, inner={"lr": 1e-3}), (1, 8)
    else:
        cfg, shape = TrainConfig(model=MODEL_PRESETS["tiny"], inner={"lr": 1e-3}), (1, 8)
    model = build_model(cfg.model, seed=0)
    opt, _ = inner_optimizer(model, cfg)  # the learner's own AdamW: its groups, betas and weight decay
    x = torch.zeros(*shape, dtype=torch.long)
    _, loss = model(x, x)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
    opt.step()


def _warm_up_single_threaded(config: str | None, hf: bool = False) -> int:
    """`_warm_up` on one thread, for a zygote: OpenMP's thread pool does not survive a fork (a forked child's first
    parallel op waited forever in a learner pod, where OMP_NUM_THREADS is not 1), so the zygote never starts one and
    each forked spare starts its own. Returns the thread count torch would have used, for the spare to set."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _warm_up(config, hf)
    return threads


def _assigned_args(directory: str, warm_up=_warm_up) -> argparse.Namespace:
    """Wait as a warm spare (runtime/spares.py) and return the arguments of the learner this process becomes."""
    from diloco_trainer.runtime.spares import wait_for_assignment
    from diloco_trainer.runtime.zygote import redirect_output

    argv, log_path = wait_for_assignment(Path(directory), warm_up)
    redirect_output(log_path)
    parser = argparse.ArgumentParser(prog="diloco learner")
    configure(parser)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    spare = args.standby
    if args.zygote:
        from diloco_trainer.runtime.zygote import serve

        threads: list[int] = []

        def warm_up() -> None:
            threads.append(_warm_up_single_threaded(args.warm_config, args.warm_hf))

        spare = str(serve(Path(args.zygote), warm_up))  # returns only in a forked spare, already warm
        args = _assigned_args(spare, warm_up=lambda: None)
        if threads and threads[0] > 1:
            import torch

            torch.set_num_threads(threads[0])  # this process's own thread pool, started after the fork
    elif spare:
        args = _assigned_args(spare)
    if not args.syncer or not args.learner_id:
        print("diloco learner: --syncer and --learner-id are required", flush=True)
        return 2
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s {args.learner_id}[{rank}] %(name)s: %(message)s")
    if spare:  # the bench's kill breakdown reads this line's time (bench/diloco_bench/kill_cost.py)
        log.info("warm spare took over (pid %d, %s)", os.getpid(), spare)
    try:
        opts = options_from_args(args)
    except ValueError as exc:
        print(f"diloco learner: {exc}", flush=True)
        return 2
    from diloco_trainer.learner.link import SyncerRefused
    from diloco_trainer.learner.loop import Learner

    try:
        code = Learner(opts).run()
    except SyncerRefused as exc:
        print(f"diloco learner: {exc}", flush=True)
        code = 3
    except ValueError as exc:  # the syncer's config, plan or state does not fit this learner
        print(f"diloco learner: {exc}", flush=True)
        code = 2
    except FloatingPointError as exc:  # diverged: exit non-zero so a supervisor restarts it from the syncer's Θ
        print(f"diloco learner: {exc}", flush=True)
        code = 1
    _exit_at_once(code)


def _exit_at_once(code: int) -> None:
    """Exit without the interpreter's teardown: everything the learner keeps is written and closed by now.

    Measured: a process that imported torch spent 3.6-6 s in its final garbage collection on a busy 2-core machine
    (load 8-15; 0.24 s with os._exit), time a preempted pod's grace period and the unit's restart wait for."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
