"""A spare pod's sealed assignment (protocol/assignment.py): it opens only under its job's spare key, for the pod it
was sealed for, with the identity it was sealed with."""

import json

import pytest

from diloco_trainer.protocol.assignment import (Assignment, AssignmentError, decode_key, encode_key, seal, spare_key,
                                                unseal)

KEY = spare_key("job-token", "job")
A = Assignment("job-cpu-3", 3, 8, "the-unit-token")


def test_an_assignment_opens_for_its_pod_with_its_identity_and_token():
    text = seal(KEY, "job-spare-abc", A)
    assert "the-unit-token" not in text, "the token is sealed"
    assert json.loads(text)["learnerId"] == "job-cpu-3", "the identity is in the clear"
    assert unseal(decode_key(encode_key(KEY)), "job-spare-abc", text) == A


def test_an_assignment_does_not_open_for_another_pod_or_under_another_jobs_key():
    text = seal(KEY, "job-spare-abc", A)
    with pytest.raises(AssignmentError, match="for pod job-spare-xyz"):
        unseal(KEY, "job-spare-xyz", text)
    with pytest.raises(AssignmentError, match="another key"):
        unseal(spare_key("job-token", "other-job"), "job-spare-abc", text)


@pytest.mark.parametrize("field,value", [("learnerId", "job-cpu-4"), ("unit", 4), ("units", 9)])
def test_an_assignment_whose_identity_was_edited_does_not_open(field, value):
    doc = json.loads(seal(KEY, "job-spare-abc", A))
    doc[field] = value  # someone who may patch the pod's annotations moves the token to another identity
    with pytest.raises(AssignmentError, match="identity was edited"):
        unseal(KEY, "job-spare-abc", json.dumps(doc))


@pytest.mark.parametrize("text,why", [("[]", "not a JSON object"), ("{", "not JSON"), ("x" * 9000, "at most"),
                                      ('{"learnerId":"a","unit":2,"units":2,"token":""}', "0 <= unit < units"),
                                      ('{"learnerId":"a","unit":0,"units":2,"token":"!!"}', "does not open")])
def test_a_malformed_assignment_says_what_is_wrong(text, why):
    with pytest.raises(AssignmentError, match=why):
        unseal(KEY, "job-spare-abc", text)


def test_a_spare_key_that_is_not_32_bytes_of_base64_is_refused():
    with pytest.raises(AssignmentError, match="base64"):
        decode_key("not base64!")
    with pytest.raises(AssignmentError, match="32 bytes"):
        decode_key(encode_key(b"short"))
