"""A real learner against a real syncer trains on memory-mapped token shards many times larger than the memory it may
hold for them: measured from outside, its anonymous memory is that of a learner on a tiny shard set, and the pages of
the shard files resident in it stay a small fraction of the set."""

import json
import os
import re
import shutil
import threading
import time

import numpy as np
import pytest
import yaml

from polling import wait_for
from learner_kit import SyncerProcess, metrics, start_learner

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

MB = 1 << 20
FILES, FILE_TOKENS = 6, 32 * MB  # 6 x 64 MiB of uint16: 384 MiB of tokens on disk
ALLOWANCE = 64 * MB  # what the learner may hold because of the data: the set is 6x larger
STEPS = 20


def write_shards(folder, files, tokens_per_file):
    """uint16 tokens: one random 'text' of 10007 tokens over 64 symbols, repeated (fast to write, learnable)."""
    folder.mkdir(parents=True)
    base = np.random.default_rng(0).integers(0, 64, 10_007).astype("<u2")
    chunk = np.tile(base, tokens_per_file // len(base) + 1)[:tokens_per_file]
    for i in range(files):
        chunk.tofile(folder / f"train-{i:03d}.bin")
    return sum(p.stat().st_size for p in folder.iterdir())


def write_config(path, data_dir):
    cfg = {"model": "tiny", "data": {"source": "shards", "path": str(data_dir), "dtype": "uint16"},
           "inner": {"batch_size": 8, "warmup_steps": 5},
           "outer": {"fragments": 4, "sync_every": 8, "compression": "int4"}}
    path.write_text(yaml.safe_dump(cfg))
    return path


class MemoryWatch(threading.Thread):
    """Samples a process's anonymous RSS (/proc/PID/status) and the resident pages of its mappings of files under
    `data_dir` (/proc/PID/smaps) until it exits; keeps the peaks."""

    def __init__(self, pid, data_dir):
        super().__init__(daemon=True)
        self.pid, self.data_dir = pid, str(data_dir)
        self.anon_peak = self.data_peak = 0
        self.samples = 0

    def _read(self):
        status = open(f"/proc/{self.pid}/status").read()
        if re.search(r"^State:\s+Z", status, re.M):
            return False
        self.anon_peak = max(self.anon_peak, int(re.search(r"^RssAnon:\s+(\d+) kB", status, re.M)[1]) * 1024)
        data, in_data = 0, False
        for line in open(f"/proc/{self.pid}/smaps"):
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                in_data = line.rstrip().split(maxsplit=5)[-1].startswith(self.data_dir)
            elif in_data and line.startswith("Rss:"):
                data += int(line.split()[1]) * 1024
        self.data_peak = max(self.data_peak, data)
        self.samples += 1
        return True

    def run(self):
        try:
            while self._read():
                time.sleep(0.1)
        except (FileNotFoundError, ProcessLookupError, TypeError):
            pass  # the process is gone (or exiting: its status has no RssAnon any more)


def test_a_learner_trains_on_memory_mapped_shards_six_times_larger_than_the_memory_it_may_hold_for_them(tmp_path):
    big, small = tmp_path / "big", tmp_path / "small"
    runs, syncers = {}, {}
    try:
        on_disk = write_shards(big, FILES, FILE_TOKENS)
        write_shards(small, 1, 1 * MB)
        assert on_disk >= 6 * ALLOWANCE
        for name, data in (("big", big), ("small", small)):  # both syncers start at once
            syncers[name] = SyncerProcess(write_config(tmp_path / f"{name}.yaml", data), tmp_path / f"{name}-syncer",
                                          tmp_path / f"{name}-syncer.log").start(wait=False)
        for name, data in (("big", big), ("small", small)):
            syncer = syncers[name]
            syncer.port = wait_for(lambda: syncer._endpoint(syncer.state_dir / "endpoint.json"), 120,
                                   "the syncer's endpoint.json")["port"]
            state, log = tmp_path / f"{name}-learner", tmp_path / f"{name}-learner.log"
            proc = start_learner(syncer.url, name, state, STEPS, log_path=log)
            watch = MemoryWatch(proc.pid, data)
            watch.start()
            runs[name] = (syncer, proc, watch, state, log)
        usage = {}
        for name, (syncer, proc, watch, state, log) in runs.items():
            _, status, rusage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            watch.join(5)
            syncer.stop()
            assert proc.returncode == 0, f"{name} learner exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            usage[name] = rusage.ru_maxrss * 1024
        recs = metrics(runs["big"][3])
        assert recs[-1]["step"] == STEPS and recs[-1]["loss"] < recs[0]["loss"] - 0.5, "it trains"
        assert "token shards: 6 files" in runs["big"][4].read_text()
        big_w, small_w = runs["big"][2], runs["small"][2]
        assert big_w.samples >= 5 and small_w.samples >= 5
        held = big_w.anon_peak - small_w.anon_peak
        print(f"\nshards on disk {on_disk / MB:.0f} MiB; learner peak RSS (ru_maxrss) {usage['big'] / MB:.0f} MiB "
              f"vs {usage['small'] / MB:.0f} MiB on a 2 MiB set; anonymous peak {big_w.anon_peak / MB:.0f} vs "
              f"{small_w.anon_peak / MB:.0f} MiB; shard pages resident at most {big_w.data_peak / MB:.1f} MiB")
        assert held < ALLOWANCE, f"the learner holds {held / MB:.0f} MiB more anonymous memory than on a tiny set"
        assert big_w.data_peak < ALLOWANCE, f"{big_w.data_peak / MB:.0f} MiB of shard pages resident"
        assert usage["big"] < usage["small"] + ALLOWANCE, "peak RSS, file pages included, as on a tiny set"
    finally:
        for _, proc, *_ in runs.values():
            if proc.returncode is None:
                proc.kill()
                proc.wait()
        for syncer in syncers.values():
            syncer.stop()
        shutil.rmtree(big, ignore_errors=True)


def test_a_learner_trains_on_bpe_shards_prepared_from_text_and_a_restart_resumes_its_position(tmp_path):
    from diloco_trainer.data.corpus import list_stdlib_files
    from diloco_trainer.data.prepare import PrepareOptions, prepare
    from diloco_trainer.data.tokenizer import train_bpe

    texts = [f for f in list_stdlib_files() if f.parent.name == "json" or f.name in ("argparse.py", "textwrap.py")]
    tok = train_bpe(texts, 512, tmp_path / "tokenizer.json")
    manifest, wrote = prepare(PrepareOptions(inputs=[str(f) for f in texts], tokenizer=tok.name,
                                             out=tmp_path / "shards", shard_tokens=16_384, progress=False))
    assert wrote and len(manifest.shards) >= 3
    cfg = {"model": {"vocab_size": 512, "seq_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 2},
           "data": {"source": "shards", "path": str(tmp_path / "shards"), "tokenizer": tok.name},
           "inner": {"batch_size": 8, "warmup_steps": 5}, "outer": {"fragments": 4, "sync_every": 8}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    syncer = SyncerProcess(tmp_path / "run.yaml", tmp_path / "syncer", tmp_path / "syncer.log").start()
    state, log = tmp_path / "l0", tmp_path / "l0.log"
    try:
        for steps in (STEPS, 10):
            proc = start_learner(syncer.url, "l0", state, steps, log_path=log)
            assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        syncer.stop()
    first_run = [r for r in metrics(state) if r["step"] <= STEPS][: STEPS // 5]
    assert first_run[-1]["loss"] < first_run[0]["loss"] - 0.5, "it trains"
    position = json.loads((state / "position.json").read_text())
    train_tokens = sum(s.tokens - int(s.tokens * 0.05) for s in manifest.shards)
    assert position == {"shard": 0, "num_shards": 1, "offset": (STEPS + 10) * 8, "epoch": 0, "tokens": train_tokens}
    assert f"resuming shard 0/1 at epoch 0, offset {STEPS * 8}" in log.read_text()
