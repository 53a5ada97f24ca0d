#!/usr/bin/env bash
# The images the end-to-end tests run, built on a machine without Docker Hub or any registry (root):
#   diloco.local/debian:bookworm   debootstrap --variant=minbase from the Debian mirror apt already uses
#   diloco.local/python:3.11       hack/base-python.Dockerfile: Debian's Python 3.11 in a venv, host CA bundle
#   diloco-trainer:TAG, diloco-operator:TAG (+ :dev and :VERSION, the version in pyproject.toml, which the
#   manifests/ name)   the project's Dockerfile on that base, torch from PyPI
# TAG is a hash of what goes into the images (Dockerfile, .dockerignore, requirements.lock, pyproject.toml,
# README.md, trainer/ operator/ chaos/ kube/ crds/ as in the working tree, the base image, the torch index), so an
# unchanged tree builds nothing. Both images are imported into containerd's k8s.io namespace for the kubelet.
# Progress goes to stderr; the last two lines of stdout are, for `eval "$(hack/build-images.sh | tail -n 2)"`:
#   DILOCO_TRAINER_IMAGE=diloco-trainer:TAG
#   DILOCO_OPERATOR_IMAGE=diloco-operator:TAG
# Environment: DILOCO_BUILD_NETWORK (docker build --network, default host), DILOCO_TORCH_INDEX (default pypi),
# DILOCO_DEBIAN_MIRROR (default: read from apt's sources), DILOCO_BUILD_TMP (scratch space, default /var/tmp),
# DILOCO_BUILD_XLA=1 (also diloco-trainer-xla:TAG, the Dockerfile's trainer-xla target: torch_xla's torch, libtpu;
# ~8 GB, not imported into containerd unless DILOCO_IMPORT_XLA=1; its tag is the third line from the end).
set -euo pipefail
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"
cd "$(dirname "$0")/.."
ROOT=$(pwd)

DEBIAN_IMAGE=diloco.local/debian:bookworm
PYTHON_IMAGE=diloco.local/python:3.11
NETWORK=${DILOCO_BUILD_NETWORK:-host}
TORCH_INDEX=${DILOCO_TORCH_INDEX:-pypi}
CONTEXT_PATHS=(Dockerfile .dockerignore requirements.lock requirements-xla.lock pyproject.toml README.md trainer operator
               chaos kube crds)
export DOCKER_BUILDKIT=0

