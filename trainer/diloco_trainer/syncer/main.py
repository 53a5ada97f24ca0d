"""`diloco syncer`: serve the syncer API (docs/protocol.md) until SIGTERM/SIGINT, then checkpoint and exit."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import time
from pathlib import Path

from diloco_trainer.config import TrainConfig
from diloco_trainer.fsutil import atomic_write_json
from diloco_trainer.protocol.tokens import read_bearer_token

from diloco_trainer.syncer.takeover import Incarnation, StateLock, fork_successor, record_incarnation, wait_out_hold

log = logging.getLogger("diloco.syncer")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="run config (YAML), handed to every learner")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8470, help="0 picks a free port (see DIR/endpoint.json)")
    parser.add_argument("--state-dir", required=True, help="checkpoint/ and spool/ live here; resumed on start")
    parser.add_argument("--token-env", default="DILOCO_TOKEN", help="environment variable holding the token")
    parser.add_argument("--token-file", default=None, metavar="FILE",
                        help="read the token from FILE instead (once, at start; e.g. a mounted Secret's key)")
    parser.add_argument("--max-body-mb", type=float, default=256.0, help="larger request bodies get 413")
    parser.add_argument("--max-unit-processes", type=int, default=64,
                        help="the most processes (pods) a learner unit runs: an inner step covers at most "
                             "inner.batch_size x model.seq_len x this many tokens, so a submission claiming more is "
                             "refused (the operator passes its largest units[].podsPerUnit)")
    parser.add_argument("--max-concurrent-uploads", type=int, default=4,
                        help="submission bodies decoded at once, each once it has arrived whole; more wait (a "
                             "learner's own token: one body at a time, more get 429)")
    parser.add_argument("--body-base-s", type=float, default=30.0,
                        help="a request body gets this long, plus its size at --body-min-rate-kbs, to arrive; one "
                             "that falls behind is cut with 408")
    parser.add_argument("--body-min-rate-kbs", type=float, default=256.0,
                        help="the slowest a request body may arrive after --body-base-s, in KiB/s")
    parser.add_argument("--keepalive-s", type=float, default=20.0,
                        help="close a connection idle this long after an answer, or whose request headers have not "
                             "all arrived this long after it opened or its previous answer")
    parser.add_argument("--checkpoint-every-s", type=float, default=30.0,
                        help="checkpoint at most this often after merges (and always at shutdown)")
    parser.add_argument("--heartbeat-s", type=float, default=2.0, help="heartbeat interval asked of learners")
    parser.add_argument("--log-every-s", type=float, default=10.0, help="progress line interval (0 = off)")
    parser.add_argument("--tls-cert", default=None, metavar="FILE",
                        help="serve HTTPS with this certificate (PEM, e.g. a Secret's tls.crt); needs --tls-key")
    parser.add_argument("--tls-key", default=None, metavar="FILE", help="the certificate's private key (tls.key)")
    parser.add_argument("--shard", type=int, default=None, metavar="I",
                        help="serve shard I of the config's syncer.shards N: only fragments p with p mod N = I, with "
                             "its own --state-dir (required when N > 1)")
    parser.add_argument("--standby", action="store_true",
                        help="start as a warm standby: import and warm up now, then take over the state directory "
                             "the moment the syncer serving it dies (any syncer waits while another one holds "
                             "STATE_DIR/serve.lock; see syncer/takeover.py)")
    parser.add_argument("--no-fork-successor", dest="fork_successor", action="store_false",
                        help="with --standby: do not fork the next standby on taking over (the supervisor then starts "
                             "one from scratch; forking needs the supervisor to be a child subreaper, as diloco local)")
    parser.add_argument("--hold-file", default=None, metavar="FILE",
                        help="before serving, wait while FILE holds a restart hold in force (a RestartHold document: "
                             "a chaos downtime; diloco local passes RUN/holds/syncer.json to its standby)")
    parser.add_argument("--learner-epochs", default=None, metavar="FILE",
                        help="the operator's file of learner token epochs (a mounted ConfigMap, re-read when it "
                             "changes): the token of a removed or replaced unit is refused with 403")
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        token = read_bearer_token(args.token_file, args.token_env)
    except ValueError as exc:
        print(f"diloco syncer: {exc}", flush=True)
        return 2
    for name in ("max_body_mb", "checkpoint_every_s", "heartbeat_s", "max_unit_processes", "max_concurrent_uploads",
                 "body_base_s", "body_min_rate_kbs", "keepalive_s"):
        if not getattr(args, name) > 0:
            print(f"diloco syncer: --{name.replace('_', '-')} must be > 0", flush=True)
            return 2
    if bool(args.tls_cert) != bool(args.tls_key):
        print("diloco syncer: --tls-cert and --tls-key go together", flush=True)
        return 2
    ssl_context = None
    if args.tls_cert:
        from diloco_trainer.protocol.tls import server_context

        try:
            ssl_context = server_context(Path(args.tls_cert), Path(args.tls_key))
        except ValueError as exc:
            print(f"diloco syncer: {exc}", flush=True)
            return 2
    elif args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving plain HTTP on %s: the token and the model travel unencrypted; give --tls-cert and "
                    "--tls-key for any network you do not control", args.host)
    args.ssl_context = ssl_context
    try:
        config = TrainConfig.from_yaml(args.config)
    except (OSError, ValueError) as exc:
        print(f"diloco syncer: cannot load --config {args.config}: {exc}", flush=True)
        return 2
    shards = config.syncer.shards
    if args.shard is None and shards > 1:
        print(f"diloco syncer: the config has syncer.shards {shards}: give --shard 0..{shards - 1}", flush=True)
        return 2
    args.shard = args.shard or 0
    if not 0 <= args.shard < shards:
        print(f"diloco syncer: --shard {args.shard} is out of range: syncer.shards is {shards}, so 0..{shards - 1}",
              flush=True)
        return 2
    supervisor = os.getppid()
    # SIGTERM/SIGINT while warming up or waiting for the lock: leave at once. Said explicitly because a syncer may
    # be PID 1 of its container (the operator's syncer pod), where the kernel ignores signals without a handler, and
    # a standby that ignored the pod's SIGTERM would take over from the syncer's clean stop.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _leave)
    args.started_at = time.time()
    t0 = time.monotonic()
    try:
        _warm_up(config, build=args.standby)
    except ValueError as exc:  # a model the config cannot build (model.entrypoint, model.hf, model.path)
        return _refuse(exc)
    args.warm_s = time.monotonic() - t0
    while True:
        lock = StateLock(Path(args.state_dir))
        args.previous_pid = lock.holder()
        if not lock.try_acquire():
            log.info("%s: syncer pid %s serves %s; taking over when it stops", "standing by" if args.standby else
                     "waiting", lock.holder(), args.state_dir)
            lock.acquire()  # returns the moment the holder dies: the kernel releases its lock
            log.info("took over %s from pid %s", args.state_dir, args.previous_pid)
        args.locked_at = time.time()
        if not (args.standby and args.fork_successor and fork_successor(Path(args.state_dir), lock, supervisor)):
            break
        # This is the successor: already warm, it waits for the lock the new syncer holds.
        args.started_at, args.warm_s = time.time(), 0.0
    # From here on a stop is a clean one (final checkpoint): remembered until the server's own handlers take over.
    args.stop_requested = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: args.stop_requested.append(signum))
    if args.hold_file and (held := wait_out_hold(Path(args.hold_file))) > 0.05:
        log.info("served only after a restart hold of %.1f s (%s)", held, args.hold_file)
        args.locked_at = time.time()
    try:
        return asyncio.run(_serve(args, config, token))
    except ValueError as exc:  # e.g. too many fragments for the model, a checkpoint written for another model
        return _refuse(exc)


# Where Kubernetes reads a container's termination message (the pod status shows it: `kubectl describe pod`).
TERMINATION_LOG = "/dev/termination-log"


def _refuse(exc: ValueError) -> int:
    """Exit 2 on a run the syncer cannot serve, saying why on stdout and in the container's termination message."""
    print(f"diloco syncer: {exc}", flush=True)
    path = Path(os.environ.get("DILOCO_TERMINATION_LOG", TERMINATION_LOG))
    if path.exists():
        try:
            path.write_text(f"diloco syncer: {exc}"[:4096])  # the kubelet keeps at most 4096 bytes
        except OSError:
            pass
    return 2


