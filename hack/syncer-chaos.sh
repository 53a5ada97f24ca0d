#!/usr/bin/env bash
# Issue 12's syncer check: 3 learners under `diloco local`, the syncer SIGKILLed every 15 s (6 kills), then
# goodput, system uptime and the kill -> serving times. Usage: hack/syncer-chaos.sh RUN_DIR [diloco local flags...]
set -euo pipefail
run_dir=$1; shift
here=$(cd "$(dirname "$0")/.." && pwd)
diloco="$here/.venv/bin/diloco"
"$diloco" local --learners 3 --run-dir "$run_dir" --steps 100000 --minutes 3 --plain "$@" > "$run_dir.local.log" 2>&1 &
local_pid=$!
for _ in $(seq 600); do [ -f "$run_dir/syncer/endpoint.json" ] && break; sleep 0.2; done
"$diloco" chaos run "$here/chaos/examples/syncer-dies-every-15s.yaml" --run-dir "$run_dir" > "$run_dir.chaos.log" 2>&1
wait "$local_pid" || true
"$diloco" chaos goodput "$run_dir"
"$here/.venv/bin/python" "$here/hack/syncer_recovery.py" "$run_dir"
