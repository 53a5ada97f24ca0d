#!/usr/bin/env bash
# Regenerate a lock file from its .in in a scratch virtualenv:
#   hack/lock.sh        requirements.lock from requirements.in (pip freeze of an install)
#   hack/lock.sh xla    requirements-xla.lock from requirements-xla.in (the XLA environment, hack/xla-env.sh):
#                       resolved without installing, every package it shares with requirements.lock held at that
#                       version (all but torch and what only torch pulls in: triton, nvidia-*, cuda-*)
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
case "${1:-}" in
  "")
    "$tmp/venv/bin/pip" install --quiet -r requirements.in
    { echo "# Full pinned set (pip freeze of requirements.in on CPython 3.11, linux x86_64). Regenerate: hack/lock.sh"
      "$tmp/venv/bin/pip" freeze | grep -vi '^decoupled-diloco'; } > requirements.lock
    ;;
  xla)
    "$tmp/venv/bin/pip" install --quiet --upgrade pip
    grep -viE '^(torch|triton|nvidia-|cuda-)' requirements.lock | grep -v '^#' > "$tmp/shared.txt"
    "$tmp/venv/bin/pip" install --quiet --dry-run --ignore-installed --report "$tmp/report.json" \
      -c "$tmp/shared.txt" -r requirements-xla.in
    { echo "# Full pinned set of the XLA environment (requirements-xla.in resolved on CPython 3.11, linux x86_64)."
      echo "# Regenerate: hack/lock.sh xla"
      "$tmp/venv/bin/python" -c '
import json, sys
report = json.load(open(sys.argv[1]))
pins = sorted((i["metadata"]["name"], i["metadata"]["version"]) for i in report["install"])
print("\n".join(f"{n}=={v}" for n, v in sorted(pins, key=lambda p: p[0].lower())))' "$tmp/report.json"
    } > requirements-xla.lock
    ;;
  *) echo "usage: hack/lock.sh [xla]" >&2; exit 2 ;;
esac
