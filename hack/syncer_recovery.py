"""Kill -> serving and kill -> first merge after each syncer fault of a `diloco local` run under `diloco chaos`
(the arithmetic of `diloco bench --only syncer_recovery`). Usage: python hack/syncer_recovery.py RUN_DIR"""

import statistics
import sys
from pathlib import Path

from diloco_bench.syncer_recovery import kills_of, recovery_times

run = Path(sys.argv[1])
kills = [k for record in sorted((run / "chaos").glob("*.jsonl")) for k in kills_of(record)]
times = recovery_times(run, kills)


def fmt(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.2f} s, max {max(xs):.2f} s ({', '.join(f'{x:.2f}' for x in xs)})" if xs \
        else "-"


print(f"kills {len(kills)}")
print(f"kill -> serving: {fmt(times['to_serving_s'])}")
print(f"kill -> first merge: {fmt(times['to_merge_s'])}")
