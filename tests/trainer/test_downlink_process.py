"""The quantized down-link end to end: a real `diloco syncer` process and the learner's real client. Every version
the client hands to the learner is bit-identical (sha256) to the syncer's, across many versions and a kill -9 of
the syncer; a new client starts from the initial version plus updates instead of the whole model."""

import signal
import urllib.request

import pytest
import torch

from diloco_trainer.learner.client import SyncerClient
from diloco_trainer.learner.link import Submission
from diloco_trainer.protocol.downlink import decode_answer, fragment_digest
from diloco_trainer.protocol.wire import ErrorFeedback, SubmissionMeta, encode_submission

from polling import wait_for
from learner_kit import TOKEN, SyncerProcess, write_config
from test_learner_client import _answers, _newest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]  # a real syncer process


def _syncers_values(syncer: SyncerProcess, p: int) -> tuple[int, dict[str, torch.Tensor]]:
    """The syncer's own Θ_p: the full fragment (no base), fp32."""
    req = urllib.request.Request(f"{syncer.url}/v1/fragments/{p}", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        a = decode_answer(resp.read())
    assert a.encoding == "full"
    return a.version, a.tensors


def _submit(client: SyncerClient, plan, theta, p: int, base: int, tag: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    deltas = {n: torch.randn(theta[n].shape, generator=g) * 1e-2 for n in plan[p]}
    parts = ErrorFeedback().compress(deltas, "int4", 64)
    sid = f"{client.learner_id}.{tag}.p{p}.v{base}"
    body = encode_submission(SubmissionMeta(client.learner_id, sid, p, base, 4, 2048), parts, "int4", 64,
                             {n: tuple(theta[n].shape) for n in plan[p]})
    client.submit(Submission(p, base, sid, body, 4, 2048))
    (answer,) = _answers(client)
    assert answer.accepted, answer.reason


def test_every_version_a_learner_rebuilds_is_bit_identical_to_the_syncers_across_a_syncer_kill(tmp_path):
    syncer = SyncerProcess(write_config(tmp_path / "run.yaml", downlink="int4", grace=0.0), tmp_path / "syncer",
                           tmp_path / "syncer.log").start()
    client = SyncerClient(syncer.url, TOKEN, "learner-0", poll_s=0.05)
    try:
        boot = client.bootstrap()
        start = client.snapshot()
        assert start["versions_rebuilt"] == 4 and start["bytes_down_full"] == 0  # Θ₀ built here, checked by digest
        held = {p: {n: boot.theta[n] for n in names} for p, names in enumerate(boot.plan)}
        versions = dict(boot.versions)
        for i in range(16):
            if i == 8:  # kill -9 between two checkpoints (every 1 s); acknowledged work is replayed on restart
                before = client.snapshot()  # up to here every version came as one update and matched
                assert before["versions_rebuilt"] == 4 + 8
                assert before["digest_mismatches"] == before["versions_full"] == 0
                syncer.stop(signal.SIGKILL)
                syncer.start()
            p = i % 2
            _submit(client, boot.plan, boot.theta, p, versions[p], f"r{i}", seed=i)
            update = _newest(client, p, versions[p])
            versions[p], held[p] = update.version, update.tensors
            wait_for(lambda: not any(syncer.status()["pending"].values()), 30, "the merge")
            version, theirs = _syncers_values(syncer, p)
            if version != versions[p]:  # a restart merged the replayed work into a newer version: follow it
                update = _newest(client, p, versions[p])
                versions[p], held[p] = update.version, update.tensors
            assert version == versions[p]
            assert fragment_digest(held[p]) == fragment_digest(theirs), f"round {i}: fragment {p} differs"
            assert all(torch.equal(held[p][n], theirs[n]) for n in theirs)
        snap = client.snapshot()
        assert snap["versions_rebuilt"] - start["versions_rebuilt"] >= 12  # most versions came as updates
        wire = snap["bytes_down"] - start["bytes_down"]
        full = 4 * sum(t.numel() for frag in held.values() for t in frag.values())
        assert wire < 16 / 2 * full / 4, "updates must be far smaller than whole fragments"
    finally:
        client.close()
        syncer.stop()
