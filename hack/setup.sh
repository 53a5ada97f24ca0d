#!/usr/bin/env bash
# One-time set-up. The pinned dependencies (requirements.lock, each file checked against its sha256s there; torch
# from PyPI) go into a virtualenv cached in ~/.cache/diloco keyed by the lock file's hash, so every clone reuses it;
# this checkout gets its own light .venv layered on top of it (the cached site-packages plus this checkout's
# packages on its path, and a `diloco` command), so two checkouts never point one install at each other's code.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
key=$( { "$PY" -c 'import sys; print(sys.version)'; cat requirements.lock; } | sha256sum | cut -c1-16)
DEPS=${DILOCO_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/diloco/venv-$key}
if [ ! -f "$DEPS/.complete" ]; then
  echo "[setup] installing the pinned dependencies into $DEPS (first time: downloads torch, a few minutes)" >&2
  rm -rf "$DEPS"
  "$PY" -m venv "$DEPS"
  # Every file is checked against the lock's sha256s; pip itself first (the lock's, over the venv's bundled one).
  awk '/^[^ #]/ { keep = /^pip==/ } keep' requirements.lock > "$DEPS/pip.lock"
  "$DEPS/bin/pip" install --quiet --require-hashes -r "$DEPS/pip.lock" >&2
  "$DEPS/bin/pip" install --quiet --require-hashes -r requirements.lock >&2
  touch "$DEPS/.complete"
fi
[ -L .venv ] && rm .venv  # an older set-up linked the shared virtualenv itself
if [ ! -x .venv/bin/python ]; then
  "$DEPS/bin/python" -m venv --without-pip .venv
fi
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
deps_site=$("$DEPS/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$deps_site')" > "$site/_diloco_deps.pth"
printf '%s\n' "$ROOT/trainer" "$ROOT/operator" "$ROOT/chaos" "$ROOT/kube" "$ROOT/devcluster" "$ROOT/bench" > "$site/_diloco_src.pth"
cat > .venv/bin/diloco <<SCRIPT
#!$ROOT/.venv/bin/python
import sys
from diloco_trainer.cli import main
sys.exit(main())
SCRIPT
chmod +x .venv/bin/diloco
ln -sf "$DEPS/bin/kopf" .venv/bin/kopf
echo "[setup] ready: .venv (dependencies from $DEPS)" >&2
