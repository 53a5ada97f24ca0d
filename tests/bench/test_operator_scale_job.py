"""The operator scale benchmark's job: any N it is asked for, spread over templates the CRD accepts."""

from diloco_bench.operator_scale import _job
from diloco_operator.api import models as api


def test_5000_units_are_five_templates_of_1000_that_the_api_accepts():
    spec = api.DilocoJobSpec.model_validate(_job(5000)["spec"])
    assert [t.count for t in spec.units] == [1000] * 5 and spec.total_units() == 5000
    assert len({t.name for t in spec.units}) == 5


def test_a_remainder_gets_its_own_template_and_a_small_job_one():
    assert [t["count"] for t in _job(2500)["spec"]["units"]] == [1000, 1000, 500]
    assert [t["count"] for t in _job(300)["spec"]["units"]] == [300]
