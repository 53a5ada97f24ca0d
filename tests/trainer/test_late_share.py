"""A round of learners split over two merges ends where one merge of all of them would (outer.late_share)."""

import pytest
import torch

from diloco_trainer.syncer.merge import late_share
from polling import wait_for_async
from syncer_kit import AUTH, body, deltas_for, register_body, serve, tiny_config


def test_a_merge_on_the_current_version_is_applied_whole():
    assert late_share([3.0, 1.0], [0.0, 0.0]) == 1.0


def test_a_late_merge_gets_its_share_of_the_round():
    assert late_share([1.0], [3.0]) == pytest.approx(0.25)  # three learners' weight merged since its base
    assert late_share([1.0, 1.0], [0.0, 2.0]) == pytest.approx(2 / 3)  # the weights' mean of what merged since


def test_late_share_refuses_bad_inputs():
    for weights, since in (([1.0], [-1.0]), ([1.0], [float("inf")]), ([], []), ([1.0], [0.0, 1.0])):
        with pytest.raises(ValueError):
            late_share(weights, since)


@pytest.mark.parametrize("late_share_on", [True, False])
async def test_a_round_split_over_two_merges_ends_at_the_average_of_the_round(aiohttp_client, tmp_path,
                                                                              late_share_on):
    """Three learners send fragment 0 from version 0 and merge; a fourth, from the same version 0, merges alone just
    after. At outer lr 1 without momentum (weighted mean merge, equal weights) one merge of all four would land on the
    mean of their θ; re-anchored whole, the late merge lands on the late learner's θ alone and erases the three."""
    cfg = tiny_config(quorum=3, lr=1.0, momentum=0.0, merge="mean", late_share=late_share_on)
    _, client, st = await serve(aiohttp_client, tmp_path, cfg)
    theta0 = {n: t.clone() for n, t in st.fragment(0).items()}
    deltas = [deltas_for(st, 0, seed=s) for s in range(4)]
    for i in range(4):  # live learners: the quorum of 3 is not lowered to those pending
        assert (await client.post("/v1/register", json=register_body(f"learner-{i}"), headers=AUTH)).status == 200
    for i in range(3):
        r = await client.post("/v1/fragments/0/outer-gradient", headers=AUTH,
                              data=body(st, 0, deltas[i], learner=f"learner-{i}", sid=f"early-{i}"))
        assert r.status == 202
    await wait_for_async(lambda: st.versions[0] == 1, what="the merge of the first three")
    st.policy.quorum = 1  # the late learner alone makes the next merge (as with quorum 1 outside the grace window)
    r = await client.post("/v1/fragments/0/outer-gradient", headers=AUTH,
                          data=body(st, 0, deltas[3], learner="learner-3", sid="late", base=0))
    assert r.status == 202
    await wait_for_async(lambda: st.versions[0] == 2, what="the late merge")
    for n, t0 in theta0.items():
        everyone = t0 - sum(d[n] for d in deltas) / 4
        late_alone = t0 - deltas[3][n]
        want = everyone if late_share_on else late_alone
        torch.testing.assert_close(st.theta[n], want, rtol=1e-5, atol=1e-6)
