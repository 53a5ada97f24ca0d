# Sourced by hack/build-helm.sh and hack/build-kueue.sh: one build of a binary at a time, and a build that someone
# waits for runs at full priority.
#
#   wait_for_build LOCK_FILE NAME
#
# takes LOCK_FILE (held until the calling script exits; the build's own processes inherit it). A whole-suite
# ./hack/test.sh starts these builds in the background at a low priority (nice), so that they use the CPU the tests
# leave idle; a test that needs the binary before that build is done runs the same script, which waits here — and
# since the build is now what a test waits for, it renices the build's process group (recorded in LOCK_FILE.pgid)
# back to 0 first (allowed as root, as in CI; otherwise it just waits).
wait_for_build() {
  local lock=$1 name=$2 pgid
  exec 8>>"$lock"  # append, not truncate: the file is only a lock
  if ! flock -n 8; then
    pgid=$(cat "$lock.pgid" 2>/dev/null || true)
    if [ -n "$pgid" ] && renice -n 0 -g "$pgid" >/dev/null 2>&1; then
      printf '[%s %s] a build in progress (process group %s) holds %s: raised to priority 0, waiting for it\n' \
        "$name" "$(date +%H:%M:%S)" "$pgid" "$lock" >&2
    else
      printf '[%s %s] a build in progress holds %s: waiting for it\n' "$name" "$(date +%H:%M:%S)" "$lock" >&2
    fi
    flock 8
  fi
  ps -o pgid= -p $$ | tr -d ' ' > "$lock.pgid"
}
