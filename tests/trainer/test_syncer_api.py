"""The syncer's HTTP API through aiohttp's test client: auth, bad inputs, idempotency, quorum, re-anchoring."""

import asyncio
import json

import pytest
import torch

from diloco_trainer.protocol.wire import decode_tensors
from polling import wait_for_async
from syncer_kit import (AUTH, assert_unchanged, body, deltas_for, first_outer_step, make_syncer, raw_body,
                        register_body, snapshot, start, tiny_config)

ENDPOINTS = [("POST", "/v1/register"), ("POST", "/v1/heartbeat"), ("POST", "/v1/fragments/0/outer-gradient"),
             ("GET", "/v1/fragments/0"), ("GET", "/v1/state"), ("GET", "/v1/versions"), ("GET", "/v1/status")]


async def register(client, learner: str):
    r = await client.post("/v1/register", json={"learner_id": learner, "unit": 0, "world_size": 1,
                                                "device": "cpu"}, headers=AUTH)
    assert r.status == 200
    return await r.json()


async def test_syncer_answers_401_without_the_right_token_on_every_v1_endpoint(aiohttp_client, tmp_path):
    syncer = make_syncer(tmp_path)
    client = await start(aiohttp_client, syncer)
    before = snapshot(syncer.state)
    for method, path in ENDPOINTS:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": AUTH["Authorization"] + "x"},
                        {"Authorization": "s3cret-token"}):
            r = await client.request(method, path, headers=headers, data=b"{}")
            assert r.status == 401, (method, path, headers)
            assert "token" in (await r.json())["error"]
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/metrics")).status == 200
    assert_unchanged(before, snapshot(syncer.state))
    assert syncer.state.learners == {}


async def test_register_hands_out_the_plan_config_and_versions(aiohttp_client, tmp_path):
    syncer = make_syncer(tmp_path)
    client = await start(aiohttp_client, syncer)
    reply = await register(client, "learner-a")
    assert reply["plan"] == {str(p): names for p, names in enumerate(syncer.state.plan)}
    assert reply["versions"] == {"0": 0, "1": 0}
    assert reply["config"]["model"]["d_model"] == 64 and reply["config"]["outer"]["fragments"] == 2
    assert reply["heartbeat_s"] == syncer.opt.heartbeat_s
    r = await client.post("/v1/heartbeat", json={"learner_id": "learner-a", "step": 7, "step_time_s": 0.05,
                                                 "tokens": 4096}, headers=AUTH)
    assert r.status == 200 and (await r.json()) == {"versions": {"0": 0, "1": 0}}
    status = await (await client.get("/v1/status", headers=AUTH)).json()
    me = status["learners"]["learner-a"]
    assert me["live"] is True and me["step"] == 7 and me["tokens"] == 4096 and me["tokens_merged"] == 0
    assert status["live_learners"] == 1 and status["pending"] == {"0": 0, "1": 0}
    assert syncer.state.policy.step_time.value == pytest.approx(0.05)
    assert reply["version_age_s"] == {} and reply["step_s"] is None  # nothing published, no step time yet
    # Once it published a version: a learner that registers is told how long ago, and the learners' step time.
    st = syncer.state
    r = await client.post("/v1/fragments/1/outer-gradient", data=body(st, 1, deltas_for(st, 1, seed=1)), headers=AUTH)
    assert r.status == 202
    await wait_for_async(lambda: st.versions[1] == 1, what="fragment 1 version 1")
    later = await register(client, "learner-b")
    assert set(later["version_age_s"]) == {"1"} and 0 <= later["version_age_s"]["1"] < 60
    assert later["step_s"] == pytest.approx(0.05)


