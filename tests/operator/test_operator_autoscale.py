"""The autoscaler's pure decisions (spec.autoscaling): preference order, parking units that cannot be placed,
retry with backoff or when capacity appears, cooldowns, minUnits, and free accelerator capacity on nodes."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from diloco_operator.api import conditions as C
from diloco_operator.api import models as api
from diloco_operator.plan.autoscale import UnitState, decide, free_units

T0 = datetime(2026, 11, 24, 12, 0, 0, tzinfo=timezone.utc)
GPU_TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def spec(min_units=1, max_units=4, replicas=None, **autoscaling) -> api.DilocoJobSpec:
    units = [{"name": "h100", "count": 0, "maxCount": 2, "accelerator": {"type": "nvidia-h100-80gb", "count": 8}},
             {"name": "l4", "count": 0, "maxCount": 4, "accelerator": {"type": "nvidia-l4", "count": 8}},
             {"name": "tpu", "count": 0, "maxCount": 4, "podsPerUnit": 2,
              "accelerator": {"type": "tpu-v5p-slice", "count": 4, "topology": "2x2x2"}}]
    a = {"minUnits": min_units, "maxUnits": max_units, "preference": ["h100", "l4", "tpu"],
         "provisioningTimeoutSeconds": 60, "retryBackoffSeconds": 100, "maxRetryBackoffSeconds": 300,
         "scaleUpCooldownSeconds": 0, "scaleDownCooldownSeconds": 0, **autoscaling}
    return api.DilocoJobSpec.model_validate({"image": "img", "units": units, "replicas": replicas, "autoscaling": a})


def unit(template: str, index: int, running=True, stuck_since: datetime | None = None) -> UnitState:
    return UnitState(f"j-{template}-{index}", template, index, running, stuck_since, "0/2 nodes are available")


def test_units_fill_the_preferred_template_first_then_fall_back_in_order():
    d = decide(spec(max_units=5), [], {}, None, T0)
    assert d.counts == {"h100": 2, "l4": 3, "tpu": 0}
    assert d.status["targetUnits"] == 5 and d.status["desiredUnits"] == 5


def test_kubectl_scale_or_an_hpa_sets_the_target_within_min_and_max_units():
    assert sum(decide(spec(max_units=4, replicas=3), [], {}, None, T0).counts.values()) == 3
    assert sum(decide(spec(min_units=2, max_units=4, replicas=9), [], {}, None, T0).counts.values()) == 4


def test_units_unschedulable_past_the_provisioning_timeout_are_parked_and_their_share_falls_back():
    s = spec(max_units=2, preference=["h100", "l4"])
    units = [unit("h100", 0, running=False, stuck_since=T0), unit("h100", 1, running=False, stuck_since=T0)]
    early = decide(s, units, {}, None, T0 + timedelta(seconds=30))
    assert early.park == [] and early.counts["h100"] == 2, "pods get time to trigger node provisioning"
    assert early.requeue_after is not None and early.requeue_after <= 31
    d = decide(s, units, {}, early.status, T0 + timedelta(seconds=61))
    assert sorted(d.park) == ["j-h100-0", "j-h100-1"]
    assert d.counts == {"h100": 0, "l4": 2, "tpu": 0}
    h100 = next(t for t in d.status["templates"] if t["name"] == "h100")
    assert h100["retryAt"] == C.now_iso(T0 + timedelta(seconds=161)) and "unschedulable" in h100["reason"]
    assert [p["name"] for p in d.status["parkedUnits"]] == ["j-h100-1", "j-h100-0"]
    assert {e[1] for e in d.events} == {C.Reason.UNITS_PARKED, C.Reason.SCALED_UP}


def test_a_parked_template_is_retried_after_a_doubling_backoff_or_at_once_when_capacity_appears():
    s = spec(max_units=3)
    parked = {"templates": [{"name": "h100", "retryAt": C.now_iso(T0 + timedelta(seconds=100)), "parkCount": 1,
                             "freeUnits": 0, "reason": "x"}]}
    running_l4 = [unit("l4", i) for i in range(2)]
    d = decide(s, running_l4, {"h100": 0}, parked, T0 + timedelta(seconds=50))
    assert d.counts["h100"] == 0 and d.counts["l4"] == 3
    d = decide(s, running_l4, {"h100": 1}, parked, T0 + timedelta(seconds=50))
    assert d.counts["h100"] == 1 and C.Reason.CAPACITY_APPEARED in {e[1] for e in d.events}
    d = decide(s, running_l4, {"h100": 0}, parked, T0 + timedelta(seconds=101))
    assert d.counts["h100"] == 1 and C.Reason.RETRYING_TEMPLATE in {e[1] for e in d.events}
    # Parked again: the backoff doubles (100 s -> 200 s).
    again = decide(s, running_l4 + [unit("h100", 0, running=False, stuck_since=T0)], {"h100": 0},
                   {"templates": [{"name": "h100", "parkCount": 1}]}, T0 + timedelta(seconds=200))
    h100 = next(t for t in again.status["templates"] if t["name"] == "h100")
    assert again.park == ["j-h100-0"] and h100["parkCount"] == 2
    assert h100["retryAt"] == C.now_iso(T0 + timedelta(seconds=400))


def test_running_units_are_never_removed_to_make_room_for_a_preferred_template():
    s = spec(max_units=3)
    units = [unit("l4", 0), unit("l4", 1), unit("tpu", 0)]
    d = decide(s, units, {"h100": 2}, None, T0)
    assert d.counts == {"h100": 0, "l4": 2, "tpu": 1} and d.park == []


def test_parking_never_takes_the_job_below_min_units():
    s = spec(min_units=2, max_units=2, preference=["h100"])
    s.units[1].maxCount = 0
    s.units[2].maxCount = 0
    units = [unit("h100", 0), unit("h100", 1, running=False, stuck_since=T0)]
    d = decide(s, units, {}, None, T0 + timedelta(seconds=600))
    assert d.park == [] and d.counts["h100"] == 2, "no other template can take it: it keeps waiting"


def test_a_lower_target_removes_units_from_the_least_preferred_template_first():
    s = spec(max_units=4, replicas=2)
    d = decide(s, [unit("h100", 0), unit("l4", 0), unit("tpu", 0), unit("tpu", 1)], {}, None, T0)
    assert d.counts == {"h100": 1, "l4": 1, "tpu": 0}
    assert C.Reason.SCALED_DOWN in {e[1] for e in d.events}


def test_a_scale_up_cooldown_spaces_scale_ups_and_says_so():
    s = spec(max_units=3, scaleUpCooldownSeconds=60)
    old = {"lastScaleUpTime": C.now_iso(T0)}
    d = decide(s, [unit("h100", 0)], {}, old, T0 + timedelta(seconds=10))
    assert sum(d.counts.values()) == 1 and d.limited[:2] == (True, C.Reason.COOLDOWN)
    assert 50 <= d.requeue_after <= 51
    d = decide(s, [unit("h100", 0)], {}, old, T0 + timedelta(seconds=61))
    assert sum(d.counts.values()) == 3 and d.limited[1] == C.Reason.TARGET_MET


def node(name: str, gpus: int, accel="nvidia-h100-80gb", taints=(), ready=True, cordoned=False) -> dict:
    return {"metadata": {"name": name, "labels": {"cloud.google.com/gke-accelerator": accel}},
            "spec": {"taints": list(taints), "unschedulable": cordoned},
            "status": {"allocatable": {"nvidia.com/gpu": str(gpus)},
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_free_units_count_only_ready_matching_uncordoned_tolerated_nodes_minus_what_learners_use():
    t = spec().units[0]  # h100, 8 GPUs per pod
    gpu_taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    nodes = [node("a", 8, taints=[gpu_taint]), node("b", 16), node("c", 8, accel="nvidia-l4"),
             node("d", 8, ready=False), node("e", 8, cordoned=True),
             node("f", 8, taints=[{"key": "cloud.google.com/gke-spot", "value": "preempted", "effect": "NoExecute"}])]
    assert free_units(t, GPU_TOLERATIONS, nodes, {}) == 3
    assert free_units(t, GPU_TOLERATIONS, nodes, {"b": 8}) == 2
    assert free_units(spec().units[0].model_copy(update={"accelerator": api.Accelerator()}), [], nodes, {}) is None


def test_the_models_refuse_an_autoscaling_spec_that_contradicts_itself():
    import pytest
    from pydantic import ValidationError
    with pytest.raises(ValidationError, match="minUnits"):
        spec(min_units=5, max_units=2)
    with pytest.raises(ValidationError, match="preference names unknown templates"):
        spec(preference=["a100"])


def test_a_template_that_was_parked_grows_only_by_the_room_seen_on_its_nodes():
    s = spec(max_units=4)
    parked = {"templates": [{"name": "h100", "retryAt": C.now_iso(T0 + timedelta(seconds=100)), "parkCount": 1,
                             "freeUnits": 0}]}
    d = decide(s, [unit("l4", 0), unit("l4", 1)], {"h100": 1}, parked, T0 + timedelta(seconds=10))
    assert d.counts == {"h100": 1, "l4": 3, "tpu": 0}, "one unit where one fits; the rest falls back"


def test_room_already_promised_to_a_waiting_unit_is_not_given_twice():
    s = spec(max_units=4)
    parked = {"templates": [{"name": "h100", "parkCount": 1, "freeUnits": 1}]}
    waiting = UnitState("j-h100-0", "h100", 0, running=False)
    d = decide(s, [waiting, unit("l4", 0)], {"h100": 1}, parked, T0)
    assert d.counts["h100"] == 1


def test_room_a_unit_of_the_job_is_about_to_take_does_not_count_as_capacity_appearing():
    s = spec(max_units=3)
    parked = {"templates": [{"name": "h100", "retryAt": C.now_iso(T0 + timedelta(seconds=100)), "parkCount": 1,
                             "freeUnits": 0}]}
    not_yet_placed = UnitState("j-h100-0", "h100", 0, running=False)
    d = decide(s, [not_yet_placed], {"h100": 1}, parked, T0)
    assert C.Reason.CAPACITY_APPEARED not in {e[1] for e in d.events}
