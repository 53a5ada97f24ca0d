#!/usr/bin/env bash
# Regenerate requirements.lock from requirements.in in a scratch virtualenv.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install --quiet -r requirements.in
{ echo "# Full pinned set (pip freeze of requirements.in on CPython 3.11, linux x86_64). Regenerate: hack/lock.sh"
  "$tmp/venv/bin/pip" freeze | grep -vi '^decoupled-diloco'; } > requirements.lock