@pytest.mark.parametrize("path,payload,reason", [
    ("/v1/register", b"not json", "not JSON"),
    ("/v1/register", b"[1, 2]", "JSON object"),
    ("/v1/register", json.dumps(register_body("../etc")).encode(), "learner_id"),
    ("/v1/register", json.dumps(register_body("a") | {"unit": -1}).encode(), "unit"),
    ("/v1/register", json.dumps(register_body("a") | {"world_size": 0}).encode(), "world_size"),
    ("/v1/register", json.dumps(register_body("a") | {"unit": True}).encode(), "unit"),
    ("/v1/register", json.dumps(register_body("a") | {"device": "x" * 65}).encode(), "device"),
    ("/v1/register", json.dumps({"learner_id": "a"}).encode(), "unit: field required"),  # was accepted before
    ("/v1/register", json.dumps({"learner_id": "a", "unit": 0, "device": "cpu"}).encode(), "world_size"),
    ("/v1/register", json.dumps({"learner_id": "a", "unit": 0, "world_size": 1}).encode(), "device"),
    ("/v1/heartbeat", json.dumps({"learner_id": "a", "step": "7", "tokens": 0}).encode(), "step"),
    ("/v1/heartbeat", json.dumps({"learner_id": "a", "step": 1, "tokens": 0, "step_time_s": -1}).encode(),
     "step_time_s"),
    ("/v1/heartbeat", json.dumps({"learner_id": "a", "step": 1}).encode(), "tokens"),
    ("/v1/register", b"[" * 5000 + b"]" * 5000, "nests"),  # found by an outside check: RecursionError, a 500
    ("/v1/heartbeat", b'{"a":' * 5000 + b"1" + b"}" * 5000, "nests"),
    # An integer literal over Python's 4300-digit limit: json.loads raises ValueError, was a 500 (fuzz test).
    ("/v1/register", b'{"learner_id": "a", "unit": ' + b"9" * 5000 + b"}", "usable JSON"),
])
async def test_bad_register_and_heartbeat_bodies_are_400_and_change_nothing(aiohttp_client, tmp_path, path,
                                                                            payload, reason):
    syncer = make_syncer(tmp_path)
    client = await start(aiohttp_client, syncer)
    r = await client.post(path, data=payload, headers=AUTH)
    assert r.status == 400
    assert reason in (await r.json())["error"]
    assert syncer.state.learners == {}


