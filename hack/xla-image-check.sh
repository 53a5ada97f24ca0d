#!/usr/bin/env bash
# A learner from the trainer-xla image trains on torch_xla's CPU device (PJRT_DEVICE=CPU) against a syncer run from
# this checkout's main environment (the project's torch), over loopback: the image imports torch_xla, trains,
# adopts merged versions and speaks the same wire format. Root; the image comes from
#   DILOCO_BUILD_XLA=1 hack/build-images.sh        (its tag: the DILOCO_TRAINER_XLA_IMAGE line)
# Usage: hack/xla-image-check.sh IMAGE [STEPS]     (prints the learner's last metrics record and the syncer's view)
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${1:?usage: hack/xla-image-check.sh IMAGE [STEPS]}
STEPS=${2:-32}
PY=.venv/bin/python
[ -x "$PY" ] || bash hack/setup.sh >&2
work=$(mktemp -d)
syncer=""
trap '[ -n "$syncer" ] && kill "$syncer" 2>/dev/null && wait "$syncer" 2>/dev/null; rm -rf "$work"' EXIT
cat >"$work/run.yaml" <<EOF
model: tiny
data: {max_bytes: 200000}
inner: {batch_size: 8, warmup_steps: 5}
outer: {fragments: 4, sync_every: 8, compression: int4}
EOF
port=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
DILOCO_TOKEN=$(head -c 24 /dev/urandom | base64 | tr -d '=+/')
export DILOCO_TOKEN
PYTHONPATH=trainer $PY -m diloco_trainer.cli syncer --config "$work/run.yaml" --host 127.0.0.1 --port "$port" \
  --state-dir "$work/syncer" >"$work/syncer.log" 2>&1 &
syncer=$!
for _ in $(seq 120); do
  curl -fs "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && break
  kill -0 "$syncer" 2>/dev/null || { cat "$work/syncer.log" >&2; exit 1; }
  sleep 0.5
done
mkdir -m 0777 "$work/learner"  # the image runs as UID 10001
echo "[xla-image-check] $IMAGE: learner --device xla, $STEPS steps, against the syncer on :$port" >&2
start=$(date +%s)
docker run --rm --network host -e PJRT_DEVICE=CPU -e DILOCO_TOKEN -v "$work/learner:/state" "$IMAGE" \
  diloco learner --syncer "http://127.0.0.1:$port" --learner-id xla-image --state-dir /state --steps "$STEPS" \
  --device xla --log-every 8 >&2
echo "[xla-image-check] the container ran $(( $(date +%s) - start )) s" >&2
$PY - "$work/learner/metrics.jsonl" "http://127.0.0.1:$port" <<'EOF'
import json, os, sys, urllib.request
final = [json.loads(l) for l in open(sys.argv[1]) if l.strip()][-1]
keys = ("step", "sent", "acked", "rejected", "adoptions", "versions", "xla_compiles", "xla_executions")
print("learner:", json.dumps({k: final.get(k) for k in keys}))
req = urllib.request.Request(sys.argv[2] + "/v1/status", headers={"Authorization": "Bearer " + os.environ["DILOCO_TOKEN"]})
mine = json.load(urllib.request.urlopen(req))["learners"]["xla-image"]
print("syncer:", json.dumps({k: mine.get(k) for k in ("device", "submissions_merged", "tokens_merged")}))
assert final["acked"] == final["sent"] > 0 and final["rejected"] == 0 and mine["device"].startswith("xla"), (final, mine)
EOF
