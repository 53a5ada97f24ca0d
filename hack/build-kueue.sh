#!/usr/bin/env bash
# Build a real Kueue manager (sigs.k8s.io/kueue cmd/kueue) from the Go module proxy, cached outside the repo by
# version, with its CRDs and webhook configurations, for the Kueue tests (tests/operator/kueue_kit.py). Prints the
# directory holding bin/kueue, crds/ and webhooks.yaml on its last line.
set -euo pipefail

KUEUE_VERSION=${KUEUE_VERSION:-0.17.0}
CACHE_ROOT=${DILOCO_TESTBED_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/diloco-testbed}
OUT="$CACHE_ROOT/kueue-$KUEUE_VERSION"

if [ -x "$OUT/bin/kueue" ] && [ -f "$OUT/crds/kueue.x-k8s.io_workloads.yaml" ] && [ -f "$OUT/webhooks.yaml" ]; then
  echo "$OUT"; exit 0
fi

command -v go >/dev/null || { echo "build-kueue: 'go' is not on PATH; install Go >= 1.26" >&2; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod
log() { printf '[build-kueue %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
mkdir -p "$CACHE_ROOT"
# One build at a time (hack/build-wait.sh): a whole-suite ./hack/test.sh starts one in the background, and the
# Kueue tests run this script again (tests/operator/kueue_kit.py); that run waits here, then finds it all built.
source "$(dirname "$0")/build-wait.sh"
wait_for_build "$CACHE_ROOT/kueue-$KUEUE_VERSION.lock" build-kueue
if [ -x "$OUT/bin/kueue" ] && [ -f "$OUT/crds/kueue.x-k8s.io_workloads.yaml" ] && [ -f "$OUT/webhooks.yaml" ]; then
  echo "$OUT"; exit 0
fi
started=$(date +%s)
mkdir -p "$OUT"
tmp=$(mktemp -d "$OUT/build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

log "kueue v$KUEUE_VERSION: downloading module"
mod_dir=$(cd "$tmp" && go mod download -json "sigs.k8s.io/kueue@v$KUEUE_VERSION" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
[ -d "$mod_dir/config/components/crd/bases" ] || { echo "build-kueue: no CRDs in $mod_dir" >&2; exit 1; }
# The CRD bases as released (without the conversion-webhook patches of upstream's kustomization: v1beta2 is the
# storage version and the only one the tests and the operator use).
mkdir -p "$tmp/crds" && cp "$mod_dir"/config/components/crd/bases/*.yaml "$tmp/crds/"
# Upstream's webhook configurations (their clientConfig names a Service; the test kit points them at the process).
cp "$mod_dir/config/components/webhook/manifests.yaml" "$tmp/webhooks.yaml"

rm -rf "$OUT/crds" && mv "$tmp/crds" "$OUT/crds" && mv "$tmp/webhooks.yaml" "$OUT/webhooks.yaml"
if [ ! -x "$OUT/bin/kueue" ]; then
  log "kueue: compiling cmd/kueue (cold: several minutes on 2 cores)"
  # kueue's go.mod has no replace directives, so `go install` of the released module builds it as upstream does;
  # the version is stamped as upstream's Makefile stamps a release, and cgo is off as there (CGO_ENABLED ?= 0; the
  # compile time is the same within this machine's noise: docs/testing.md).
  v=sigs.k8s.io/kueue/pkg/version
  CGO_ENABLED=0 GOBIN="$tmp" go install -trimpath -ldflags "-s -w -X $v.GitVersion=v$KUEUE_VERSION" \
    "sigs.k8s.io/kueue/cmd/kueue@v$KUEUE_VERSION" >&2
  mkdir -p "$OUT/bin" && mv "$tmp/kueue" "$OUT/bin/kueue"  # atomic: a concurrent reader sees none or all of it
fi
log "done in $(( $(date +%s) - started ))s"
echo "$OUT"