def _bad_submissions(state):
    """(name, url fragment, body, status, reason substring) for every kind of bad outer gradient."""
    d0 = deltas_for(state, 0, seed=1)
    good = body(state, 0, d0)
    name = state.plan[0][0]
    shapes = {n: list(t.shape) for n, t in d0.items()}
    meta = {"learner_id": "learner-a", "submission_id": "bad-1", "fragment": "0", "base_version": "0",
            "c_steps": "4", "c_tokens": "1024", "compression": "none", "block_size": "64",
            "shapes": json.dumps(shapes)}
    nan = dict(d0)
    nan[name] = d0[name].clone()
    nan[name][0] = float("nan")
    wrong_shape = dict(d0)
    wrong_shape[name] = torch.zeros(3, 5)
    missing = {n: t for n, t in d0.items() if n != name}
    extra = {**d0, state.plan[1][0]: torch.zeros(2)}  # small: a body over the fragment's size gets 413 unread
    return [
        ("unknown fragment", "7", good, 404, "unknown fragment"),
        ("fragment not a number", "x", good, 404, "unknown fragment"),
        ("fragment a superscript digit", "%C2%B2", good, 404, "unknown fragment"),  # was a 500 (fuzz test)
        ("fragment an Arabic-Indic digit", "%D9%A1", good, 404, "unknown fragment"),
        ("fragment of the url differs", "1", body(state, 1, deltas_for(state, 1, 2), fragment=0), 400,
         "does not match the URL"),
        ("not safetensors", "0", b"hello world, not a tensor file", 400, "safetensors"),
        ("truncated", "0", good[: len(good) // 2], 400, "safetensors"),
        ("empty", "0", b"", 400, "safetensors"),
        ("non-finite values", "0", raw_body(nan, meta), 400, "non-finite"),
        ("wrong shape", "0", raw_body(wrong_shape, {**meta, "shapes": json.dumps({**shapes, name: [3, 5]})}), 400,
         "does not match the expected"),
        ("tensor shape differs from metadata", "0", raw_body(wrong_shape, meta), 400, "does not match"),
        ("missing parameter", "0", raw_body(missing, {**meta, "shapes": json.dumps(
            {n: s for n, s in shapes.items() if n != name})}), 400, "missing"),
        ("unknown parameter", "0", raw_body(extra, {**meta, "shapes": json.dumps(
            {n: list(t.shape) for n, t in extra.items()})}), 400, "unknown parameters"),
        ("missing metadata", "0", raw_body(d0, {k: v for k, v in meta.items() if k != "base_version"}), 400,
         "base_version"),
        ("zero steps", "0", raw_body(d0, {**meta, "c_steps": "0"}), 400, "c_steps"),
        ("bad learner id", "0", raw_body(d0, {**meta, "learner_id": "../../x"}), 400, "learner_id"),
        ("base newer than current", "0", body(state, 0, d0, base=5), 400, "newer than the current"),
    ]


async def test_every_bad_submission_gets_its_4xx_and_changes_no_state(aiohttp_client, tmp_path):
    syncer = make_syncer(tmp_path)
    client = await start(aiohttp_client, syncer)
    await register(client, "learner-a")
    before = snapshot(syncer.state)
    for name, frag, payload, status, reason in _bad_submissions(syncer.state):
        r = await client.post(f"/v1/fragments/{frag}/outer-gradient", data=payload, headers=AUTH)
        assert r.status == status, name
        assert reason in (await r.json())["error"], name
    await asyncio.sleep(0.05)  # give a (wrongly) woken merge loop the chance to run
    assert_unchanged(before, snapshot(syncer.state))
    metrics = (await (await client.get("/metrics")).read()).decode()
    assert 'diloco_syncer_submissions_rejected_total{reason="malformed"}' in metrics
    assert 'diloco_syncer_submissions_rejected_total{reason="unknown_fragment"} 4.0' in metrics


async def test_a_body_over_the_size_limit_is_413_and_changes_nothing(aiohttp_client, tmp_path):
    syncer = make_syncer(tmp_path, max_body_bytes=4096)
    client = await start(aiohttp_client, syncer)
    before = snapshot(syncer.state)
    payload = body(syncer.state, 0, deltas_for(syncer.state, 0, seed=1))
    assert len(payload) > 4096
    r = await client.post("/v1/fragments/0/outer-gradient", data=payload, headers=AUTH)
    assert r.status == 413 and "too large" in (await r.json())["error"]

    async def chunks():  # no Content-Length: the limit must hold while reading, too
        for i in range(0, len(payload), 1000):
            yield payload[i:i + 1000]

    r = await client.post("/v1/fragments/0/outer-gradient", data=chunks(), headers=AUTH)
    assert r.status == 413 and "too large" in (await r.json())["error"]
    assert_unchanged(before, snapshot(syncer.state))


async def test_quorum_one_merges_at_once_and_publishes_a_new_version(aiohttp_client, tmp_path):
    cfg = tiny_config(quorum=1)
    # A liveness window far longer than the test: the live-learners gauge below must not depend on the load.
    syncer = make_syncer(tmp_path, cfg, live_after_missed=1800.0)
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    theta0 = st.fragment(0)
    d = deltas_for(st, 0, seed=1)
    r = await client.post("/v1/fragments/0/outer-gradient", data=body(st, 0, d), headers=AUTH)
    assert r.status == 202
    assert (await r.json()) == {"accepted": True, "duplicate": False, "pending": 1}
    await wait_for_async(lambda: st.versions[0] == 1, what="fragment 0 version 1")
    assert st.versions[1] == 0 and st.pending[0] == {}
    # One contribution: RDA and the weighted mean both return Δ itself; then one Nesterov step.
    for n in st.plan[0]:
        want = first_outer_step(theta0[n], d[n], cfg.outer.lr, cfg.outer.momentum)
        torch.testing.assert_close(st.theta[n], want, rtol=1e-5, atol=1e-6)
    r = await client.get("/v1/fragments/0", headers=AUTH)
    tensors, meta = decode_tensors(await r.read())
    assert meta == {"fragment": "0", "version": "1", "dtype": "fp32", "encoding": "full"}
    assert set(tensors) == set(st.plan[0])
    assert all(torch.equal(tensors[n], st.theta[n]) for n in tensors)
    # The bf16 down-link (outer.downlink): the same version rounded, in half the bytes; anything else is a 400.
    r16 = await client.get("/v1/fragments/0?dtype=bf16", headers=AUTH)
    halves, meta16 = decode_tensors(body16 := await r16.read())
    assert meta16["dtype"] == "bf16" and meta16["version"] == "1"
    assert all(halves[n].dtype == torch.bfloat16 and torch.equal(halves[n], st.theta[n].bfloat16()) for n in halves)
    assert len(body16) < 0.6 * int(r.headers["Content-Length"])
    bad = await client.get("/v1/fragments/0?dtype=int4", headers=AUTH)
    assert bad.status == 400 and "dtype" in (await bad.json())["error"]
    assert (await client.get("/v1/fragments/0?after=1", headers=AUTH)).status == 304
    assert (await client.get("/v1/fragments/0?after=0", headers=AUTH)).status == 200
    assert (await client.get("/v1/fragments/0?after=zero", headers=AUTH)).status == 400
    full, meta = decode_tensors(await (await client.get("/v1/state", headers=AUTH)).read())
    assert json.loads(meta["versions"]) == {"0": 1, "1": 0} and set(full) == set(st.theta)
    versions = await (await client.get("/v1/versions", headers=AUTH)).json()
    assert versions == {"versions": {"0": 1, "1": 0}, "outer_steps": 1, "tokens_merged": 1024}
    status = await (await client.get("/v1/status", headers=AUTH)).json()
    assert status["learners"]["learner-a"]["tokens_merged"] == 1024
    assert status["learners"]["learner-a"]["submissions_merged"] == 1 and status["merges"] == 1
    metrics = (await (await client.get("/metrics")).read()).decode()
    for line in ('diloco_syncer_outer_steps_total{fragment="0"} 1.0', "diloco_syncer_tokens_merged_total 1024.0",
                 "diloco_syncer_contributions_per_merge_count 1.0", "diloco_syncer_live_learners 1.0",
                 "diloco_syncer_quorum 1.0",
                 'diloco_syncer_staleness_versions_bucket{le="0.0"} 1.0', 'diloco_syncer_fragment_version{fragment="0"} 1.0'):
        assert line in metrics, line


async def test_quorum_two_waits_for_a_second_live_learner(aiohttp_client, tmp_path):
    cfg = tiny_config(quorum=2)
    syncer = make_syncer(tmp_path, cfg)
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    await register(client, "learner-a")
    await register(client, "learner-b")
    theta0 = st.fragment(0)
    da, db = deltas_for(st, 0, seed=1), deltas_for(st, 0, seed=2)
    r = await client.post("/v1/fragments/0/outer-gradient", data=body(st, 0, da, learner="learner-a", sid="a1",
                                                                        c_tokens=1024), headers=AUTH)
    assert r.status == 202
    await asyncio.sleep(0.3)
    assert st.versions[0] == 0 and len(st.pending[0]) == 1, "K=2 must not merge one learner's contribution"
    r = await client.post("/v1/fragments/0/outer-gradient", data=body(st, 0, db, learner="learner-b", sid="b1",
                                                                        c_tokens=512), headers=AUTH)
    assert r.status == 202
    await wait_for_async(lambda: st.versions[0] == 1, what="the merge of two contributions")
    # Token weights c_tokens²/c_steps: a weighs 4x b. Embeddings by weighted mean, others by RDA.
    wa, wb = 1024 ** 2 / 4, 512 ** 2 / 4
    for n in st.plan[0]:
        if n in st.embeddings:
            merged = (wa * da[n] + wb * db[n]) / (wa + wb)
        else:
            radius = (wa * da[n].norm() + wb * db[n].norm()) / (wa + wb)
            direction = wa * da[n] / da[n].norm() + wb * db[n] / db[n].norm()
            merged = radius * direction / direction.norm()
        want = first_outer_step(theta0[n], merged, cfg.outer.lr, cfg.outer.momentum)
        torch.testing.assert_close(st.theta[n], want, rtol=1e-5, atol=1e-6)
    assert st.learners["learner-a"].tokens_merged == 1024 and st.learners["learner-b"].tokens_merged == 512
    metrics = (await (await client.get("/metrics")).read()).decode()
    assert "diloco_syncer_quorum 2.0" in metrics and "diloco_syncer_contributions_per_merge_sum 2.0" in metrics


async def test_a_retried_submission_is_acknowledged_again_but_merged_once(aiohttp_client, tmp_path):
    syncer = make_syncer(tmp_path, tiny_config(quorum=2))
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    await register(client, "learner-a")
    await register(client, "learner-b")
    payload = body(st, 0, deltas_for(st, 0, seed=1), sid="retry-me")
    first = await client.post("/v1/fragments/0/outer-gradient", data=payload, headers=AUTH)
    assert (await first.json()) == {"accepted": True, "duplicate": False, "pending": 1}
    before = snapshot(st)
    again = await client.post("/v1/fragments/0/outer-gradient", data=payload, headers=AUTH)
    assert again.status == 202 and (await again.json()) == {"accepted": True, "duplicate": True, "pending": 1}
    assert_unchanged(before, snapshot(st))
    # Concurrent retries of a fresh id: exactly one is new.
    other = body(st, 0, deltas_for(st, 0, seed=5), learner="learner-b", sid="twice")
    replies = await asyncio.gather(*(client.post("/v1/fragments/0/outer-gradient", data=other, headers=AUTH)
                                     for _ in range(3)))
    assert sorted([(await r.json())["duplicate"] for r in replies]) == [False, True, True]
    await wait_for_async(lambda: st.versions[0] == 1, what="the merge")
    merged = snapshot(st)
    # After the merge the base is stale, yet a retry is still recognised (before any base check).
    late = await client.post("/v1/fragments/0/outer-gradient", data=payload, headers=AUTH)
    assert late.status == 202 and (await late.json())["duplicate"] is True
    await asyncio.sleep(0.1)
    assert_unchanged(merged, snapshot(st))
    assert st.tokens_merged == 2048 and st.contributions_merged == 2


async def test_a_stale_but_kept_base_is_reanchored_to_the_current_version_and_given_its_share(aiohttp_client,
                                                                                                 tmp_path):
    cfg = tiny_config(quorum=1)
    syncer = make_syncer(tmp_path, cfg)
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    lr, mu = cfg.outer.lr, cfg.outer.momentum
    theta0 = st.fragment(0)
    theta0_values = {n: t.clone() for n, t in theta0.items()}
    d1, d2 = deltas_for(st, 0, seed=1), deltas_for(st, 0, seed=2)
    await client.post("/v1/fragments/0/outer-gradient", data=body(st, 0, d1, sid="s1"), headers=AUTH)
    await wait_for_async(lambda: st.versions[0] == 1)
    theta1 = st.fragment(0)
    # learner-b trained from version 0 and reports it: θ_b = Θ0 − Δ2; against Θ1 that is Δ' = Θ1 − θ_b, applied with
    # its share of the weight merged since its base (outer.late_share): its own over its own and s1's, equal, so 1/2.
    r = await client.post("/v1/fragments/0/outer-gradient",
                          data=body(st, 0, d2, learner="learner-b", sid="s2", base=0), headers=AUTH)
    assert r.status == 202
    await wait_for_async(lambda: st.versions[0] == 2)
    for n in st.plan[0]:
        d_prime = 0.5 * (theta1[n] - (theta0[n] - d2[n]))
        buf = mu * d1[n] + d_prime
        torch.testing.assert_close(st.theta[n], theta1[n] - lr * (d_prime + mu * buf), rtol=1e-5, atol=1e-6)
        assert torch.equal(theta0[n], theta0_values[n]), "a merge never writes into a published version"
    metrics = (await (await client.get("/metrics")).read()).decode()
    assert 'diloco_syncer_staleness_versions_bucket{le="0.0"} 1.0' in metrics  # s1: base was current
    assert 'diloco_syncer_staleness_versions_bucket{le="1.0"} 2.0' in metrics  # s2: one version behind


async def test_a_rider_is_applied_to_the_current_version_as_it_is_and_joins_the_next_merge(aiohttp_client, tmp_path):
    """A restarted learner's resend of its predecessor's work (SubmissionMeta.resend), from a base others moved on:
    no merge of its own; the next live Δ's merge takes it as Δ itself (not Θ1 − θ_b); a retry of its id is a
    duplicate; a base no longer kept is 409 as for any Δ."""
    cfg = tiny_config(quorum=1, versions_kept=2, merge="mean")
    syncer = make_syncer(tmp_path, cfg)
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    lr, mu = cfg.outer.lr, cfg.outer.momentum
    d1, d2, d3 = (deltas_for(st, 0, seed=s) for s in (1, 2, 3))
    await client.post("/v1/fragments/0/outer-gradient", data=body(st, 0, d1, sid="s1"), headers=AUTH)
    await wait_for_async(lambda: st.versions[0] == 1)
    theta1 = st.fragment(0)
    resend = body(st, 0, d2, learner="learner-b", sid="s2", base=0, rider=True)
    r = await client.post("/v1/fragments/0/outer-gradient", data=resend, headers=AUTH)
    assert r.status == 202 and (await r.json())["pending"] == 1
    own = await client.post("/v1/fragments/0/outer-gradient",
                            data=body(st, 0, d3, learner="learner-b", sid="s2b", base=1), headers=AUTH)
    assert own.status == 202, "a learner's rider does not hold its own next Δ back (no 429)"
    await wait_for_async(lambda: st.versions[0] == 2)
    assert st.contributions_merged == 3
    for n in st.plan[0]:
        merged = (d2[n] + d3[n]) / 2  # equal token weights
        buf = mu * d1[n] + merged
        torch.testing.assert_close(st.theta[n], theta1[n] - lr * (merged + mu * buf), rtol=1e-5, atol=1e-6)
    merged_state = snapshot(st)
    again = await client.post("/v1/fragments/0/outer-gradient", data=resend, headers=AUTH)
    assert again.status == 202 and (await again.json())["duplicate"] is True
    assert_unchanged(merged_state, snapshot(st))
    metrics = (await (await client.get("/metrics")).read()).decode()
    assert 'diloco_syncer_staleness_versions_bucket{le="0.0"} 3.0' in metrics, "taken as built from the current one"
    assert "diloco_syncer_riders_accepted_total 1.0" in metrics
    assert 'diloco_syncer_riders_merged_total{alone="false"} 1.0' in metrics
    status = await (await client.get("/v1/status", headers=AUTH)).json()
    assert status["riders_merged"] == {"with_others": 1}
    await client.post("/v1/fragments/0/outer-gradient", data=body(st, 0, d1, sid="s3", base=2), headers=AUTH)
    await wait_for_async(lambda: st.versions[0] == 3)  # versions 2 and 3 kept: 0 is gone
    before = snapshot(st)
    r = await client.post("/v1/fragments/0/outer-gradient",
                          data=body(st, 0, d2, learner="learner-b", sid="s4", base=0, rider=True), headers=AUTH)
    assert r.status == 409 and "older than the versions kept" in (await r.json())["error"]
    assert_unchanged(before, snapshot(st))


async def test_a_rider_alone_merges_once_no_other_merge_came_within_its_wait(aiohttp_client, tmp_path):
    syncer = make_syncer(tmp_path, tiny_config(quorum=1))
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    st.rider_wait_s = lambda: 0.5
    await register(client, "learner-a")
    await register(client, "learner-b")  # alive, and may send fragment 0 any moment
    r = await client.post("/v1/fragments/0/outer-gradient",
                          data=body(st, 0, deltas_for(st, 0, seed=1), sid="s1", rider=True), headers=AUTH)
    assert r.status == 202
    await asyncio.sleep(0.2)
    assert st.versions[0] == 0, "a rider alone waits for the fragment's next merge"
    await wait_for_async(lambda: st.versions[0] == 1, timeout=5, what="the rider merged after its wait")
    status = await (await client.get("/v1/status", headers=AUTH)).json()
    assert status["riders_merged"] == {"alone": 1}


async def test_a_rider_merges_at_once_when_every_live_learner_has_one_pending(aiohttp_client, tmp_path):
    """A lone learner restarted (or all of them): nobody else will make the merge its riders wait for."""
    syncer = make_syncer(tmp_path, tiny_config(quorum=2))
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    await register(client, "learner-a")
    r = await client.post("/v1/fragments/0/outer-gradient",
                          data=body(st, 0, deltas_for(st, 0, seed=1), sid="s1", rider=True), headers=AUTH)
    assert r.status == 202
    await wait_for_async(lambda: st.versions[0] == 1, timeout=2, what="the lone learner's rider merged")


async def test_a_base_older_than_the_versions_kept_is_409_and_changes_nothing(aiohttp_client, tmp_path):
    syncer = make_syncer(tmp_path, tiny_config(quorum=1, versions_kept=2))
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    for v in range(3):
        r = await client.post("/v1/fragments/0/outer-gradient",
                              data=body(st, 0, deltas_for(st, 0, seed=v), sid=f"s{v}", base=v), headers=AUTH)
        assert r.status == 202
        await wait_for_async(lambda: st.versions[0] == v + 1)
    before = snapshot(st)
    r = await client.post("/v1/fragments/0/outer-gradient",
                          data=body(st, 0, deltas_for(st, 0, seed=9), sid="old", base=0), headers=AUTH)
    assert r.status == 409
    assert "older than the versions kept (2..3)" in (await r.json())["error"]
    assert_unchanged(before, snapshot(st))
    r = await client.post("/v1/fragments/0/outer-gradient",
                          data=body(st, 0, deltas_for(st, 0, seed=9), sid="kept", base=2), headers=AUTH)
    assert r.status == 202


async def test_a_restarted_learners_second_contribution_waits_with_429_until_its_first_is_merged(aiohttp_client,
                                                                                                  tmp_path):
    """One pending submission per (learner, fragment): a learner that restarted (a new id) before its first one was
    merged is told 429 (its client retries), the first stays acknowledged, and the retry is taken after the merge."""
    syncer = make_syncer(tmp_path, tiny_config(quorum=2))
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    await register(client, "learner-a")
    await register(client, "learner-b")
    after_restart = body(st, 0, deltas_for(st, 0, seed=2), sid="a-after-restart")
    r = await client.post("/v1/fragments/0/outer-gradient",
                          data=body(st, 0, deltas_for(st, 0, seed=1), sid="a-before-crash"), headers=AUTH)
    assert r.status == 202
    r = await client.post("/v1/fragments/0/outer-gradient", data=after_restart, headers=AUTH)
    assert r.status == 429 and "already has a submission pending for fragment 0" in (await r.json())["error"]
    assert st.versions[0] == 0 and list(st.pending[0]) == ["a-before-crash"]
    r = await client.post("/v1/fragments/0/outer-gradient",
                          data=body(st, 0, deltas_for(st, 0, seed=3), learner="learner-b", sid="b"), headers=AUTH)
    await wait_for_async(lambda: st.versions[0] == 1)
    r = await client.post("/v1/fragments/0/outer-gradient", data=after_restart, headers=AUTH)
    assert r.status == 202 and list(st.pending[0]) == ["a-after-restart"]
    assert st.learners["learner-a"].submissions_merged == 1 and st.contributions_merged == 2
    assert syncer.metrics.rejected.labels("pending_limit")._value.get() == 1


async def test_a_dead_learner_does_not_hold_up_a_quorum_of_two(aiohttp_client, tmp_path):
    syncer = make_syncer(tmp_path, tiny_config(quorum=2), heartbeat_s=0.1)  # live = seen within 0.3 s
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    await register(client, "learner-a")
    await register(client, "learner-b")  # then never heard from again
    await client.post("/v1/fragments/0/outer-gradient", data=body(st, 0, deltas_for(st, 0, seed=1)), headers=AUTH)
    assert st.versions[0] == 0
    await wait_for_async(lambda: st.versions[0] == 1, timeout=3.0, what="merge once learner-b is no longer live")
    status = await (await client.get("/v1/status", headers=AUTH)).json()
    assert status["learners"]["learner-b"]["live"] is False


async def test_a_contribution_in_the_grace_window_joins_the_merge_and_the_window_then_closes(aiohttp_client,
                                                                                              tmp_path):
    syncer = make_syncer(tmp_path, tiny_config(quorum=1, grace=0.5, overlap=2))
    client = await start(aiohttp_client, syncer)
    st = syncer.state
    await register(client, "learner-a")
    await register(client, "learner-b")
    st.policy.load_state_dict({"step_time": 1.0, "quorum_time": 0.0, "sync_time": 0.0})
    assert st.policy.grace_seconds() == pytest.approx(1.0)  # 0.5 · (2 · 1.0 − 0)
    await client.post("/v1/fragments/0/outer-gradient", data=body(st, 0, deltas_for(st, 0, 1), sid="a0"),
                      headers=AUTH)
    await asyncio.sleep(0.2)
    assert st.versions[0] == 0, "K=1 reached, but the grace window is open for the other live learner"
    await client.post("/v1/fragments/0/outer-gradient",
                      data=body(st, 0, deltas_for(st, 0, 2), learner="learner-b", sid="b0"), headers=AUTH)
    await wait_for_async(lambda: st.versions[0] == 1, timeout=0.5, what="a merge as soon as every live learner is in")
    assert st.contributions_merged == 2
    # Nobody else comes for fragment 1: the merge waits out the window, then goes ahead with one contribution.
    await client.post("/v1/fragments/1/outer-gradient", data=body(st, 1, deltas_for(st, 1, 1), sid="a1"),
                      headers=AUTH)
    t0 = asyncio.get_running_loop().time()
    await wait_for_async(lambda: st.versions[1] == 1, timeout=3.0)
    waited = asyncio.get_running_loop().time() - t0
    assert 0.5 < waited < 2.0, waited
    status = await (await client.get("/v1/status", headers=AUTH)).json()
    assert status["grace_s"] == pytest.approx(st.policy.grace_seconds()) and status["grace_s"] > 0


async def _raw_request(client, head: bytes, parts: list[bytes], pause_s: float = 0.2) -> tuple[int, bytes]:
    """Send `head` then each of `parts` as its own TCP write, `pause_s` apart; the status and body of the answer."""
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    try:
        writer.write(head)
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(pause_s)
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


@pytest.mark.parametrize("path, document", [
    ("/v1/register", {"learner_id": "learner-a", "unit": 0, "world_size": 1, "device": "cpu"}),
    ("/v1/heartbeat", {"learner_id": "learner-a", "step": 3, "step_time_s": 0.1, "tokens": 512}),
])
async def test_a_register_or_heartbeat_body_split_over_two_tcp_writes_is_read_whole(aiohttp_client, tmp_path, path,
                                                                                     document):
    syncer = make_syncer(tmp_path)
    client = await start(aiohttp_client, syncer)
    data = json.dumps(document).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: syncer\r\nAuthorization: {AUTH['Authorization']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    status, answer = await _raw_request(client, head, [data[:10], data[10:]])
    assert status == 200, answer
    assert "versions" in json.loads(answer)
    assert "learner-a" in syncer.state.learners


async def test_a_non_utf8_authorization_header_is_401_not_a_server_error(aiohttp_client, tmp_path):
    syncer = make_syncer(tmp_path)
    client = await start(aiohttp_client, syncer)
    for value in (b"Bearer \xff\xfe", b"\xc3\x28", b"Bearer learner-a.\xe9"):
        head = (b"GET /v1/status HTTP/1.1\r\nHost: syncer\r\nAuthorization: " + value +
                b"\r\nConnection: close\r\n\r\n")
        status, answer = await _raw_request(client, head, [], 0)
        assert status == 401, (value, answer)
        assert "token" in json.loads(answer)["error"]
