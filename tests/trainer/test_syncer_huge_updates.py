"""A learner with a valid token sending finite but huge updates, and stretching the grace window with its heartbeats,
against a real `diloco syncer` process (issue 38; docs/security.md): an update over its norm bound is clipped to it
(or refused), a version that is not finite is never published, and one learner's step time cannot hold merges."""

from __future__ import annotations

import json

import pytest
import torch

from diloco_trainer.protocol.wire import SubmissionMeta, encode_submission, quantize
from learner_kit import SyncerProcess
from polling import wait_for
from test_syncer_fuzz import request
from test_syncer_hostile_learner import HONEST, HOSTILE, SYNCER_ARGS, fragment, rejected, submit

pytestmark = pytest.mark.slow  # a real syncer process per test

H, BATCH = 8, 8
TOKENS = H * BATCH * 64  # one round of the largest unit (model "tiny": seq_len 64)


@pytest.fixture
def start_syncer(tmp_path):
    """start_syncer(**outer): a syncer (model tiny, 2 fragments, int8) with these outer settings, and the learners
    "honest" and "hostile" registered."""
    started = []

    def start(**outer) -> SyncerProcess:
        outer = {"fragments": 2, "sync_every": H, "compression": "int8", "block_size": 64, "grace": 0.0, **outer}
        lines = "".join(f"  {k}: {v}\n" for k, v in outer.items())
        config = tmp_path / "run.yaml"
        config.write_text(f"model: tiny\nseed: 5\ninner:\n  batch_size: {BATCH}\nouter:\n{lines}")
        proc = SyncerProcess(config, tmp_path / "state", tmp_path / "syncer.log", args=SYNCER_ARGS).start()
        started.append(proc)
        for learner, auth in (("honest", HONEST), ("hostile", HOSTILE)):
            doc = {"learner_id": learner, "unit": 0, "world_size": 1, "device": "cpu"}
            status, _, answer = request(proc.port, "POST", "/v1/register", json.dumps(doc).encode(), auth=auth)
            assert status == 200, answer[:300]
        return proc

    yield start
    for proc in started:
        proc.stop()
        log = proc.log_path.read_text()
        assert "Traceback" not in log, log[-4000:]


def body(proc: SyncerProcess, p: int, learner: str, sid: str, deltas: dict[str, torch.Tensor] | float,
         base: int) -> bytes:
    shapes = {n: tuple(t.shape) for n, t in fragment(proc, p).items()}
    if not isinstance(deltas, dict):
        deltas = {n: torch.full(s, float(deltas)) for n, s in shapes.items()}
    parts = {n: quantize(d, "int8", 64) for n, d in deltas.items()}
    return encode_submission(SubmissionMeta(learner, sid, p, base, H, TOKENS), parts, "int8", 64, shapes)


def honest_delta(proc: SyncerProcess, p: int, seed: int, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g) * scale for n, t in fragment(proc, p).items()}


def metric(proc: SyncerProcess, name: str, **labels: str) -> float:
    _, _, text = request(proc.port, "GET", "/metrics", auth=None)
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, value = line.rsplit(" ", 1)
            got = key[len(name):].strip("{}")
            if all(part in got.split(",") for part in want.split(",") if part):
                total += float(value)
    return total


def merged(proc: SyncerProcess, p: int, version: int) -> int:
    return wait_for(lambda: proc.status()["versions"][str(p)] > version and proc.status()["versions"][str(p)],
                    30, f"a merge of fragment {p} past version {version}")


def moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: after[n] - before[n] for n in before}


def assert_finite_and_bounded(proc: SyncerProcess, p: int, before: dict[str, torch.Tensor], rms: float) -> None:
    """Θ_p all finite, and no tensor of it moved by more than `rms` root-mean-square per element."""
    after = fragment(proc, p)
    bad = {n: int((~torch.isfinite(t)).sum()) for n, t in after.items() if not torch.isfinite(t).all()}
    assert not bad, f"non-finite values published: {bad}"
    worst = max(float(d.double().norm()) / d.numel() ** 0.5 for d in moved(before, after).values())
    assert worst <= rms, f"a tensor of Θ moved by RMS {worst:.3g} (bound {rms})"


