"""Kill -> serving and kill -> first merge after each syncer fault of a `diloco local` run under `diloco chaos`.

Usage: python hack/syncer_recovery.py RUN_DIR. Kill times from the chaos record (RUN/chaos/*.jsonl); serving times from
RUN/syncer/incarnations.jsonl, or, for runs before it existed, from the "state loaded" lines of logs/syncer.log; merge
times from the syncer log's "merged N contributions" lines."""

import datetime
import json
import re
import statistics
import sys
from pathlib import Path

run = Path(sys.argv[1])
kills = [json.loads(line) for f in sorted((run / "chaos").glob("*.jsonl")) for line in f.read_text().splitlines()]
kills = [e["back_at"] for e in kills if e.get("event") == "fault" and not e.get("dry_run")]
log = (run / "logs" / "syncer.log").read_text().splitlines()


def stamp(line: str) -> float | None:
    m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line)
    if not m:
        return None
    return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


inc = run / "syncer" / "incarnations.jsonl"
if inc.exists():
    serving = sorted(json.loads(line)["serving_at"] for line in inc.read_text().splitlines())
else:  # listening follows "state loaded" within milliseconds
    serving = sorted(t for line in log if "state loaded" in line and (t := stamp(line)) is not None)
merges = sorted(t for line in log if "merged" in line and "contributions" in line and (t := stamp(line)) is not None)
to_serve, to_merge = [], []
for k in kills:
    s = next((t for t in serving if t > k), None)
    m = next((t for t in merges if t > k), None)
    if s is not None:
        to_serve.append(s - k)
    if m is not None:
        to_merge.append(m - k)


def fmt(xs):
    return f"median {statistics.median(xs):.2f} s, max {max(xs):.2f} s ({', '.join(f'{x:.2f}' for x in xs)})" if xs \
        else "-"


print(f"kills {len(kills)}")
print(f"kill -> serving: {fmt(to_serve)}")
print(f"kill -> first merge: {fmt(to_merge)}")
