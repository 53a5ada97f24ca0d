#!/usr/bin/env bash
# A container engine on a machine without systemd or registries: containerd (with its CRI plugin, for a
# real kubelet) and dockerd on top of the same containerd, plus the pod sandbox ("pause") image built from
# hack/pause.c. Idempotent.
#
#   hack/container-engine.sh up       install Debian's packages if missing (root), write the configs, start
#                                     what is not already running, import diloco.local/pause:3.10 into k8s.io
#   hack/container-engine.sh down     stop what `up` started (by recorded PID; dockerd first), nothing else
#   hack/container-engine.sh status   what runs, who started it; exit 0 only when containerd and dockerd answer
#
# State, configs and logs live in $DILOCO_ENGINE_DIR (default /var/lib/diloco-engine). A containerd or
# dockerd that already answers when `up` runs is used as it is and never stopped by `down`.
# Docker uses containerd's "moby" namespace, the kubelet "k8s.io"; images reach the kubelet with
# `docker save IMG | ctr -n k8s.io images import -`.
set -euo pipefail
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"  # dockerd, runc, debootstrap, iptables live in sbin

HACK=$(cd "$(dirname "$0")" && pwd)
STATE=${DILOCO_ENGINE_DIR:-/var/lib/diloco-engine}
CONTAINERD_SOCK=/run/containerd/containerd.sock
CNI_CONF=/etc/cni/net.d/10-diloco-bridge.conflist
PAUSE_IMAGE=diloco.local/pause:3.10
GRACE_S=${DILOCO_ENGINE_GRACE_S:-20}

log() { printf '[container-engine %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

ctr_() { ctr --address "$CONTAINERD_SOCK" "$@"; }
containerd_answers() { [ -S "$CONTAINERD_SOCK" ] && timeout 5 ctr --address "$CONTAINERD_SOCK" version >/dev/null 2>&1; }
docker_answers() { { [ -n "${DOCKER_HOST:-}" ] || [ -S /var/run/docker.sock ]; } && timeout 10 docker info >/dev/null 2>&1; }

# PID recorded in $STATE/NAME.pid if that process is alive and is NAME; empty otherwise.
our_pid() {
  local name=$1 f="$STATE/$1.pid" pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f" 2>/dev/null || true)
  if [ -n "$pid" ] && [ -d "/proc/$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ]; then
    echo "$pid"
  fi
}

# ---------------------------------------------------------------------------------------------- packages
APT_UPDATED=0
apt_install() {
  [ "$#" -gt 0 ] || return 0
  [ "$(id -u)" = 0 ] || die "missing packages ($*): run as root, or install them: apt-get install -y $*"
  command -v apt-get >/dev/null || die "missing packages ($*) and no apt-get on this machine"
  if [ "$APT_UPDATED" = 0 ]; then
    log "apt-get update"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    APT_UPDATED=1
  fi
  log "apt-get install $*"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >&2
}

ensure_packages() {
  local missing=()
  command -v containerd >/dev/null || missing+=(containerd)
  command -v ctr >/dev/null || missing+=(containerd)
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v docker >/dev/null || missing+=(docker.io)
  command -v runc >/dev/null || missing+=(runc)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  command -v iptables >/dev/null || missing+=(iptables)
  [ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/portmap ] && [ -x /usr/lib/cni/host-local ] \
    || missing+=(containernetworking-plugins)
  command -v gcc >/dev/null || missing+=(gcc libc6-dev)
  [ -f /usr/lib/x86_64-linux-gnu/libc.a ] || [ -n "$(find /usr/lib -maxdepth 3 -name libc.a -print -quit 2>/dev/null)" ] \
    || missing+=(libc6-dev)
  # shellcheck disable=SC2207
  [ "${#missing[@]}" -eq 0 ] || apt_install $(printf '%s\n' "${missing[@]}" | sort -u)
}

# ----------------------------------------------------------------------------------------------- configs
write_if_changed() {  # write_if_changed FILE  (content on stdin)
  local f=$1 tmp
  tmp=$(mktemp "$f.XXXXXX")
  cat >"$tmp"
  if [ -f "$f" ] && cmp -s "$tmp" "$f"; then rm -f "$tmp"; return 1; fi
  mv "$tmp" "$f"
  chmod 644 "$f"
}

write_configs() {
  mkdir -p "$STATE" /etc/cni/net.d
  # Version 2 format (containerd 1.6). Debian's /etc/containerd/config.toml is not used.
  write_if_changed "$STATE/containerd.toml" <<EOF && log "wrote $STATE/containerd.toml" || true
# Written by hack/container-engine.sh. containerd for dockerd ("moby" namespace) and a kubelet (CRI, "k8s.io").
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = []

[grpc]
  address = "$CONTAINERD_SOCK"

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "$PAUSE_IMAGE"
    # REQUIRED on VMs that withhold CAP_SYS_RESOURCE: otherwise runc fails every pod sandbox
    # ("can't get final child's PID from pipe: EOF") setting oom_score_adj below the current value.
    restrict_oom_score_adj = true
    enable_selinux = false
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = false
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "/etc/cni/net.d"
EOF
  # Debian's plugins (1.1.x) support CNI spec 1.0.0.
  write_if_changed "$CNI_CONF" <<'EOF' && log "wrote $CNI_CONF" || true
{
  "cniVersion": "1.0.0",
  "name": "diloco",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": true,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "10.88.0.0/16", "gateway": "10.88.0.1"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {
      "type": "portmap",
      "capabilities": {"portMappings": true}
    }
  ]
}
EOF
}

