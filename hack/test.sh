#!/usr/bin/env bash
# The whole test suite, from a fresh clone: sets up the virtualenv, builds (or reuses) the Kubernetes test binaries,
# helm and Kueue, then runs pytest. Extra arguments go to pytest. The e2e tier (tests/e2e) also installs and starts
# the container engine and builds the images (hack/build-images.sh, cached): it needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash hack/setup.sh
# The whole suite needs the XLA environment (tests/trainer/test_learner_xla.py): on a first run its ~3 GB install
# goes on in the background meanwhile. The test runs hack/xla-env.sh itself, which waits for this install (a lock)
# and redoes it if it failed.
if [ $# -eq 0 ]; then
  bash hack/xla-env.sh >/dev/null 2>"${TMPDIR:-/tmp}/diloco-xla-env.log" &
fi
DILOCO_TESTBED_DIR=$(bash hack/build-testbed.sh | tail -n 1)
DILOCO_HELM=$(bash hack/build-helm.sh | tail -n 1)   # the chart tests' helm (tests/operator/helm_kit.py)
DILOCO_KUEUE=$(bash hack/build-kueue.sh | tail -n 1)  # the Kueue tests' manager and CRDs (tests/operator/kueue_kit.py)
export DILOCO_TESTBED_DIR DILOCO_HELM DILOCO_KUEUE
exec .venv/bin/python -m pytest "$@"
