"""One local run from the supervisor's side: the watch loop, syncer sampling, model snapshots and the final report.

Used by `diloco local` (with a syncer) and `diloco baseline` (without one), so both leave the same run directory.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import yaml

from diloco_trainer.config import TrainConfig
from diloco_trainer.goodput import goodput
from diloco_trainer.protocol.messages import MetricsRecord, SyncerSample, SyncerStatus
from diloco_trainer.protocol.runfiles import RunEvent
from diloco_trainer.runtime import progress, report
from diloco_trainer.runtime.procs import Supervisor
from diloco_trainer.runtime.rundir import append_jsonl, last_jsonl, learner_slots, learner_totals, metrics_records
from diloco_trainer.runtime.summary import build_summary, write_outputs
from diloco_trainer.runtime.shards import ShardsClient
from diloco_trainer.runtime.syncer_client import SyncerClient, wait_for_endpoint

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "local.yaml"  # the repository's configs/
# Sized with configs/local.yaml: the default run (4 learners on 2 cores) ends within 5 minutes, evaluation included.
DEFAULT_STEPS = 400
DEFAULT_MINUTES = 3.5
_BASELINE_NOTE = {"ddp": "no syncer: gradients all-reduced every step (gloo)",
                  "sync-diloco": "no syncer: Δ all-reduced every H steps, everyone waits (gloo)"}
CRASH_LOOP = 3  # this many consecutive incarnations that each lived < CRASH_LOOP_S: give up
CRASH_LOOP_S = 15.0


def load_config(path: str | Path, overrides: list[str]) -> TrainConfig:
    """The run config from YAML plus `KEY=VALUE` overrides (dotted keys, YAML values); errors name the field."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"config file {str(path)!r} not found (pass --config)")
    raw = yaml.safe_load(path.read_text()) or {}
    from diloco_trainer.config import MODEL_PRESETS

    if isinstance(raw.get("model"), str):
        raw["model"] = MODEL_PRESETS[raw["model"]].model_dump()
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SystemExit(f"--set {key}: {part!r} is not a section")
        node[leaf] = yaml.safe_load(value)
    try:
        return TrainConfig.model_validate(raw)
    except ValueError as exc:
        raise SystemExit(f"invalid config {str(path)!r}: {exc}") from None


