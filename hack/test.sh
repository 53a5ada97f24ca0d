#!/usr/bin/env bash
# The whole test suite, from a fresh clone: sets up the virtualenv, builds (or reuses) the Kubernetes test binaries,
# helm and Kueue, then runs pytest. Extra arguments go to pytest. The e2e tier (tests/e2e) also installs and starts
# the container engine and builds the images (hack/build-images.sh, cached): it needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
# helm (the chart tests: tests/operator/helm_kit.py) and Kueue (tests/operator/kueue_kit.py), cached by version. A
# whole-suite run whose cache lacks them compiles them in the background at a low priority (~5.5 min of both cores
# cold), in the CPU that the set-up and the tests leave idle; the tests that need them run last before the e2e tier
# (tests/conftest.py) and run the same scripts, which wait for that build and raise it to full priority
# (hack/build-wait.sh). A run of chosen tests builds them first.
tools_pid=""
if [ $# -eq 0 ]; then
  setsid nice -n 10 bash -c 'bash hack/build-helm.sh && bash hack/build-kueue.sh' \
    >/dev/null 2>"${TMPDIR:-/tmp}/diloco-build-tools.log" &
  tools_pid=$!
else
  DILOCO_HELM=$(bash hack/build-helm.sh | tail -n 1)
  DILOCO_KUEUE=$(bash hack/build-kueue.sh | tail -n 1)
  export DILOCO_HELM DILOCO_KUEUE
fi
bash hack/setup.sh
# The whole suite needs the XLA environment (tests/trainer/test_learner_xla.py): on a first run its ~3 GB install
# goes on in the background meanwhile. The test runs hack/xla-env.sh itself, which waits for this install (a lock)
# and redoes it if it failed.
if [ $# -eq 0 ]; then
  bash hack/xla-env.sh >/dev/null 2>"${TMPDIR:-/tmp}/diloco-xla-env.log" &
fi
# The e2e tier (last in the suite) needs the images in containerd: as root, a whole-suite run builds and imports them
# in the background from the start (hack/build-images.sh, cached by content; ~4.5 min after a code change), so the
# e2e fixture's own call finds them ready. A container engine that this started is stopped at the end.
images_pid=""
engine_was_up=1
if [ $# -eq 0 ] && [ "$(id -u)" = 0 ]; then
  bash hack/container-engine.sh status >/dev/null 2>&1 || engine_was_up=0
  bash hack/build-images.sh >"${TMPDIR:-/tmp}/diloco-build-images.log" 2>&1 &
  images_pid=$!
fi
DILOCO_TESTBED_DIR=$(bash hack/build-testbed.sh | tail -n 1)
export DILOCO_TESTBED_DIR
# The suite starts a few hundred Python processes (syncers, learners, workers, operators): each compiles the
# checkout's modules it imports unless their bytecode is cached. With PYTHONDONTWRITEBYTECODE=1 (containers often
# set it, our images too) every one of them compiled from source again (~0.2 CPU-s a learner). The cache goes to
# __pycache__/ beside the sources (ignored by git and by the image builds).
unset PYTHONDONTWRITEBYTECODE
# Two workers (pytest-xdist): the training-process stream and the Kubernetes stream side by side (tests/conftest.py);
# DILOCO_TEST_WORKERS=0 runs everything in this one process, in order.
rc=0
.venv/bin/python -m pytest -n "${DILOCO_TEST_WORKERS:-2}" --dist loadgroup "$@" || rc=$?
if [ -n "$tools_pid" ]; then
  wait "$tools_pid" || echo "[test] the background helm/Kueue build failed: ${TMPDIR:-/tmp}/diloco-build-tools.log" >&2
fi
if [ -n "$images_pid" ]; then
  wait "$images_pid" || echo "[test] the background image build failed: ${TMPDIR:-/tmp}/diloco-build-images.log" >&2
  [ "$engine_was_up" = 1 ] || bash hack/container-engine.sh down >&2
fi
exit "$rc"
