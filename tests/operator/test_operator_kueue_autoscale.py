"""spec.autoscaling under Kueue, the pure decisions (autoscale.py): a unit whose Workload waits for quota is queued,
not unschedulable: kept (never parked), taking no room on its template's nodes, and counted as waiting for quota."""

from __future__ import annotations

from datetime import timedelta

import pytest

from diloco_operator.api import conditions as C
from diloco_operator.plan import autoscale, kueue

from test_operator_autoscale import T0, spec, unit
from test_operator_kueue import spec_of
from test_operator_kueue import unit as learner_unit

pytestmark = pytest.mark.fast
LONG_AGO = T0 - timedelta(hours=1)  # far past the provisioning timeout (60 s)


def queued(template: str, index: int, stuck_since=None) -> autoscale.UnitState:
    """A unit Kueue has not admitted; `stuck_since`: a PodsScheduled=False left from pods it had before."""
    return autoscale.UnitState(f"j-{template}-{index}", template, index, False, stuck_since, "0/2 nodes are available",
                               queued=True)


def test_units_waiting_for_quota_stay_as_queued_workloads_and_are_never_parked():
    s = spec(max_units=4)
    units = [unit("h100", 0), queued("h100", 1, LONG_AGO), unit("l4", 0), queued("l4", 1)]
    d = autoscale.decide(s, units, {}, None, T0)
    assert d.park == [] and d.counts == {"h100": 2, "l4": 2, "tpu": 0}, "every unit wanted is kept"
    assert d.status["desiredUnits"] == 4 and d.status["runningUnits"] == 2 and d.status["queuedUnits"] == 2
    assert {t["name"]: t["queued"] for t in d.status["templates"]} == {"h100": 1, "l4": 1, "tpu": 0}
    assert all(t.get("parkCount", 0) == 0 and "retryAt" not in t for t in d.status["templates"])
    limited, reason, message = d.limited
    assert limited and reason == C.Reason.WAITING_FOR_QUOTA and "2 wait for quota in Kueue" in message
    assert not [e for e in d.events if e[1] == C.Reason.UNITS_PARKED]
    assert d.requeue_after is None, "nothing to time out: Kueue's admission wakes the unit"
    # The same unit, not queued (its pods were refused by the scheduler): parked, and its share falls back.
    refused = autoscale.decide(s, [*units[:1], unit("h100", 1, running=False, stuck_since=LONG_AGO), *units[2:]],
                               {}, None, T0)
    assert refused.park == ["j-h100-1"] and refused.counts["l4"] == 3


def test_once_kueue_admits_every_queued_unit_the_target_is_met():
    d = autoscale.decide(spec(max_units=2, preference=["h100"]), [unit("h100", 0), unit("h100", 1)], {}, None, T0)
    assert d.status["queuedUnits"] == 0 and d.limited[:2] == (False, C.Reason.TARGET_MET)


def test_a_unit_queued_in_kueue_takes_no_room_on_its_templates_nodes():
    s = spec(max_units=2, preference=["h100"])
    about_to_be_placed = autoscale.decide(s, [unit("h100", 0, running=False)], {"h100": 2}, None, T0)
    waiting_for_quota = autoscale.decide(s, [queued("h100", 0)], {"h100": 2}, None, T0)
    def free(d: autoscale.Decision) -> int:
        return next(t["freeUnits"] for t in d.status["templates"] if t["name"] == "h100")
    assert free(about_to_be_placed) == 1 and free(waiting_for_quota) == 2


def test_a_unit_reads_as_queued_while_kueue_holds_it_and_not_once_admitted():
    lu = learner_unit()
    assert not autoscale.unit_state(lu).queued, "a unit of a job not queued in Kueue"
    held = kueue.plan_held(spec_of(lu), None, [], kueue.Admission("pending", "insufficient quota"), T0, 1)
    assert autoscale.unit_state({**lu, "status": held.status}).queued
    evicted = kueue.plan_held(spec_of(lu), None, [], kueue.Admission("evicted", "preempted", "Preempted"), T0, 1)
    assert autoscale.unit_state({**lu, "status": evicted.status}).queued
    admitted = kueue.admitted_condition(held.status, kueue.Admission("admitted", "on h100", "Admitted"), T0, 1)
    assert not autoscale.unit_state({**lu, "status": admitted}).queued
