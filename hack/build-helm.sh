#!/usr/bin/env bash
# Build a real `helm` (helm.sh/helm/v4) from the Go module proxy, cached outside the repo by version, for the chart
# tests (charts/decoupled-diloco) and for users without a helm. Prints the binary's path on its last line.
set -euo pipefail

HELM_VERSION=${HELM_VERSION:-4.3.1}
CACHE_ROOT=${DILOCO_TESTBED_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/diloco-testbed}
OUT="$CACHE_ROOT/helm-$HELM_VERSION"
HELM="$OUT/bin/helm"

if [ -x "$HELM" ]; then echo "$HELM"; exit 0; fi

command -v go >/dev/null || { echo "build-helm: 'go' is not on PATH; install Go >= 1.26" >&2; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod
log() { printf '[build-helm %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
mkdir -p "$CACHE_ROOT"
# One build at a time: a whole-suite ./hack/test.sh starts one in the background, and the chart tests run this
# script again (tests/operator/helm_kit.py); that second run waits here for the first (hack/build-wait.sh), then
# finds the binary.
source "$(dirname "$0")/build-wait.sh"
wait_for_build "$CACHE_ROOT/helm-$HELM_VERSION.lock" build-helm
if [ -x "$HELM" ]; then echo "$HELM"; exit 0; fi
started=$(date +%s)
mkdir -p "$OUT/bin"
tmp=$(mktemp -d "$OUT/build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

log "helm v$HELM_VERSION: downloading and compiling (cold: a few minutes on 2 cores)"
# helm's go.mod has no replace directives, so `go install` of the released module builds it as upstream does;
# the version is stamped as upstream's Makefile stamps a tagged release (`helm version` reports it), and cgo is off
# as there (CGO_ENABLED ?= 0).
CGO_ENABLED=0 GOBIN="$tmp" go install -trimpath \
  -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=v$HELM_VERSION \
    -X helm.sh/helm/v4/internal/version.metadata= -X helm.sh/helm/v4/internal/version.gitTreeState=clean" \
  "helm.sh/helm/v4/cmd/helm@v$HELM_VERSION" >&2
mv "$tmp/helm" "$HELM"  # atomic: a concurrent reader sees no binary or the whole one
"$HELM" version --short >&2
log "done in $(( $(date +%s) - started ))s"
echo "$HELM"