def test_a_1e20_update_merged_with_an_honest_one_is_clipped_and_the_new_version_is_finite(start_syncer):
    """Outer RDA, lr 0.7, Nesterov 0.9 (the defaults): the 1e20 update's norm overflowed float32 inside RDA and the
    version published held non-finite values. Now it is clipped to the absolute bound (10 x max(‖Θ‖, √n) per
    tensor: RMS at most 10 here), the learner is told, and Θ moves by at most lr·(1 + μ)·that."""
    syncer = start_syncer(quorum=2)
    before = fragment(syncer, 0)
    assert submit(syncer, 0, body(syncer, 0, "honest", "honest.n.p0.v0", honest_delta(syncer, 0, 1), 0),
                  auth=HONEST)[0] == 202
    status, answer = submit(syncer, 0, body(syncer, 0, "hostile", "hostile.n.p0.v0", 1e20, 0))
    assert status == 202, answer
    merged(syncer, 0, 0)
    # RDA's radius is the mean of the two norms; a first Nesterov step moves by lr (1 + μ) x the merged update.
    assert_finite_and_bounded(syncer, 0, before, rms=0.7 * 1.9 * (10 + 1e-3) / 2 * 1.01)
    note = json.loads(answer).get("note") or ""
    assert "clipped: update norm" in note and "absolute bound" in note, answer
    assert metric(syncer, "diloco_syncer_updates_bounded_total", reason="absolute", action="clipped") == 1
    # The honest learner's next update still merges, from the new version.
    base = syncer.status()["versions"]["0"]
    assert submit(syncer, 0, body(syncer, 0, "honest", "honest.n2.p0", honest_delta(syncer, 0, 2), base),
                  auth=HONEST)[0] == 202
    status, answer = submit(syncer, 0, body(syncer, 0, "hostile", "hostile.n2.p0", 0.0, base))
    assert status == 202 and "note" not in json.loads(answer), answer
    merged(syncer, 0, base)
    assert all(torch.isfinite(t).all() for t in fragment(syncer, 0).values())


def test_a_1e20_update_merged_alone_moves_theta_by_at_most_its_absolute_bound(start_syncer):
    """Quorum 1: the 1e20 update is the merge. Θ reached 1.3e20 before; now each tensor's update is at most RMS 10."""
    syncer = start_syncer(quorum=1)
    before = fragment(syncer, 1)
    status, answer = submit(syncer, 1, body(syncer, 1, "hostile", "hostile.n.p1.v0", 1e20, 0))
    assert status == 202, answer
    merged(syncer, 1, 0)
    assert_finite_and_bounded(syncer, 1, before, rms=0.7 * 1.9 * 10 * 1.01)  # a first Nesterov step: lr (1 + μ)
    assert "clipped" in (json.loads(answer).get("note") or ""), answer


def test_with_update_bound_reject_a_1e20_update_is_refused_naming_the_bound(start_syncer):
    syncer = start_syncer(quorum=1, update_bound="reject")
    versions = syncer.status()["versions"]
    status, answer = submit(syncer, 1, body(syncer, 1, "hostile", "hostile.n.p1.v0", 1e20, 0))
    assert status == 400 and "exceeds its absolute bound" in json.loads(answer)["error"], answer
    assert rejected(syncer, "update_norm") == 1
    assert metric(syncer, "diloco_syncer_updates_bounded_total", reason="absolute", action="rejected") == 1
    assert syncer.status()["versions"] == versions and syncer.status()["pending"] == {"0": 0, "1": 0}


def test_a_slowly_growing_attack_is_held_to_max_norm_ratio_times_the_recent_median(start_syncer):
    """Merge by mean, lr 1, no momentum: each version moves Θ by exactly the mean of the two Δs. The honest Δ is
    1e-3 everywhere; the hostile one starts equal and grows 1.5x a version (x17,000 over 24 versions, RMS 17 at the
    end: each step within 10x of the last, the absolute bound alone would let most of it through). Once 8 norms of
    a tensor were seen, the hostile Δ is clipped to 10 x their lower median (the honest norm): Θ moves by at most
    (1 + 10)/2 x 1e-3 a version, and every version is finite."""
    syncer = start_syncer(quorum=2, merge="mean", lr=1.0, momentum=0.0)
    honest, version = 1e-3, 0
    for k in range(24):
        before = fragment(syncer, 0)
        attack = honest * 1.5 ** k
        assert submit(syncer, 0, body(syncer, 0, "honest", f"honest.n.p0.v{version}", honest, version),
                      auth=HONEST)[0] == 202
        status, answer = submit(syncer, 0, body(syncer, 0, "hostile", f"hostile.n.p0.v{version}", attack, version))
        assert status == 202, answer
        version = merged(syncer, 0, version)
        step = moved(before, fragment(syncer, 0))
        assert all(torch.isfinite(d).all() for d in step.values())
        if k >= 4:  # 2 norms a version: the relative bound holds from the fifth version on
            worst = max(float(d.abs().max()) for d in step.values())
            assert worst <= (1 + 10) / 2 * honest * 1.01, f"version {version}: Θ moved by {worst:.3g}"
    assert metric(syncer, "diloco_syncer_updates_bounded_total", reason="relative", action="clipped") >= 10


