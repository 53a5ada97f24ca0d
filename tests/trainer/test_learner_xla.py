"""A learner on torch_xla's CPU device (PJRT_DEVICE=CPU) in the XLA environment (torch 2.9 + torch_xla 2.9,
hack/xla-env.sh), against a real syncer from the main environment over loopback; and learners of both torch
versions training against one syncer (the wire format is torch-free safetensors)."""

import json
import subprocess
import sys

import pytest
import torch

from polling import wait_for
from learner_kit import ROOT, SyncerProcess, child_env, finish, metrics, start_learner, write_config
from xla_kit import build_xla_env, run_in_xla_env, start_xla_learner

# The first run on a machine installs the XLA environment (~3 GB of wheels, ~13 min at load 13): inside the timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

STEPS, H, FRAGMENTS = 48, 8, 4


@pytest.fixture(scope="module")
def xla_env():
    return build_xla_env()


@pytest.fixture
def syncer(tmp_path):
    proc = SyncerProcess(write_config(tmp_path / "run.yaml"), tmp_path / "syncer", tmp_path / "syncer.log")
    yield proc.start()
    proc.stop()


def _merged(syncer: SyncerProcess, learner_id: str) -> dict:
    wait_for(lambda: not any(syncer.status()["pending"].values()), 60, "the syncer to merge everything pending")
    return syncer.status()["learners"][learner_id]


def test_learner_on_xla_adopts_merged_versions_and_stops_compiling_after_its_first_outer_round(
        tmp_path, xla_env, syncer):
    state = tmp_path / "xla"
    proc, log = start_xla_learner(xla_env, syncer.url, "xla", state, STEPS, "--log-every", "4")
    finish(proc, log, timeout=1200)

    recs = metrics(state)
    final = recs[-1]
    assert final["final"] and final["step"] == STEPS
    assert final["acked"] == final["sent"] >= 2 * FRAGMENTS and final["rejected"] == 0
    assert final["adoptions"] >= 2 * FRAGMENTS and all(v >= 2 for v in final["versions"].values()), final
    assert recs[-2]["loss"] < recs[0]["loss"] - 0.5, "training on XLA must reduce the loss"
    mine = _merged(syncer, "xla")
    assert mine["device"] == "xla:0" and mine["submissions_merged"] >= 2 * FRAGMENTS
    assert mine["tokens_merged"] == final["acked_tokens"]

    # torch_xla's own metrics, as the learner reports them: graphs compile during the first outer round (the first
    # steps, the first send and adoption of each fragment), then every step runs graphs already compiled.
    by_step = {r["step"]: r for r in recs if not r["final"]}
    settled = by_step[2 * H]
    assert settled["xla_compiles"] >= 1
    assert final["xla_compiles"] == settled["xla_compiles"], \
        [(r["step"], r["xla_compiles"]) for r in recs]
    assert final["xla_executions"] - settled["xla_executions"] >= STEPS - 2 * H, "each step runs a graph"
    assert "xla: %d graphs compiled" % final["xla_compiles"] in log.read_text()


def test_learners_on_torch_2_9_and_the_main_torch_train_against_one_syncer(tmp_path, xla_env, syncer):
    xla_state, main_state = tmp_path / "old-torch", tmp_path / "main-torch"
    old, old_log = start_xla_learner(xla_env, syncer.url, "old-torch", xla_state, STEPS, "--unit", "0",
                                     "--units", "2", device="cpu")
    main = start_learner(syncer.url, "main-torch", main_state, STEPS, "--unit", "1", "--units", "2")
    finish(old, old_log, timeout=600)
    finish(main, tmp_path / "main-torch.log", timeout=600)

    versions = run_in_xla_env(xla_env, "import torch; print(torch.__version__)").strip()
    assert versions.startswith("2.9.") and not torch.__version__.startswith("2.9."), (versions, torch.__version__)
    status = syncer.status()
    assert status["merges"] > 0
    for learner_id, state in (("old-torch", xla_state), ("main-torch", main_state)):
        final = metrics(state)[-1]
        assert final["acked"] == final["sent"] > 0 and final["rejected"] == 0, (learner_id, final)
        assert final["adoptions"] > 0, (learner_id, final)
        assert _merged(syncer, learner_id)["submissions_merged"] > 0, learner_id


_ENCODE = """
import hashlib, json, struct, sys, torch
from diloco_trainer.protocol.wire import ErrorFeedback, SubmissionMeta, encode_submission
deltas = {"w": ((torch.arange(4000) % 37 - 18).float() / 1000).reshape(40, 100), "b": torch.arange(100).float() / 7}
for scheme in ("none", "bf16", "int8", "int4"):
    parts = ErrorFeedback().compress(deltas, scheme, 64)
    body = encode_submission(SubmissionMeta("l0", "l0.n.p1.v3", 1, 3, 8, 4096), parts, scheme, 64,
                             {n: tuple(d.shape) for n, d in deltas.items()})
    if scheme == "int4":
        open(sys.argv[1], "wb").write(body)
    # safetensors: u64 header length, JSON header (its metadata map in no fixed order), then the tensor bytes
    n = struct.unpack("<Q", body[:8])[0]
    header = json.dumps(json.loads(body[8:8 + n]), sort_keys=True)
    print(scheme, hashlib.sha256(header.encode()).hexdigest(), hashlib.sha256(body[8 + n:]).hexdigest())
"""


def test_submission_bodies_are_the_same_under_both_torch_versions_and_parse_without_torch(tmp_path, xla_env):
    old_body, main_body = tmp_path / "old.safetensors", tmp_path / "main.safetensors"
    old = run_in_xla_env(xla_env, f"import sys; sys.argv[1:] = [{str(old_body)!r}]\n" + _ENCODE)
    main = subprocess.run([sys.executable, "-c", _ENCODE, str(main_body)], env=child_env(), cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout
    # The same header (dtypes, shapes, offsets, metadata) and the same tensor bytes, for every compression.
    assert len(old.splitlines()) == 4 and old == main

    # Any safetensors reader takes the body: numpy's, with no torch imported.
    parse = ("import json, sys; from safetensors.numpy import load; "
             "t = load(open(sys.argv[1], 'rb').read()); "
             "print(json.dumps({k: [str(v.dtype), list(v.shape)] for k, v in sorted(t.items())})); "
             "assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", parse, str(old_body)], env=child_env(), cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    layout = json.loads(out)
    assert {dtype for dtype, _ in layout.values()} == {"uint8", "float32"}, layout  # int4 nibbles, fp32 scales
