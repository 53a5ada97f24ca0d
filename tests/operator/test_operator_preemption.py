"""Preemption (spec.failurePolicy.drainSeconds), the pure part: a learner pod deleted with a grace period gets the
time to hand over its unsent work (the learner's side: tests/trainer/test_learner_preemption.py)."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from diloco_operator.api import models as api
from diloco_operator.objects import builders as objects

pytestmark = pytest.mark.fast
JOB = {"apiVersion": api.API_VERSION, "kind": "DilocoJob",
       "metadata": {"name": "demo", "namespace": "ns", "uid": "u-1", "generation": 1}}


def job_spec(**kw) -> api.DilocoJobSpec:
    return api.DilocoJobSpec.model_validate({"image": "img:1", "units": [{"name": "cpu", "count": 1}], **kw})


def learner_pod(spec: api.DilocoJobSpec) -> dict:
    lu = objects.learner_unit(JOB, objects.unit_spec("demo", spec, spec.units[0], 0, 0))
    lu["metadata"]["uid"] = "lu-1"
    return objects.unit_pod(lu, 0, 0)


def drain_s_of(pod: dict) -> float:
    from diloco_trainer.learner import main as learner_main

    parser = argparse.ArgumentParser()
    learner_main.configure(parser)
    args, _ = parser.parse_known_args(objects.learner_arguments(pod["spec"]["containers"][0]["command"]))
    return args.drain_s


def test_a_learner_pods_grace_period_covers_its_drain_and_the_step_in_progress():
    pod = learner_pod(job_spec(failurePolicy={"drainSeconds": 40}))
    assert drain_s_of(pod) == 40
    assert pod["spec"]["terminationGracePeriodSeconds"] == 40 + api.STOP_MARGIN_SECONDS
    default = learner_pod(job_spec())
    assert drain_s_of(default) == api.DRAIN_SECONDS == 10
    # Within Kubernetes' default of 30 s, which spot/preemptible reclaims rarely extend.
    assert default["spec"]["terminationGracePeriodSeconds"] == 20


def test_changing_drain_seconds_restarts_no_pod():
    spec, longer = job_spec(), job_spec(failurePolicy={"drainSeconds": 60})
    raw = objects.unit_spec("demo", spec, spec.units[0], 0, 0).model_dump(mode="json", exclude_none=True)
    raw_60 = objects.unit_spec("demo", longer, longer.units[0], 0, 0).model_dump(mode="json", exclude_none=True)
    assert raw != raw_60 and objects.pod_spec_hash(raw) == objects.pod_spec_hash(raw_60)


@pytest.mark.parametrize("seconds", [-1, 3601, "a while"])
def test_drain_seconds_out_of_bounds_is_refused_naming_the_field(seconds):
    with pytest.raises(ValidationError) as err:
        job_spec(failurePolicy={"drainSeconds": seconds})
    assert "failurePolicy.drainSeconds" in str(err.value)
