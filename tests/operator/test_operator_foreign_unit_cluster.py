"""A LearnerUnit that names a job but is not controlled by it (issue 20, Low) gets no pods and no token from the
operator, says why in its status and an Event, and is never deleted; the job's own units go on untouched."""

from __future__ import annotations

import pytest

from diloco_operator.api import models as api
from diloco_operator.objects import builders as O

from polling import wait_for
from test_operator_cluster import condition, cpu_units, events, job, unit_pods, wait_job_ready

pytestmark = pytest.mark.cluster


def foreign_unit(name: str, job_name: str, owner: dict | None) -> dict:
    """A LearnerUnit someone with the right to create LearnerUnits writes by hand: the job's labels and name in
    spec.jobName, an image of their own, and no controller reference to the job."""
    spec = O.unit_spec(job_name, api.DilocoJobSpec.model_validate(job(job_name, cpu_units(1))["spec"]),
                       api.UnitTemplate(name="cpu"), 7, 7).model_dump(mode="json", exclude_none=True)
    meta = {"name": name, "labels": {O.LABEL_JOB: job_name, O.LABEL_TEMPLATE: "cpu"}}
    if owner is not None:
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": owner["kind"], "name": owner["metadata"]["name"],
                                    "uid": owner["metadata"]["uid"], "controller": True}]
    return {"apiVersion": api.API_VERSION, "kind": "LearnerUnit", "metadata": meta,
            "spec": {**spec, "image": "attacker:latest"}}


def test_a_learner_unit_not_controlled_by_its_job_gets_no_pods_and_says_why(kubectl, operator, ns):
    kubectl.apply(job("victim", cpu_units(1)), "-n", ns)
    wait_job_ready(kubectl, ns, "victim", 1)
    own_pods = {p["metadata"]["uid"] for p in unit_pods(kubectl, ns, "victim-cpu-0")}
    own_token = kubectl.get("secret", "victim-cpu-0-learner-token", ns=ns)["metadata"]["uid"]
    # One unit with no controller at all, one controlled by something else (a ConfigMap) that also holds the name
    # the job gives its next unit.
    kubectl.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "decoy"}}, "-n", ns)
    decoy = kubectl.get("configmap", "decoy", ns=ns)
    kubectl.apply(foreign_unit("stray", "victim", None), "-n", ns)
    kubectl.apply(foreign_unit("victim-cpu-1", "victim", decoy), "-n", ns)

    for name, why in (("stray", "it has no controller reference"),
                      ("victim-cpu-1", f"its controller is ConfigMap decoy (uid {decoy['metadata']['uid']})")):
        ready = wait_for(lambda: (c := condition(kubectl.get("lu", name, ns=ns) or {}, "Ready")).get("reason")
                         == "NotControlledByJob" and c, 60, f"{name}: Ready=False / NotControlledByJob", 0.2)
        assert ready["status"] == "False"
        assert f"LearnerUnit {ns}/{name} names job victim but is not controlled by it ({why};" in ready["message"]
        assert unit_pods(kubectl, ns, name) == [], "no pod runs for a unit the job does not control"
        assert kubectl.get("secret", f"{name}-learner-token", ns=ns) is None, "and no learner token is made for it"
        warned = wait_for(lambda: {e["involvedObject"]["kind"] for e in events(kubectl, ns, "NotControlledByJob")
                                   if e["involvedObject"]["name"] in (name, "victim") and name in e["message"]}
                          == {"LearnerUnit", "DilocoJob"}, 30, f"a Warning Event on {name} and on the job", 0.2)
        assert warned

    # The job scales around them: its next unit takes the next free name, and it deletes neither foreign unit.
    kubectl.run("scale", "dj", "victim", "-n", ns, "--replicas=2")
    dj = wait_job_ready(kubectl, ns, "victim", 2)
    assert dj["status"]["replicas"] == 2, "the foreign units are not counted as the job's"
    assert sorted(u["metadata"]["name"] for u in kubectl.get("lu", ns=ns)) == ["stray", "victim-cpu-0",
                                                                                "victim-cpu-1", "victim-cpu-2"]
    for name in ("stray", "victim-cpu-1"):
        unit = kubectl.get("lu", name, ns=ns)
        assert unit["spec"]["image"] == "attacker:latest" and unit_pods(kubectl, ns, name) == []
        assert condition(unit, "Ready")["reason"] == "NotControlledByJob"
    epochs = kubectl.get("configmap", "victim-learner-epochs", ns=ns)["data"]["epochs.json"]
    assert '"stray"' not in epochs and '"victim-cpu-1"' not in epochs, "no token epoch is kept for them"
    # The job's own unit was never touched: the same pods, the same token Secret, no restart.
    assert {p["metadata"]["uid"] for p in unit_pods(kubectl, ns, "victim-cpu-0")} == own_pods
    assert kubectl.get("secret", "victim-cpu-0-learner-token", ns=ns)["metadata"]["uid"] == own_token
    assert kubectl.get("lu", "victim-cpu-0", ns=ns)["status"]["restarts"] == 0