T0=$(date +%s)
log() { printf '[build-images %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f s", b-a}'; }
size_of() { docker image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1/1e6}'; }
have_image() { docker image inspect "$1" >/dev/null 2>&1; }
# containerd's name for an image docker saved: docker.io/library/NAME:TAG unless NAME has a registry domain
ctr_name() {
  local first=${1%%/*}
  if [ "$first" != "$1" ] && { [[ $first == *.* || $first == *:* ]] || [ "$first" = localhost ]; }; then echo "$1"
  elif [ "$first" != "$1" ]; then echo "docker.io/$1"
  else echo "docker.io/library/$1"; fi
}
# grep reads the whole list (no -q): a grep that exits at its match makes ctr's next line's write fail (SIGPIPE), and
# under pipefail the image then counted as missing (3 of 40 checks): 4-5 min of importing 6.4 GB again for nothing.
in_k8s_io() { ctr -n k8s.io images ls -q 2>/dev/null | grep -xF "$(ctr_name "$1")" >/dev/null; }

[ "$(id -u)" = 0 ] || die "run as root (debootstrap, the container engine)"

# One build at a time: a whole-suite ./hack/test.sh starts one in the background, and the e2e tier's fixture runs
# this script again later; that second run waits here, then finds everything built and imported (seconds).
LOCK=${DILOCO_BUILD_TMP:-/var/tmp}/diloco-build-images.lock
exec 9>"$LOCK"
if ! flock -n 9; then
  log "another build holds $LOCK: waiting for it"
  flock 9
fi

s=$(now)
# fd 9 (the lock) closed for the engine: containerd and dockerd outlive this script and would hold the lock forever
bash hack/container-engine.sh up 9>&- >&2
log "container engine up ($(since "$s"))"

work=$(mktemp -d "${DILOCO_BUILD_TMP:-/var/tmp}/diloco-build.XXXXXX")
trap 'rm -rf "$work"' EXIT

debian_mirror() {
  if [ -n "${DILOCO_DEBIAN_MIRROR:-}" ]; then echo "$DILOCO_DEBIAN_MIRROR"; return; fi
  local m=""
  # deb822 sources: the URIs of a stanza whose Suites has plain "bookworm" (not -security)
  m=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '
        /^[[:space:]]*$/ { if (suite && uri) { print uri; exit } uri=""; suite=0; next }
        /^URIs:/ { uri=$2 }
        /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == "bookworm") suite=1 }
        END { if (suite && uri) print uri }' | head -n 1)
  # one-line sources
  [ -n "$m" ] || m=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
        | awk '$1=="deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { u=$i; s=$(i+1); break } if (s=="bookworm") { print u; exit } }')
  echo "${m:-http://deb.debian.org/debian}"
}

# ---------------------------------------------------------------------------- diloco.local/debian:bookworm
if have_image "$DEBIAN_IMAGE"; then
  log "$DEBIAN_IMAGE: cached ($(size_of "$DEBIAN_IMAGE"))"
else
  command -v debootstrap >/dev/null || die "debootstrap is missing (hack/container-engine.sh up installs it)"
  mirror=$(debian_mirror)
  log "$DEBIAN_IMAGE: debootstrap --variant=minbase bookworm from $mirror"
  s=$(now)
  debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log" >&2; die "debootstrap failed"; }
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\n' "$mirror" "$mirror" >"$work/rootfs/etc/apt/sources.list"
  rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"* "$work/rootfs/debootstrap"
  log "debootstrap done ($(since "$s")), rootfs $(du -sh "$work/rootfs" | cut -f1)"
  s=$(now)
  tar -C "$work/rootfs" -c . | docker import --change 'CMD ["bash"]' - "$DEBIAN_IMAGE" >/dev/null
  rm -rf "$work/rootfs"
  log "$DEBIAN_IMAGE: imported ($(since "$s"), $(size_of "$DEBIAN_IMAGE"))"
fi

# ------------------------------------------------------------------------------- diloco.local/python:3.11
if have_image "$PYTHON_IMAGE"; then
  log "$PYTHON_IMAGE: cached ($(size_of "$PYTHON_IMAGE"))"
else
  log "$PYTHON_IMAGE: building (hack/base-python.Dockerfile)"
  s=$(now)
  mkdir -p "$work/base"
  cp hack/base-python.Dockerfile "$work/base/Dockerfile"
  cp /etc/ssl/certs/ca-certificates.crt "$work/base/host-ca-bundle.crt" 2>/dev/null \
    || die "no /etc/ssl/certs/ca-certificates.crt on this host (apt-get install ca-certificates)"
  docker build --network "$NETWORK" --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" -t "$PYTHON_IMAGE" "$work/base" \
    >"$work/base.log" 2>&1 || { tail -n 40 "$work/base.log" >&2; die "building $PYTHON_IMAGE failed"; }
  log "$PYTHON_IMAGE: built ($(since "$s"), $(size_of "$PYTHON_IMAGE"), $(docker run --rm "$PYTHON_IMAGE" python3 --version 2>&1))"
fi

# The local bases are not from a registry, so they have no registry digest: their content digest (the image ID, a
# sha256 of the image's config, which names every layer's digest) is what pins them. Logged for the build record.
log "base images by content digest: $DEBIAN_IMAGE $(docker image inspect --format '{{.Id}}' "$DEBIAN_IMAGE"), $PYTHON_IMAGE $(docker image inspect --format '{{.Id}}' "$PYTHON_IMAGE")"

# ------------------------------------------------------------------------------------------- the tag
content_hash() {
  {
    if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
      # tracked and untracked-but-not-ignored files, with their working-tree contents
      git ls-files -z --cached --others --exclude-standard -- "${CONTEXT_PATHS[@]}" | sort -zu \
        | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done \
        | xargs -0 -r sha256sum
    else
      find "${CONTEXT_PATHS[@]}" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 2>/dev/null \
        | sort -z | xargs -0 -r sha256sum
    fi
    echo "base $(docker image inspect --format '{{.Id}}' "$PYTHON_IMAGE")"
    echo "torch-index $TORCH_INDEX"
  } | sha256sum | cut -c1-12
}
TAG=$(content_hash)
VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
log "content tag $TAG (also tagged dev and $VERSION)"

# ----------------------------------------------------------------------------- operator and trainer
build_target() {  # build_target TARGET IMAGE
  local target=$1 image=$2 s
  if have_image "$image:$TAG"; then
    log "$image:$TAG: already built ($(size_of "$image:$TAG"))"
  else
    log "$image:$TAG: building --target $target (log $work/$target.log)"
    s=$(now)
    docker build --network "$NETWORK" --build-arg BASE_IMAGE="$PYTHON_IMAGE" --build-arg TORCH_INDEX="$TORCH_INDEX" \
      --target "$target" -t "$image:$TAG" "$ROOT" >"$work/$target.log" 2>&1 \
      || { tail -n 40 "$work/$target.log" >&2; die "building $image:$TAG failed"; }
    log "$image:$TAG: built ($(since "$s"), $(size_of "$image:$TAG"))"
  fi
  docker tag "$image:$TAG" "$image:dev"
  docker tag "$image:$TAG" "$image:$VERSION"
}

import_k8s_io() {  # import_k8s_io IMAGE TAG: IMAGE:TAG into containerd's k8s.io namespace, plus :dev and :VERSION
  local image=$1 tag=$2 s
  if in_k8s_io "$image:$tag"; then
    log "$image:$tag: already in k8s.io"
  else
    log "$image:$tag: importing into containerd (k8s.io)"
    s=$(now)
    docker save "$image:$tag" | ctr -n k8s.io images import - >/dev/null
    log "$image:$tag: imported into k8s.io ($(since "$s"), $(size_of "$image:$tag") in docker)"
  fi
  for alias in dev "$VERSION"; do
    ctr -n k8s.io images tag --force "$(ctr_name "$image:$tag")" "$(ctr_name "$image:$alias")" >/dev/null
  done
}

build_target operator diloco-operator
build_target trainer diloco-trainer
import_k8s_io diloco-operator "$TAG"
import_k8s_io diloco-trainer "$TAG"

if [ "${DILOCO_BUILD_XLA:-0}" = 1 ]; then
  build_target trainer-xla diloco-trainer-xla
  [ "${DILOCO_IMPORT_XLA:-0}" = 1 ] && import_k8s_io diloco-trainer-xla "$TAG"
  log "done in $(( $(date +%s) - T0 )) s"
  echo "DILOCO_TRAINER_XLA_IMAGE=diloco-trainer-xla:$TAG"
else
  log "done in $(( $(date +%s) - T0 )) s"
fi
echo "DILOCO_TRAINER_IMAGE=diloco-trainer:$TAG"
echo "DILOCO_OPERATOR_IMAGE=diloco-operator:$TAG"