def parse_slowdown(text: str, n: int) -> list[float]:
    """'1,1,1,2' → one factor per learner (>= 1); a single value applies to every learner."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--slowdown expects comma-separated numbers, got {text!r}") from None
    if len(values) == 1:
        values = values * n
    if len(values) != n:
        raise SystemExit(f"--slowdown has {len(values)} factors for {n} learners")
    if any(v < 1 for v in values):
        raise SystemExit(f"--slowdown factors must be >= 1 (1 = full speed), got {text!r}")
    return values


class RunSession:
    """State the supervisor keeps while a run is live, and what it writes into the run directory."""

    def __init__(self, run_dir: Path, cfg: TrainConfig, mode: str, learners: int, plain: bool = False,
                 eval_batches: int = 32, snapshots: int = 3):
        self.run_dir, self.cfg, self.mode, self.n = run_dir, cfg, mode, learners
        self.plain = plain or not sys.stdout.isatty()
        self.eval_batches, self.n_snapshots = eval_batches, snapshots
        self.learners: dict[str, dict] = {}
        self.client: SyncerClient | ShardsClient | None = None
        self.syncer_names: list[str] = ["syncer"]  # supervised children: one syncer, or one per shard (shards.py)
        self.endpoint_paths: list[Path] = []
        self.serving_pids: dict[str, int | None] = {}  # per syncer child: the process endpoint.json named last
        self.shards_up: list[bool] | None = None  # sharded: which shards answered the last sample
        self.status: SyncerStatus | None = None
        self.goodput: float | None = None  # live, from the run directory and the syncer's merged steps
        self.messages: list[str] = []
        self.bytes_up: dict[tuple[str, int], float] = {}  # (syncer, incarnation) -> outer-gradient bytes so far
        self.snapshots_taken = 0
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.budget_s: float | None = None
        self.train_started: float | None = None  # when the first learner logged a step
        self.corpus = None
        self.val_tokens = None  # what the final evaluation reads (all of a small corpus, a bounded sample of shards)
        self.unigram: float | None = None
        self._live = None
        self._last_plain = 0.0

    # ------------------------------------------------------------------ set-up

    def prepare_data(self) -> None:
        """Load (and cache) the corpus once, check every shard is big enough, compute the unigram baseline."""
        from diloco_trainer.data.corpus import unigram_loss
        from diloco_trainer.data.source import SAMPLE_TOKENS, config_vocab, open_tokens

        try:
            tokens = open_tokens(self.cfg.data, config_vocab(self.cfg.model))
            tokens.sampler(self.n - 1, self.n, 1, self.cfg.model.seq_len)  # every shard fits a window
        except ValueError as exc:
            raise SystemExit(f"data: {exc}") from None
        self.corpus = tokens
        self.val_tokens = tokens.sample("val", SAMPLE_TOKENS)
        self.unigram = unigram_loss(tokens.sample("train", SAMPLE_TOKENS), self.val_tokens)
        unit = self.cfg.data.token_unit
        self.message(f"corpus: {tokens.train_tokens:,} train / {len(self.val_tokens):,} validation {unit}s, "
                     f"unigram baseline {self.unigram:.3f} nats/{unit}")

    def wait_for_shards(self, sup: Supervisor, names: list[str], endpoint_paths: list[Path], token: str,
                        timeout: float = 120.0, ca: Path | None = None) -> list[dict]:
        """Block until every syncer (shard) child `names` listens; returns their endpoint.json documents."""
        endpoints = []
        for name, path in zip(names, endpoint_paths):
            try:
                endpoint = wait_for_endpoint(path, lambda name=name: sup.children[name].alive, timeout)
            except RuntimeError as exc:
                raise SystemExit(f"{name}: {exc}; see {sup.children[name].log_path}") from None
            endpoints.append(endpoint)
            self.serving_pids[name] = endpoint.get("pid")
            owned = f" (fragments {endpoint.get('owned')})" if len(names) > 1 else ""
            self.message(f"{name} listening on {endpoint['url']}{owned}")
        urls = [e["url"] for e in endpoints]
        self.client = SyncerClient(urls[0], token, ca=ca) if len(urls) == 1 else ShardsClient(urls, token, ca=ca)
        self.syncer_names, self.endpoint_paths = list(names), list(endpoint_paths)
        self._snapshot(force=True)  # Θ₀: the first point of the global model's validation curve
        return endpoints

    def add_learner(self, name: str, state_dir: Path, steps: int, slowdown: float) -> None:
        self.learners[name] = {"state_dir": state_dir, "steps": steps, "slowdown": slowdown,
                               "done_before": 0, "tokens_before": 0, "seen_starts": 1, "last": None}

    def message(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        self.messages.append(f"{stamp} {text}")
        if self._live is None:
            print(f"{stamp} {text}", flush=True)

    # ------------------------------------------------------------------ the watch loop

    def supervise(self, sup: Supervisor, stop, started: float, budget_s: float, steps: int,
                  fail_fast: bool = False) -> str:
        """Watch the run until every learner finished, the budget ran out or a stop was requested.

        `fail_fast` (synchronous baselines): one worker that fails ends the watch, as it ends a real DDP job; the
        caller decides whether the job restarts (bounded by its --max-restarts, so no crash-loop check here).
        """
        self.started, self.budget_s = started, budget_s
        self.started_wall = time.time() - (time.monotonic() - started)
        sup.should_restart = lambda child: self._before_restart(child, steps)
        self._open_display()
        next_sample = 0.0
        while True:
            for event in sup.poll():
                self._on_event(sup, event)
            now = time.monotonic()
            if now >= next_sample:
                next_sample = now + 1.0
                self._sample(sup)
            self._refresh(sup)
            learners = [c for c in sup.children.values() if c.role == "learner"]
            if learners and all(c.finished for c in learners):
                return "every learner finished its steps"
            if stop:
                return f"{stop.requested} received"
            # Before the next check: when the survivors of a synchronous job exit at once (their collective broke),
            # every worker is down in the same poll, and the cause is still that a worker failed.
            if fail_fast and any(c.exits and len(c.exits) == len(c.starts) and c.exits[-1] != 0 for c in learners):
                return "a worker failed; a synchronous job cannot continue without it"
            if learners and all(c.finished or c.down for c in learners):
                return "no learner is left running (the failed ones are not restarted)"
            if now - started >= budget_s:
                return f"time budget of {budget_s / 60:.1f} min used"
            for c in sup.children.values():
                if not fail_fast and self._crash_looping(sup, c.name):
                    raise SystemExit(f"{c.name} failed {CRASH_LOOP} times in a row within {CRASH_LOOP_S:.0f}s "
                                     f"of starting; see {c.log_path}")
            sup.wait(0.25)  # or less: an exit or a due restart wakes it

    @staticmethod
    def _crash_looping(sup: Supervisor, name: str) -> bool:
        """The last CRASH_LOOP lives each ended in an error exit soon after starting (a bug, not chaos:
        a process killed by a signal, as chaos tools do, never counts)."""
        lives, start = [], None
        for e in sup.events:
            if e.name != name:
                continue
            if e.event == "start":
                start = e.time
            elif e.event == "exit" and start is not None:
                lives.append((e.code, e.time - start))
        last = lives[-CRASH_LOOP:]
        return len(last) == CRASH_LOOP and all(code > 0 and life < CRASH_LOOP_S for code, life in last)

    def _before_restart(self, child, steps: int) -> bool:
        """A crashed learner comes back for the steps still missing; one that had trained them all is done."""
        info = self.learners.get(child.name)
        if info is None:
            return True  # the syncer
        done = learner_totals(metrics_records(info["state_dir"] / "metrics.jsonl"), child.starts)["step"]
        if done >= steps:  # it failed on its way out, after its last step
            return False
        argv = child.argv
        argv[argv.index("--steps") + 1] = str(steps - done)
        return True

    def _on_event(self, sup: Supervisor, event: RunEvent) -> None:
        name, kind = event.name, event.event
        if kind == "exit" and event.code != 0:
            child = sup.children[name]
            when = (f"; restarting in {max(0.0, child.restart_at - time.monotonic()):.1f}s"
                    if child.restart_at is not None else "")
            self.message(f"{name} exited with code {event.code}{when}")
            if child.finished:
                self.message(f"{name} had trained all its steps before it failed; not restarted")
        elif kind == "start" and len(sup.children[name].starts) > 1:
            how = "a warm spare took over, " if event.spare else ""
            how = "a warm standby takes over, " if event.standby else how
            self.message(f"{name} restarted ({how}pid {event.pid}, restart #{sup.children[name].restarts})")

    def _sample(self, sup: Supervisor) -> None:
        """Once a second: the syncer's status into syncer.jsonl, its byte counter, and due snapshots."""
        if self.client is None:
            return
        self.status = self.client.status()
        sharded = isinstance(self.client, ShardsClient)
        self.shards_up = list(self.client.up) if sharded else None
        # Sharded: "up" only while every shard answers (the status then covers every fragment).
        sample = SyncerSample(time=time.time(), elapsed_s=time.monotonic() - self.started,
                              up=self.status is not None and (not sharded or all(self.shards_up)),
                              status=self.status, shards_up=self.shards_up)
        append_jsonl(self.run_dir / "syncer.jsonl", sample.to_line())
        self._note_new_syncer()
        if self.status is not None:
            self.goodput = self._live_goodput()
            if int(sample.elapsed_s) % 5 == 0:
                self._scrape_bytes(sup)
        self._snapshot()

    def _note_new_syncer(self) -> None:
        """One progress line when another syncer process serves (endpoint.json names it), with its takeover time."""
        for name, path in zip(self.syncer_names, self.endpoint_paths):
            try:
                endpoint = json.loads(path.read_text())
            except (OSError, ValueError):  # being replaced, or gone at shutdown
                continue
            pid = endpoint.get("pid")
            if pid is None or pid == self.serving_pids.get(name):
                continue
            self.serving_pids[name] = pid
            how = "warm standby" if endpoint.get("standby") else "cold start"
            takeover = endpoint.get("takeover_s")
            self.message(f"{name} pid {pid} serving ({how}" +
                         (f"; {takeover:.2f} s from the state lock to serving)" if takeover is not None else ")"))

    def _scrape_bytes(self, sup: Supervisor) -> None:
        if self.client is None:
            return
        texts = self.client.metrics_texts() if isinstance(self.client, ShardsClient) else [self.client.metrics_text()]
        for name, text in zip(self.syncer_names, texts):
            value = None if text is None else report.prometheus_sum(text, "diloco_syncer_bytes_received",
                                                                    endpoint="outer-gradient")
            if value is not None:  # per syncer incarnation: a restarted syncer starts its counters at zero
                self.bytes_up[(name, len(sup.children[name].starts))] = value

    def _progress_fraction(self) -> float:
        """How far training is: by steps, or by the part of the time budget left once training began
        (start-up can take a while on a busy machine; snapshots of an untouched Θ₀ would be wasted)."""
        done = [self._total_steps(n) / info["steps"] for n, info in self.learners.items()]
        by_steps = sum(done) / len(done) if done else 0.0
        if self.train_started is None:
            if not any(info["last"] for info in self.learners.values()):
                return by_steps
            self.train_started = time.monotonic()
        by_time = 0.0
        if self.budget_s:
            left = self.budget_s - (self.train_started - self.started)
            by_time = (time.monotonic() - self.train_started) / left if left > 0 else 1.0
        return max(by_time, by_steps)

    def _snapshot(self, force: bool = False) -> None:
        """Save Θ at k/(S+1) of the run (evaluated after training, when the CPU is free)."""
        k = self.snapshots_taken
        if not force and (k > self.n_snapshots or self._progress_fraction() < k / (self.n_snapshots + 1)):
            return
        data = self.client.state_bytes()
        if data is None:
            return
        name = f"snapshot-{k:02d}.safetensors"
        (self.run_dir / "snapshots" / name).write_bytes(data)
        append_jsonl(self.run_dir / "snapshots" / "index.jsonl",
                     {"file": name, "time": time.time(), "tokens": self._tokens_trained()})
        self.snapshots_taken += 1

    # ------------------------------------------------------------------ display

    def _learner_tail(self, name: str) -> MetricsRecord | None:
        info = self.learners[name]
        line = last_jsonl(info["state_dir"] / "metrics.jsonl")
        try:
            rec = None if line is None else MetricsRecord.model_validate(line)
        except ValueError:
            rec = None
        info["last"] = rec
        if rec is not None and rec.tokens_per_s:  # a final line's window may be empty (0 tok/s): keep the last rate
            info["rate"] = rec.tokens_per_s
        return rec

    def _total_steps(self, name: str) -> int:
        info = self.learners[name]
        return info["done_before"] + (info["last"].steps_in_incarnation if info["last"] else 0)

    def _tokens_trained(self) -> int:
        return sum(info["tokens_before"] + (info["last"].tokens if info["last"] else 0)
                   for info in self.learners.values())

    def _view(self, sup: Supervisor) -> progress.View:
        views = []
        for name, info in self.learners.items():
            child = sup.children.get(name)
            if child is not None and len(child.starts) != info["seen_starts"]:
                # A new incarnation: fold the old one's counters into the totals shown.
                prev = info["last"]
                info["done_before"] += prev.steps_in_incarnation if prev else 0
                info["tokens_before"] += prev.tokens if prev else 0
                info["seen_starts"] = len(child.starts)
                info["last"] = None
            rec = self._learner_tail(name)
            if rec is not None and child is not None and child.starts and rec.time < child.starts[-1]:
                info["last"] = rec = None  # the previous incarnation's line: nothing new logged yet
            status = "stopped"
            if child is not None:
                status = ("running" if child.alive else "done" if child.finished
                          else "restarting" if child.restart_at is not None else "stopped")
            views.append(progress.LearnerView(name, status, child.restarts if child else 0, rec,
                                              self._total_steps(name), info["steps"], info["slowdown"],
                                              info.get("rate") if status == "running" else None))
        syncers = [sup.children[n] for n in self.syncer_names if n in sup.children]
        return progress.View(
            title=f"diloco {self.mode} — {self.run_dir}", elapsed_s=time.monotonic() - self.started,
            budget_s=self.budget_s, learners=views, syncer=self.status,
            syncer_restarts=sum(c.restarts for c in syncers), shards_up=self.shards_up, goodput=self.goodput,
            no_syncer=None if self.mode == "decoupled" else _BASELINE_NOTE.get(self.mode, self.mode),
            tokens_trained=self._tokens_trained(), messages=self.messages, ledger=self._live_ledger())

    def _live_ledger(self) -> dict | None:
        """The run's ledger so far (runtime/ledger.py) with the merged steps the syncer reports now; a running life's
        unsettled work reads as lost there, which the live line shows as open."""
        if self.mode != "decoupled" or self.status is None:
            return None
        from diloco_trainer.runtime.ledger import run_ledger

        merged = {lid: {"steps_merged": ls.steps_merged,
                        "lives": [{"id": w.id, "steps_merged": w.steps_merged} for w in ls.incarnations]}
                  for lid, ls in self.status.learners.items()}
        return run_ledger(self.run_dir, merged)

    def _live_goodput(self) -> float | None:
        """Goodput so far (goodput.py's definition), with the merged steps the syncer reports now."""
        merged = {lid: info.steps_merged for lid, info in self.status.learners.items()}
        return goodput(learner_slots(self.run_dir, merged, self.cfg.outer.fragments).values())["goodput"]

    def _open_display(self) -> None:
        if self.plain or self._live is not None:  # a restarted job is watched again in the same display
            return
        from rich.live import Live

        self._live = Live(auto_refresh=False, transient=False)  # no refresh thread: we refresh from the loop
        self._live.start()

    def _refresh(self, sup: Supervisor) -> None:
        view = self._view(sup)
        if self._live is not None:
            self._live.update(progress.render(view), refresh=True)
        elif time.monotonic() - self._last_plain >= 10.0:
            self._last_plain = time.monotonic()
            print(progress.plain_line(view), flush=True)

    def close_display(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    # ------------------------------------------------------------------ shutdown and report

    def drain_syncer(self, sup: Supervisor, timeout: float) -> None:
        """After the learners stopped: wait (bounded) until nothing is pending, so Θ includes every ack."""
        if self.client is None or not any(sup.children[n].alive for n in self.syncer_names):
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._sample(sup)
            if self.status is not None and not self.status.pending_total:
                break
            time.sleep(0.5)
        self._scrape_bytes(sup)

    def finish(self, sup: Supervisor, wall_time_s: float, stop_reason: str) -> dict:
        """Evaluate the final global model (and snapshots), write summary.json and plot.png, print the report."""
        self.message("evaluating the global model on the validation split ...")
        outer_bytes = sum(self.bytes_up.values()) if self.bytes_up else None
        summary, curves, evals = build_summary(
            self.run_dir, self.cfg, self.mode, self.n, self.val_tokens, self.unigram, wall_time_s, stop_reason,
            self.eval_batches, self.started_wall, outer_bytes)
        write_outputs(self.run_dir, summary, curves, evals,
                      title=f"{self.mode}: {self.n} learners, {summary['params']:,} parameters")
        for line in report.summary_lines(summary):
            print(line)
        print(f"plot: {self.run_dir / 'plot.png'}")
        return summary
