"""The syncer's per-life ledger (syncer/lives.py, /v1/status learners[].incarnations): what each process of a learner
trained, as its heartbeats said, and what of it was merged, by the life its submission ids name; kept across a
restart of the syncer and united over shards."""

from __future__ import annotations

from diloco_trainer.protocol.messages import LIVES_KEPT, IncarnationWork
from diloco_trainer.runtime.shards import merge_lives
from diloco_trainer.syncer.lives import Lives, life_of
from polling import wait_for_async
from syncer_kit import AUTH, body, deltas_for, make_syncer, register_body, start, tiny_config


def test_a_submission_id_names_the_life_that_built_it_whatever_dots_the_learner_id_has():
    assert life_of("demo-cpu-0.0a1b2c3d.p3.v12", "demo-cpu-0") == "0a1b2c3d"
    assert life_of("a.dotted.id.ff00.p0.v1", "a.dotted.id") == "ff00"
    assert life_of("demo-cpu-0.sub-1", "demo-cpu-0") is None and life_of("other.ab.p0.v1", "demo-cpu-0") is None


async def test_each_life_of_a_learner_is_credited_with_its_own_merged_work_also_when_the_next_life_resends_it(
        aiohttp_client, tmp_path):
    cfg = tiny_config(quorum=1)
    syncer = make_syncer(tmp_path, cfg)
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    assert (await client.post("/v1/register", json=register_body("l0"), headers=AUTH)).status == 200

    async def beat(life: str, step: int, discarded: int = 0):
        r = await client.post("/v1/heartbeat", headers=AUTH, json={
            "learner_id": "l0", "step": step, "tokens": step * 512, "step_time_s": 0.1, "incarnation": life,
            "steps_discarded": discarded})
        assert r.status == 200

    async def merged(sid: str, p: int, c_steps: int):
        done = sum(st.outer_steps)
        r = await client.post(f"/v1/fragments/{p}/outer-gradient", headers=AUTH, data=body(
            st, p, deltas_for(st, p, seed=done), learner="l0", sid=sid, base=st.versions[p], c_steps=c_steps,
            c_tokens=c_steps * 512))
        assert r.status == 202
        await wait_for_async(lambda: sum(st.outer_steps) == done + 1, what=f"the merge of {sid}")

    await beat("aaaa", 6, discarded=1)
    await merged("l0.aaaa.p0.v0", 0, 4)
    await beat("bbbb", 2)  # the next life; it resends the first life's unsent work under the first life's id
    await merged("l0.aaaa.p1.v0", 1, 5)
    await merged("l0.bbbb.p0.v1", 0, 2)
    status = await (await client.get("/v1/status", headers=AUTH)).json()
    lives = [IncarnationWork.model_validate(w) for w in status["learners"]["l0"]["incarnations"]]
    assert [(w.id, w.steps, w.tokens, w.steps_discarded, w.steps_merged, w.tokens_merged) for w in lives] == [
        ("aaaa", 6, 3072, 1, 9, 9 * 512), ("bbbb", 2, 1024, 0, 2, 1024)]
    assert lives[0].first_seen <= lives[1].first_seen
    await client.close()  # the final checkpoint

    resumed = make_syncer(tmp_path, cfg).state
    assert [w.model_dump() for w in resumed.learners["l0"].lives.listed()] == [w.model_dump() for w in lives]


def test_only_the_last_lives_are_kept_and_shards_add_their_merged_work():
    kept = LIVES_KEPT
    lives = Lives()
    for i in range(kept + 2):
        lives.heartbeat(f"{i:x}", steps=10, tokens=100, steps_discarded=0, now=float(i))
    assert [w.id for w in lives.listed()] == [f"{i:x}" for i in range(2, kept + 2)]
    # A life's first sends may be merged before its first heartbeat: they count all the same.
    lives.merged("l0", "l0.ee.p1.v3", 3, 30, now=20.0)
    lives.heartbeat("ee", steps=4, tokens=40, steps_discarded=0, now=21.0)
    newest = lives.listed()[-1]
    assert (newest.id, newest.first_seen, newest.steps, newest.steps_merged, newest.tokens_merged) == \
        ("ee", 20.0, 4, 3, 30)
    lives.merged("l0", "l0.sub-1", 3, 30, now=22.0)  # an id of another form names no life
    assert [w.id for w in lives.listed()][-1] == "ee" and len(lives.listed()) == kept
    a = [IncarnationWork(id="1", first_seen=1.0, last_seen=5.0, steps=10, steps_merged=8, tokens_merged=80)]
    b = [IncarnationWork(id="1", first_seen=1.2, last_seen=6.0, steps=12, steps_merged=4, tokens_merged=40),
         IncarnationWork(id="2", first_seen=7.0, last_seen=8.0, steps=1)]
    both = merge_lives(a, b)
    assert [(w.id, w.first_seen, w.steps, w.steps_merged, w.tokens_merged) for w in both] == [
        ("1", 1.0, 12, 12, 120), ("2", 7.0, 1, 0, 0)]
