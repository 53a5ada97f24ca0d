#!/usr/bin/env bash
# Regenerate a lock file from its .in in a scratch virtualenv:
#   hack/lock.sh        requirements.lock from requirements.in: pip freeze --all of an install (pip and setuptools
#                       included), then every pin given the sha256 of each file PyPI has for it (all platforms), by
#                       `uv pip compile --generate-hashes` over the frozen pins (no version changes: each is ==)
#   hack/lock.sh hashes requirements.lock's hashes again for the pins it has (nothing resolved anew)
#   hack/lock.sh xla    requirements-xla.lock from requirements-xla.in (the XLA environment, hack/xla-env.sh):
#                       resolved without installing, every package it shares with requirements.lock held at that
#                       version (all but torch and what only torch pulls in: triton, nvidia-*, cuda-*); no hashes
# Installs with the lock check the hashes: pip install --require-hashes -r requirements.lock (hack/setup.sh), and
# -c requirements.lock --require-hashes in the Dockerfile (after installing the lock's pip: pip 26.3 applies a
# constraints file's hashes, 23.2 does not).
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.9
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
pins_of() { grep -E '^[A-Za-z0-9]' "$1" | sed 's/[ ;].*//'; }  # NAME==VERSION lines of a (hashed) lock
hash_pins() {  # hash_pins PINS: requirements.lock from PINS with hashes
  "$tmp/venv/bin/pip" install --quiet "uv==$UV_VERSION"
  { echo "# Full pinned set (pip freeze --all of requirements.in on CPython 3.11, linux x86_64), with the sha256 of"
    echo "# every file PyPI has for each pin. Regenerate: hack/lock.sh (hashes only: hack/lock.sh hashes)"
    "$tmp/venv/bin/uv" pip compile --quiet --generate-hashes --no-header --no-annotate --python-version 3.11 \
      --python-platform x86_64-manylinux_2_28 "$1"; } > "$tmp/hashed.lock"
  diff <(pins_of "$1" | tr 'A-Z_' 'a-z-' | sort) <(pins_of "$tmp/hashed.lock" | tr 'A-Z_' 'a-z-' | sort) >&2 \
    || { echo "hack/lock.sh: hashing changed the pins (above); requirements.lock left as it was" >&2; exit 1; }
  mv "$tmp/hashed.lock" requirements.lock
}
case "${1:-}" in
  "")
    "$tmp/venv/bin/pip" install --quiet --upgrade pip
    "$tmp/venv/bin/pip" install --quiet -r requirements.in
    "$tmp/venv/bin/pip" freeze --all | grep -viE '^(decoupled-diloco|wheel)' > "$tmp/pins.txt"
    hash_pins "$tmp/pins.txt"
    ;;
  hashes)
    pins_of requirements.lock > "$tmp/pins.txt"
    hash_pins "$tmp/pins.txt"
    ;;
  xla)
    "$tmp/venv/bin/pip" install --quiet --upgrade pip
    pins_of requirements.lock | grep -viE '^(torch|triton|nvidia-|cuda-|pip|setuptools)==' > "$tmp/shared.txt"
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
  *) echo "usage: hack/lock.sh [hashes|xla]" >&2; exit 2 ;;
esac
