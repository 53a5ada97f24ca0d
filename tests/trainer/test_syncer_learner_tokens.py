"""Per-learner tokens (tokens.py) at the syncer's API: a learner's token acts only as that learner (403 with the
reason, nothing changed), a forged or another job's token is refused (401), and the job's token still acts as
anyone (the operator, `diloco local`)."""

from __future__ import annotations

from diloco_trainer.protocol.tokens import learner_token, token_learner
from syncer_kit import (AUTH, TOKEN, assert_unchanged, body, deltas_for, make_syncer, register_body, snapshot,
                        start)


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def test_a_learner_token_names_its_learner_and_no_other_job_accepts_it():
    token = learner_token(TOKEN, "demo-cpu-0")
    assert token.startswith("demo-cpu-0.") and token_learner(TOKEN, token) == "demo-cpu-0"
    assert token_learner("another-job-token", token) is None
    assert token_learner(TOKEN, token.replace("demo-cpu-0", "demo-cpu-1", 1)) is None  # the id is signed
    assert token_learner(TOKEN, "demo-cpu-0") is None and token_learner(TOKEN, ".") is None
    assert token_learner(TOKEN, learner_token(TOKEN, "a.dotted.id")) == "a.dotted.id"


async def test_a_learner_token_cannot_register_heartbeat_or_submit_as_another_learner(aiohttp_client, tmp_path):
    syncer = make_syncer(tmp_path)
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    mine = bearer(learner_token(TOKEN, "learner-a"))
    assert (await client.post("/v1/register", json=register_body("learner-a"), headers=mine)).status == 200
    before = snapshot(st)
    learners = set(st.learners)

    r = await client.post("/v1/register", json=register_body("learner-b"), headers=mine)
    assert r.status == 403 and (await r.json())["error"] == \
        "the token of learner 'learner-a' cannot act as learner 'learner-b'"
    r = await client.post("/v1/heartbeat", json={"learner_id": "learner-b", "step": 1, "step_time_s": 0.1,
                                                 "tokens": 10}, headers=mine)
    assert r.status == 403 and "learner-b" in (await r.json())["error"]
    r = await client.post("/v1/fragments/0/outer-gradient", headers=mine,
                          data=body(st, 0, deltas_for(st, 0, 1), learner="learner-b", sid="forged"))
    assert r.status == 403 and "cannot act as learner 'learner-b'" in (await r.json())["error"]
    assert_unchanged(before, snapshot(st))
    assert set(st.learners) == learners and not st.is_known("forged")
    assert syncer.metrics.rejected.labels("forbidden")._value.get() == 1

    # Under its own id it submits like any learner; reads need no particular id.
    r = await client.post("/v1/fragments/0/outer-gradient", headers=mine,
                          data=body(st, 0, deltas_for(st, 0, 2), learner="learner-a", sid="learner-a.1"))
    assert r.status == 202 and st.is_known("learner-a.1")
    assert (await client.get("/v1/versions", headers=mine)).status == 200


async def test_a_forged_learner_token_is_refused_and_the_job_token_acts_as_anyone(aiohttp_client, tmp_path):
    syncer = make_syncer(tmp_path)
    client = await start(aiohttp_client, syncer)
    forged = learner_token("not-the-job-token", "learner-a")
    for headers in (bearer(forged), bearer(learner_token(TOKEN, "learner-a") + "x"), {"Authorization": forged}):
        r = await client.post("/v1/register", json=register_body("learner-a"), headers=headers)
        assert r.status == 401 and "token" in (await r.json())["error"]
    assert syncer.state.learners == {}
    for learner in ("learner-a", "learner-b"):
        assert (await client.post("/v1/register", json=register_body(learner), headers=AUTH)).status == 200
