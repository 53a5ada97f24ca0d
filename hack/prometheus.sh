#!/usr/bin/env bash
# A real Prometheus for the monitoring tests (tests/trainer/test_prometheus_dashboard.py): Debian's `prometheus`
# package, installed if missing (root, apt-get), never run as the package's service: the tests start the binary
# with their own config and data directory. Idempotent. Prints the binary's path on its last line.
# Debian builds it without Kubernetes service discovery (no kubernetes_sd_configs): tests give it static targets.
set -euo pipefail
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

log() { printf '[prometheus %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

BIN=${DILOCO_PROMETHEUS:-/usr/bin/prometheus}
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi

[ "$(id -u)" = 0 ] || die "no $BIN: run as root, or install it: apt-get install -y --no-install-recommends prometheus"
command -v apt-get >/dev/null || die "no $BIN and no apt-get on this machine; set DILOCO_PROMETHEUS to a prometheus binary"

# The package's maintainer scripts start its service through invoke-rc.d; a policy-rc.d that answers 101 (what
# container images ship) stops them. Ours exists only for the install, and only when the machine has none.
POLICY=/usr/sbin/policy-rc.d
ours=0
if [ ! -e "$POLICY" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$POLICY" && chmod 755 "$POLICY" && ours=1
  trap '[ "$ours" = 1 ] && rm -f "$POLICY"' EXIT
fi
log "apt-get update"
DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
log "apt-get install prometheus"
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >&2
[ -x "$BIN" ] || die "apt-get installed prometheus but $BIN is missing"
"$BIN" --version 2>&1 | head -n 1 >&2
echo "$BIN"
