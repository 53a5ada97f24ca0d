"""A syncer's refusal (exit 2, termination message) read back from its pod as the job's InvalidSpec."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from diloco_operator.objects import builders as O
from diloco_operator.plan.refusal import MESSAGE_PREFIX, RETRY_AFTER_S, name_the_field, refusal_of, still_refused

pytestmark = pytest.mark.fast
NOW = datetime(2026, 11, 25, 12, 0, tzinfo=timezone.utc)
REASON = "outer.fragments (64) must not exceed the model's 12 parameter tensors"


def syncer_pod(terminated: dict | None = None, *, last: bool = False, config: str = "abc", image: str = "img:1",
               deleting: bool = False) -> dict:
    status = {"name": "syncer", "restartCount": 1 if last else 0, "state": {"running": {}}}
    if terminated is not None:
        status["lastState" if last else "state"] = {"terminated": terminated}
    meta = {"name": "j-syncer-x", "annotations": {O.ANNOTATION_CONFIG_HASH: config}}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-25T12:00:00Z"
    return {"metadata": meta, "spec": {"containers": [{"name": "syncer", "image": image}]},
            "status": {"containerStatuses": [status]}}


def refused(message: str = MESSAGE_PREFIX + REASON) -> dict:
    return {"exitCode": 2, "message": message, "reason": "Error"}


def test_a_refusal_names_the_field_under_spec_config():
    assert refusal_of([syncer_pod(refused())], "abc", "img:1") == "spec.config." + REASON


def test_a_crash_looping_syncer_is_read_from_its_last_state_as_a_kubelet_reports_it():
    assert refusal_of([syncer_pod(refused(), last=True)], "abc", "img:1") == "spec.config." + REASON


@pytest.mark.parametrize("ended", [
    {"exitCode": 1, "message": MESSAGE_PREFIX + REASON},  # a crash is not a refusal
    {"exitCode": 137, "reason": "OOMKilled"},
    {"exitCode": 2, "message": "python: can't open file"},  # exit 2 of something else
])
def test_other_exits_are_not_refusals(ended):
    assert refusal_of([syncer_pod(ended)], "abc", "img:1") is None


def test_a_pod_of_another_config_or_image_or_on_its_way_out_is_not_this_specs_refusal():
    assert refusal_of([syncer_pod(refused(), config="old")], "abc", "img:1") is None
    assert refusal_of([syncer_pod(refused(), image="img:0")], "abc", "img:1") is None
    assert refusal_of([syncer_pod(refused(), deleting=True)], "abc", "img:1") is None
    assert refusal_of([syncer_pod(None)], "abc", "img:1") is None


def test_messages_that_do_not_start_with_a_config_field_are_kept_as_they_are():
    assert name_the_field("the checkpoint belongs to another model") == "the checkpoint belongs to another model"
    assert name_the_field("model.hf.num_key_value_heads: 3 does not divide") == \
        "spec.config.model.hf.num_key_value_heads: 3 does not divide"
    assert name_the_field("outer (no dot) is not a field path") == "outer (no dot) is not a field path"


def test_a_recorded_refusal_holds_for_its_generation_until_the_retry():
    at = (NOW - timedelta(seconds=10)).strftime("%Y-%m-%dT%H:%M:%SZ")
    recorded = {"generation": 3, "message": REASON, "at": at}
    assert still_refused(recorded, 3, NOW)
    assert not still_refused(recorded, 4, NOW), "an edit of the spec tries again at once"
    assert not still_refused(recorded, 3, NOW + timedelta(seconds=RETRY_AFTER_S)), "and so does the retry"
    assert not still_refused(None, 3, NOW) and not still_refused({"generation": 3, "at": "junk"}, 3, NOW)
