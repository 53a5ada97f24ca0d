#!/usr/bin/env bash
# One-time set-up: a virtualenv with the pinned dependencies (requirements.lock), kept in
# ~/.cache/diloco keyed by the lock file's hash so fresh clones reuse it, linked here as .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
key=$( { "$PY" -c 'import sys; print(sys.version)'; cat requirements.lock; } | sha256sum | cut -c1-16)
VENV=${DILOCO_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/diloco/venv-$key}
if [ ! -f "$VENV/.complete" ]; then
  echo "[setup] creating $VENV (first time: downloads torch, a few minutes)" >&2
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip setuptools wheel >&2
  "$VENV/bin/pip" install --quiet -r requirements.lock >&2
  touch "$VENV/.complete"
fi
# Editable install of this checkout (no dependency resolution: the lock already holds them).
"$VENV/bin/pip" install --quiet --no-deps --no-build-isolation -e . >&2
ln -sfn "$VENV" .venv
echo "[setup] ready: .venv -> $VENV" >&2
