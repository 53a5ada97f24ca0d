#!/usr/bin/env bash
# Build a real Kubernetes control plane for tests (kube-apiserver, kube-controller-manager,
# kube-scheduler, etcd, kwok; kubelet, kube-proxy and coredns for a real node) from Go modules, cached outside the repo by version.
# Prints the directory that holds bin/ and stages/ on its last line. See shared k8s-testbed notes.
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-1.36.3}
ETCD_VERSION=${ETCD_VERSION:-3.6.8}
KWOK_VERSION=${KWOK_VERSION:-0.8.0}
COREDNS_VERSION=${COREDNS_VERSION:-1.15.0}
CACHE_ROOT=${DILOCO_TESTBED_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/diloco-testbed}
OUT="$CACHE_ROOT/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION-coredns-$COREDNS_VERSION"
BIN="$OUT/bin"
NEEDED=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy etcd kwok coredns)

have_all() {
  for b in "${NEEDED[@]}"; do [ -x "$BIN/$b" ] || return 1; done
  [ -d "$OUT/stages" ] || return 1
}

if have_all; then echo "$OUT"; exit 0; fi

command -v go >/dev/null || { echo "build-testbed: 'go' is not on PATH; install Go >= 1.26" >&2; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod
mkdir -p "$BIN"
work=$(mktemp -d "$CACHE_ROOT/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
log() { printf '[build-testbed %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
started=$(date +%s)

build_kubernetes() {
  log "kubernetes v$K8S_VERSION: downloading module"
  local kk_mod
  kk_mod=$(cd "$work" && go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  mkdir -p "$work/k8s" && cd "$work/k8s"
  go mod init diloco.dev/testbed-k8s >/dev/null 2>&1
  # k/k maps its staging modules to ./staging with replace; only the main module honours replace,
  # so repeat them here, pointing at the published v0.X.Y of each staging module.
  local staging_ver="v0.${K8S_VERSION#1.}"
  grep -E '^\s*k8s.io/[^ ]+ => ./staging/' "$kk_mod" | awk '{print $1}' | while read -r m; do
    go mod edit -replace "$m=$m@$staging_ver"
  done
  log "kubernetes: $(grep -c '=>' go.mod) staging replaces; resolving"
  go get -tool "k8s.io/kubernetes/cmd/kube-apiserver@v$K8S_VERSION" \
    "k8s.io/kubernetes/cmd/kube-controller-manager@v$K8S_VERSION" \
    "k8s.io/kubernetes/cmd/kube-scheduler@v$K8S_VERSION" "k8s.io/kubernetes/cmd/kubelet@v$K8S_VERSION" \
    "k8s.io/kubernetes/cmd/kube-proxy@v$K8S_VERSION" >&2
  log "kubernetes: compiling (cold: 10-25 min on 2 cores)"
  # Stamp the release version (as upstream's build does), so servers and kubelets report v1.36.N, not v0.0.0-master.
  local minor=${K8S_VERSION#*.}; minor=${minor%%.*}
  local v=k8s.io/component-base/version
  go build -trimpath -ldflags "-s -w -X $v.gitVersion=v$K8S_VERSION -X $v.gitMajor=1 -X $v.gitMinor=$minor \
    -X $v.gitTreeState=clean" -o "$BIN/" k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy >&2
}

build_etcd() {
  log "etcd v$ETCD_VERSION"
  mkdir -p "$work/etcd" && cd "$work/etcd"
  go mod init diloco.dev/testbed-etcd >/dev/null 2>&1
  go get -tool "go.etcd.io/etcd/server/v3@v$ETCD_VERSION" >&2
  go build -trimpath -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3 >&2
}

build_kwok() {
  log "kwok v$KWOK_VERSION"
  GOBIN="$BIN" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@v$KWOK_VERSION" >&2
  local kwok_dir
  kwok_dir=$(cd "$work" && go mod download -json "sigs.k8s.io/kwok@v$KWOK_VERSION" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  rm -rf "$OUT/stages" && mkdir -p "$OUT/stages.tmp"
  cp -r "$kwok_dir/kustomize/stage/." "$OUT/stages.tmp/"
  chmod -R u+w "$OUT/stages.tmp" && mv "$OUT/stages.tmp" "$OUT/stages"
}

build_coredns() {
  # Cluster DNS for the real node's pods (Service and pod names), as every real cluster has.
  log "coredns v$COREDNS_VERSION"
  GOBIN="$BIN" go install -trimpath -ldflags "-s -w" "github.com/coredns/coredns@v$COREDNS_VERSION" >&2
}

for b in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy; do
  [ -x "$BIN/$b" ] || { build_kubernetes; break; }
done
[ -x "$BIN/etcd" ] || build_etcd
[ -x "$BIN/coredns" ] || build_coredns
{ [ -x "$BIN/kwok" ] && [ -d "$OUT/stages" ]; } || build_kwok

have_all || { echo "build-testbed: build finished but binaries are missing in $BIN" >&2; exit 1; }
log "done in $(( $(date +%s) - started ))s"
echo "$OUT"
