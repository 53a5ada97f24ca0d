#!/usr/bin/env bash
# The XLA environment: torch + torch_xla as pinned by requirements-xla.lock (torch_xla pins its own torch, older
# than the project's) in a virtualenv cached in ~/.cache/diloco/xla-venv-<hash of Python and the lock>, so every
# clone and every run reuses it (the first install downloads ~3 GB: torch's PyPI wheel pulls CUDA libraries), and a
# light .venv-xla in this checkout on top of it with this checkout's packages on its path and a `diloco` command.
# Progress goes to stderr; the last line of stdout is the .venv-xla directory, for
#   XLA_ENV=$(hack/xla-env.sh | tail -n 1); PJRT_DEVICE=CPU $XLA_ENV/bin/diloco learner --device xla ...
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
key=$( { "$PY" -c 'import sys; print(sys.version)'; cat requirements-xla.lock; } | sha256sum | cut -c1-16)
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/diloco
DEPS=${DILOCO_XLA_VENV:-$CACHE/xla-venv-$key}
mkdir -p "$(dirname "$DEPS")"
exec 9>"$DEPS.lock"
flock 9  # held to the end: two runs at once (hack/test.sh starts one early) would write into one directory
if [ ! -f "$DEPS/.complete" ]; then
  echo "[xla-env] installing torch + torch_xla (requirements-xla.lock) into $DEPS (first time: ~3 GB of wheels)" >&2
  started=$(date +%s)
  rm -rf "$DEPS"
  "$PY" -m venv "$DEPS"
  "$DEPS/bin/pip" install --quiet --upgrade pip >&2
  "$DEPS/bin/pip" install --no-cache-dir --progress-bar off -r requirements-xla.lock 2>&1 \
    | grep --line-buffered -E '^(Collecting|Installing|Successfully)' | sed -u 's/^/[xla-env] /' >&2
  "$DEPS/bin/python" -c 'import torch, torch_xla; print("[xla-env] torch", torch.__version__, "torch_xla", torch_xla.__version__)' >&2
  touch "$DEPS/.complete"
  echo "[xla-env] installed in $(( $(date +%s) - started )) s" >&2
fi
if [ ! -x .venv-xla/bin/python ]; then
  "$DEPS/bin/python" -m venv --without-pip .venv-xla
fi
site=$(.venv-xla/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
deps_site=$("$DEPS/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$deps_site')" > "$site/_diloco_deps.pth"
printf '%s\n' "$ROOT/trainer" > "$site/_diloco_src.pth"
cat > .venv-xla/bin/diloco <<SCRIPT
#!$ROOT/.venv-xla/bin/python
import sys
from diloco_trainer.cli import main
sys.exit(main())
SCRIPT
chmod +x .venv-xla/bin/diloco
echo "[xla-env] ready: .venv-xla (torch_xla from $DEPS)" >&2
echo "$ROOT/.venv-xla"
