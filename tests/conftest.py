"""Test tiers (markers, see pyproject.toml): `cluster` for every test that needs the testbed apiserver (found by its
fixtures, so no such test runs without the mark), `e2e` for tests/e2e, `slow` for real multi-process runs (marked
in their files); every other test is `fast`: `./hack/test.sh -m fast`, the tier to run after every change."""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = ("slow", "cluster", "e2e")
E2E = Path(__file__).resolve().parent / "e2e"
# Fixtures of binaries that ./hack/test.sh compiles in the background on a cold cache (hack/build-helm.sh,
# hack/build-kueue.sh); their tests wait for that build.
BUILT_IN_BACKGROUND = {"helm", "kueue_manager"}


# ./hack/test.sh runs the suite on two pytest-xdist workers (--dist loadgroup), one stream of each kind: the `slow`
# tests load the CPU with real training processes, while the cluster and e2e tests mostly wait on a control plane,
# kwok or the kubelet. Each stream stays serial within itself (a group runs on one worker, in collection order), so
# two training runs never share the 2 cores and timing inside a stream is as in a serial run; fast tests fill gaps.
STREAMS = {"slow": "processes", "cluster": "kubernetes", "e2e": "kubernetes"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "testbed" in item.fixturenames and not item.get_closest_marker("cluster"):
            item.add_marker(pytest.mark.cluster)
        if E2E in Path(str(item.path)).parents and not item.get_closest_marker("e2e"):
            item.add_marker(pytest.mark.e2e)
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if not tiers:
            item.add_marker(pytest.mark.fast)
        elif not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(STREAMS[tiers[-1]]))
    # The e2e tier runs last in its stream: by then the images it needs, which ./hack/test.sh starts building in the
    # background at the start of a whole-suite run, are built and in containerd. Just before it, the tests that need
    # helm or Kueue, which a whole-suite run on a cold cache also compiles in the background (hack/test.sh).
    items.sort(key=lambda item: (item.get_closest_marker("e2e") is not None,
                                 bool(BUILT_IN_BACKGROUND & set(item.fixturenames))))
