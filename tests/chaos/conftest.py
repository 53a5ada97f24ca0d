"""The cluster chaos tests reuse the operator tests' fixtures (the real control plane, CRDs, the operator under
its own ServiceAccount, a namespace per test), loaded from tests/operator/conftest.py under another name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

OPERATOR_TESTS = Path(__file__).resolve().parents[1] / "operator"
if str(OPERATOR_TESTS) not in sys.path:
    sys.path.insert(0, str(OPERATOR_TESTS))  # its conftest imports cluster_kit

_spec = importlib.util.spec_from_file_location("operator_test_fixtures", OPERATOR_TESTS / "conftest.py")
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)

testbed = _fixtures.testbed
kubectl = _fixtures.kubectl
crds = _fixtures.crds
operator = _fixtures.operator
ns = _fixtures.ns