def test_a_merge_whose_result_is_not_finite_is_refused_and_the_fragment_keeps_its_last_good_version(start_syncer):
    """With no bound (update_bound none), a 3e38 update (finite: near float32's largest) makes the merge overflow.
    The merge is refused and counted, Θ and the version stay, and the next honest merge goes on from them (the
    refused merge's momentum was never kept). Before: version 1 was published holding infinities."""
    syncer = start_syncer(quorum=1, update_bound="none")
    before = fragment(syncer, 0)
    assert submit(syncer, 0, body(syncer, 0, "hostile", "hostile.n.p0.v0", 3e38, 0))[0] == 202
    wait_for(lambda: metric(syncer, "diloco_syncer_merges_refused_total", reason="not_finite") == 1, 30,
             "the refused merge")
    assert syncer.status()["versions"]["0"] == 0 and syncer.status()["pending"]["0"] == 0
    assert all(torch.equal(before[n], t) for n, t in fragment(syncer, 0).items())
    assert submit(syncer, 0, body(syncer, 0, "honest", "honest.n.p0.v0", honest_delta(syncer, 0, 3), 0),
                  auth=HONEST)[0] == 202
    merged(syncer, 0, 0)
    assert_finite_and_bounded(syncer, 0, before, rms=0.01)  # no momentum left over from the refused merge
    assert "not finite" in syncer.log_path.read_text()


def heartbeat(proc: SyncerProcess, learner: str, auth: str, step_time_s: float, step: int = 1) -> None:
    doc = {"learner_id": learner, "step": step, "tokens": 1, "step_time_s": step_time_s}
    status, _, answer = request(proc.port, "POST", "/v1/heartbeat", json.dumps(doc).encode(), auth=auth)
    assert status == 200, answer[:300]


def step_s(proc: SyncerProcess) -> float | None:
    """The learners' step time as the syncer holds it (what a registering learner is told)."""
    doc = {"learner_id": "honest", "unit": 0, "world_size": 1, "device": "cpu"}
    return json.loads(request(proc.port, "POST", "/v1/register", json.dumps(doc).encode(), auth=HONEST)[2])["step_s"]


def test_hostile_heartbeats_do_not_stretch_the_grace_window(start_syncer):
    """grace 0.5, overlap 2. After one merge, 30 heartbeats reporting 999,999 s a step stretched the window to
    ~1e6 s before (every merge the learner stays out of waited for it). The step time is now the lower median over
    learners, so the honest learner's 0.1 s holds it; the window is at most 0.5 x 2 x 0.1 s."""
    syncer = start_syncer(quorum=1, grace=0.5, overlap=2)
    heartbeat(syncer, "honest", HONEST, 0.1)
    for p in (0, 1):
        assert submit(syncer, p, body(syncer, p, "honest", f"honest.n.p{p}.v0", 0.0, 0), auth=HONEST)[0] == 202
        assert submit(syncer, p, body(syncer, p, "hostile", f"hostile.n.p{p}.v0", 0.0, 0))[0] == 202
        merged(syncer, p, 0)
    for _ in range(30):
        heartbeat(syncer, "hostile", HOSTILE, 999_999.0)
    assert step_s(syncer) <= 0.1
    grace = syncer.status()["grace_s"]
    assert grace <= 0.5 * 2 * 0.1, f"grace window {grace} s"


def test_a_lone_learners_step_time_is_clamped_to_how_often_it_submits(start_syncer):
    """Only the hostile learner reports a step time (999,999 s) and submits a fragment twice in a row: the syncer
    takes its step time as at most the time between the two submissions over H steps."""
    syncer = start_syncer(quorum=1, grace=0.5, overlap=2)
    heartbeat(syncer, "hostile", HOSTILE, 999_999.0)
    t = []
    for version in range(2):
        t.append(syncer.status()["uptime_s"])
        assert submit(syncer, 0, body(syncer, 0, "hostile", f"hostile.n.p0.v{version}", 0.0, version))[0] == 202
        merged(syncer, 0, version)
    elapsed = syncer.status()["uptime_s"] - t[0]  # more than the time between the two submissions
    assert step_s(syncer) <= elapsed / H
    assert syncer.status()["grace_s"] <= 0.5 * 2 * elapsed / H