# ------------------------------------------------------------------------------------------------ daemons
# start_daemon NAME CMD...: runs CMD in its own session, logs to $STATE/NAME.log, records its PID.
start_daemon() {
  local name=$1; shift
  rm -f "$STATE/$name.pid"
  # the inner shell records its own PID, then becomes the daemon (exec keeps the PID)
  setsid bash -c 'echo $$ >"$0"; exec "$@"' "$STATE/$name.pid" "$@" \
    </dev/null >>"$STATE/$name.log" 2>&1 &
  local i
  for i in $(seq 50); do [ -s "$STATE/$name.pid" ] && break; sleep 0.1; done
  log "started $name (pid $(cat "$STATE/$name.pid" 2>/dev/null || echo '?'), log $STATE/$name.log)"
}

wait_for() {  # wait_for NAME CHECK_FN TIMEOUT_S
  local name=$1 check=$2 timeout=$3 start=$SECONDS
  until "$check"; do
    if [ -z "$(our_pid "$name")" ]; then
      tail -n 30 "$STATE/$name.log" >&2 || true
      die "$name exited during start-up (log: $STATE/$name.log)"
    fi
    [ $((SECONDS - start)) -lt "$timeout" ] || { tail -n 30 "$STATE/$name.log" >&2 || true; die "$name did not answer within ${timeout}s"; }
    sleep 0.5
  done
}

start_containerd() {
  if containerd_answers; then
    if [ -n "$(our_pid containerd)" ]; then log "containerd already running (ours, pid $(our_pid containerd))"
    else
      rm -f "$STATE/containerd.pid"
      log "containerd already running (not started by this script: used as it is, never stopped by down)"
      ctr_ plugins ls 2>/dev/null | grep 'io.containerd.grpc.v1 *cri .*ok' >/dev/null \
        || log "WARNING: that containerd's CRI plugin is not ok (a kubelet needs it; see: ctr plugins ls)"
    fi
    return
  fi
  [ "$(id -u)" = 0 ] || die "containerd does not answer on $CONTAINERD_SOCK and starting it needs root"
  if [ -n "$(our_pid containerd)" ]; then
    log "containerd (ours, pid $(our_pid containerd)) does not answer yet; waiting"
  else
    start_daemon containerd containerd --config "$STATE/containerd.toml"
  fi
  wait_for containerd containerd_answers 60
  log "containerd answers ($(ctr_ version 2>/dev/null | awk '/Server/{s=1} s&&/Version/{print $2; exit}'))"
  ctr_ plugins ls 2>/dev/null | grep 'io.containerd.grpc.v1 *cri .*ok' >/dev/null \
    || log "WARNING: containerd's CRI plugin is not ok (ctr plugins ls; log $STATE/containerd.log)"
}

start_dockerd() {
  if docker_answers; then
    if [ -n "$(our_pid dockerd)" ]; then log "dockerd already running (ours, pid $(our_pid dockerd))"
    else
      rm -f "$STATE/dockerd.pid"
      log "dockerd already running (not started by this script: used as it is, never stopped by down)"
    fi
    return
  fi
  [ "$(id -u)" = 0 ] || die "dockerd does not answer and starting it needs root"
  if [ -n "$(our_pid dockerd)" ]; then
    log "dockerd (ours, pid $(our_pid dockerd)) does not answer yet; waiting"
  else
    start_daemon dockerd dockerd --containerd="$CONTAINERD_SOCK" --pidfile "$STATE/dockerd.daemon.pid"
  fi
  wait_for dockerd docker_answers 90
  log "dockerd answers ($(docker version --format '{{.Server.Version}}' 2>/dev/null))"
}

# ------------------------------------------------------------------------------------------- pause image
ensure_pause_image() {
  # no grep -q: exiting at the match would SIGPIPE ctr, and pipefail would count the image missing (build-images.sh)
  if ctr_ -n k8s.io images ls -q 2>/dev/null | grep -xF "$PAUSE_IMAGE" >/dev/null; then return; fi
  if ! docker image inspect "$PAUSE_IMAGE" >/dev/null 2>&1; then
    log "building $PAUSE_IMAGE from hack/pause.c"
    local work
    work=$(mktemp -d "$STATE/pause.XXXXXX")
    mkdir -p "$work/rootfs"
    gcc -static -Os -o "$work/rootfs/pause" "$HACK/pause.c"
    strip "$work/rootfs/pause" 2>/dev/null || true
    tar -C "$work/rootfs" -c . | docker import --change 'ENTRYPOINT ["/pause"]' - "$PAUSE_IMAGE" >/dev/null
    rm -rf "$work"
  fi
  log "importing $PAUSE_IMAGE into containerd (namespace k8s.io)"
  docker save "$PAUSE_IMAGE" | ctr_ -n k8s.io images import - >/dev/null
  # the kubelet's image garbage collector must never delete the sandbox image
  ctr_ -n k8s.io images label "$PAUSE_IMAGE" io.cri-containerd.pinned=pinned >/dev/null 2>&1 || true
}