def _leave(signum: int, frame) -> None:
    log.info("stopped by signal %d before serving", signum)
    raise SystemExit(0)


def _warm_up(config: TrainConfig, build: bool) -> None:
    """What a restart would otherwise pay before it can load state: the imports and (a standby, which has time to
    spare) a first model build, which warms torch's allocator and kernels; a cold start builds the model once, when
    it loads its state."""
    from aiohttp import web  # noqa: F401

    from diloco_trainer.syncer import app, state  # noqa: F401

    if build:
        from diloco_trainer.model.build import build_model

        build_model(config.model, config.seed)


async def _serve(args: argparse.Namespace, config: TrainConfig, token: str) -> int:
    from aiohttp import web

    from diloco_trainer.syncer.app import Syncer, SyncerOptions, setup_runner
    from diloco_trainer.syncer.state import SyncerState

    state_dir = Path(args.state_dir)
    t0 = time.perf_counter()
    state = await asyncio.to_thread(lambda: SyncerState(config, state_dir, shard=args.shard))
    load_s = time.perf_counter() - t0
    log.info("state loaded from %s in %.2f s: versions %s, %d pending", state_dir, load_s,
             state.versions, sum(len(p) for p in state.pending))
    syncer = Syncer(state, SyncerOptions(token=token, max_body_bytes=int(args.max_body_mb * 2**20),
                                         checkpoint_every_s=args.checkpoint_every_s, heartbeat_s=args.heartbeat_s,
                                         max_unit_processes=args.max_unit_processes,
                                         max_concurrent_uploads=args.max_concurrent_uploads,
                                         body_base_s=args.body_base_s,
                                         body_min_bytes_per_s=args.body_min_rate_kbs * 1024,
                                         keepalive_s=args.keepalive_s, learner_epochs=args.learner_epochs))
    runner = await setup_runner(syncer)
    site = web.TCPSite(runner, args.host, args.port, ssl_context=args.ssl_context)
    await _bind(site)
    port = runner.addresses[0][1]
    connect = "127.0.0.1" if args.host in ("0.0.0.0", "", "::") else args.host
    scheme = "https" if args.ssl_context is not None else "http"
    endpoint = state_dir / "endpoint.json"
    incarnation = Incarnation(pid=os.getpid(), standby=args.standby, started_at=args.started_at, warm_s=args.warm_s,
                              locked_at=args.locked_at, load_s=load_s, serving_at=time.time(),
                              previous_pid=args.previous_pid)
    syncer.metrics.takeover_seconds.set(incarnation.takeover_s)
    syncer.metrics.state_load_seconds.set(load_s)
    syncer.metrics.standby.set(int(args.standby))
    record_incarnation(state_dir, incarnation)
    atomic_write_json(endpoint, {"host": args.host, "port": port, "url": f"{scheme}://{connect}:{port}",
                                 "shard": args.shard, "shards": state.shards, "owned": state.owned,
                                 "pid": os.getpid(), "serving_at": incarnation.serving_at,
                                 "takeover_s": incarnation.takeover_s, "standby": args.standby})
    which = f"shard {args.shard} of {state.shards}, fragments {state.owned}; " if state.shards > 1 else ""
    print(f"diloco syncer listening on {scheme}://{connect}:{port} ({which}state in {state_dir}; "
          f"{incarnation.takeover_s:.2f} s from the state lock to serving)", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if getattr(args, "stop_requested", None):  # a stop that came while the state loaded
        stop.set()
    progress = asyncio.create_task(_progress(syncer, args.log_every_s)) if args.log_every_s > 0 else None
    await stop.wait()
    log.info("stopping: final checkpoint")
    if progress:
        progress.cancel()
    await runner.cleanup()  # stops merging and writes the final checkpoint
    endpoint.unlink(missing_ok=True)
    log.info("stopped: versions %s, %d outer steps, %d tokens merged", state.versions, sum(state.outer_steps),
             state.tokens_merged)
    return 0


async def _bind(site, patience_s: float = 5.0) -> None:
    """Listen; a port still held for a moment by a syncer that just died (its socket closes after its lock) is
    tried again for up to `patience_s`."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            await site.start()
            return
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)


async def _progress(syncer, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        s = syncer.status()
        log.info("outer steps %d, versions %s, tokens merged %d, live learners %d, pending %s, grace %.2f s",
                 s.outer_steps, list(s.versions.values()), s.tokens_merged, s.live_learners,
                 list(s.pending.values()), s.grace_s)
