"""Test tiers (markers, see pyproject.toml): `cluster` for every test that needs the testbed apiserver (found by its
fixtures, so no such test runs without the mark), `e2e` for tests/e2e, `slow` for real multi-process runs (marked
in their files); every other test is `fast`: `./hack/test.sh -m fast`, the tier to run after every change."""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = ("slow", "cluster", "e2e")
E2E = Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "testbed" in item.fixturenames and not item.get_closest_marker("cluster"):
            item.add_marker(pytest.mark.cluster)
        if E2E in Path(str(item.path)).parents and not item.get_closest_marker("e2e"):
            item.add_marker(pytest.mark.e2e)
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(pytest.mark.fast)