# ------------------------------------------------------------------------------------------------- down
stop_pid() {  # stop_pid NAME PID
  local name=$1 pid=$2 i
  log "stopping $name (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || return 0
  for i in $(seq $((GRACE_S * 5))); do
    [ -d "/proc/$pid" ] || { log "$name stopped"; return 0; }
    # a zombie is gone for our purposes
    [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" = Z ] && { log "$name stopped"; return 0; }
    sleep 0.2
  done
  log "$name did not stop within ${GRACE_S}s: SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
  for i in $(seq 25); do [ -d "/proc/$pid" ] || break; sleep 0.2; done
}

# Containers still running in our containerd (pods a kubelet left behind, docker containers): kill their
# tasks so that no shim outlives the engine.
kill_tasks() {
  local ns id
  for ns in $(ctr_ namespaces ls -q 2>/dev/null); do
    for id in $(ctr_ -n "$ns" tasks ls -q 2>/dev/null); do
      log "killing task $ns/$id"
      ctr_ -n "$ns" tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true
    done
    for id in $(ctr_ -n "$ns" tasks ls -q 2>/dev/null); do
      timeout 10 ctr_ -n "$ns" tasks delete -f "$id" >/dev/null 2>&1 || true
    done
  done
}

down() {
  local pid stopped=0
  pid=$(our_pid dockerd)
  if [ -n "$pid" ]; then stop_pid dockerd "$pid"; stopped=1; fi
  rm -f "$STATE/dockerd.pid"
  pid=$(our_pid containerd)
  if [ -n "$pid" ]; then
    containerd_answers && kill_tasks
    stop_pid containerd "$pid"; stopped=1
    # shims of our containerd whose tasks could not be deleted
    local shim
    for shim in $(pgrep -f "containerd-shim.* -address $CONTAINERD_SOCK" 2>/dev/null || true); do
      log "stopping leftover shim (pid $shim)"; kill -TERM "$shim" 2>/dev/null || true
    done
  fi
  rm -f "$STATE/containerd.pid"
  [ "$stopped" = 1 ] || log "nothing to stop (no containerd/dockerd started by this script is running)"
}

# ----------------------------------------------------------------------------------------------- status
status() {  # exit 0 only when both containerd and dockerd answer
  local pid ok=0
  if containerd_answers; then
    pid=$(our_pid containerd)
    echo "containerd: running ($([ -n "$pid" ] && echo "started by container-engine.sh, pid $pid" || echo "not started by container-engine.sh")), socket $CONTAINERD_SOCK"
    ctr_ plugins ls 2>/dev/null | awk '$2=="cri"{print "  CRI plugin: " $NF}'
    echo "  k8s.io images: $(ctr_ -n k8s.io images ls -q 2>/dev/null | grep -v '^sha256:' | tr '\n' ' ')"
    echo "  tasks: $(for ns in $(ctr_ namespaces ls -q 2>/dev/null); do printf '%s=%s ' "$ns" "$(ctr_ -n "$ns" tasks ls -q 2>/dev/null | wc -l)"; done)"
  elif [ -S "$CONTAINERD_SOCK" ]; then
    echo "containerd: socket $CONTAINERD_SOCK exists but does not answer$([ "$(id -u)" = 0 ] || echo ' (not root: permission?)')"
  else
    echo "containerd: not running"
  fi
  containerd_answers || ok=1
  if docker_answers; then
    pid=$(our_pid dockerd)
    echo "dockerd: running ($([ -n "$pid" ] && echo "started by container-engine.sh, pid $pid" || echo "not started by container-engine.sh")), server $(docker version --format '{{.Server.Version}}' 2>/dev/null)"
    echo "  containers running: $(docker ps -q 2>/dev/null | wc -l), images: $(docker images -q 2>/dev/null | sort -u | wc -l)"
  elif [ -S /var/run/docker.sock ]; then
    echo "dockerd: /var/run/docker.sock exists but does not answer$([ "$(id -u)" = 0 ] || echo ' (not root and not in group docker?)')"
  else
    echo "dockerd: not running"
  fi
  docker_answers || ok=1
  echo "state dir: $STATE"
  return "$ok"
}

case "${1:-}" in
  up)
    ensure_packages
    [ "$(id -u)" = 0 ] && write_configs
    start_containerd
    start_dockerd
    ensure_pause_image
    log "ready: containerd $CONTAINERD_SOCK (CRI), docker $(docker context inspect --format '{{.Endpoints.docker.Host}}' 2>/dev/null || echo unix:///var/run/docker.sock)"
    ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
