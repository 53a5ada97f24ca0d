"""Kill -> serving and kill -> first merge after each syncer fault of a `diloco local` run under `diloco chaos`
(the arithmetic of `diloco bench --only syncer_recovery`); for a sharded run (`syncer-0`, `syncer-1`, ...), each
kill is measured on the shard it hit, and the figures are also given per shard.
Usage: python hack/syncer_recovery.py RUN_DIR"""

import statistics
import sys
from pathlib import Path

from diloco_bench.syncer_recovery import kills_of, recovery_times

run = Path(sys.argv[1])
kills = [k for record in sorted((run / "chaos").glob("*.jsonl")) for k in kills_of(record)]


def fmt(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.2f} s, max {max(xs):.2f} s ({', '.join(f'{x:.2f}' for x in xs)})" if xs \
        else "-"


def show(kills: list, indent: str = "") -> None:
    times = recovery_times(run, kills)
    print(f"{indent}kill -> serving: {fmt(times['to_serving_s'])}")
    print(f"{indent}kill -> first merge: {fmt(times['to_merge_s'])}")


print(f"kills {len(kills)}")
show(kills)
units = sorted({k.unit for k in kills})
if units != ["syncer"]:  # a sharded run: the same per shard
    for unit in units:
        mine = [k for k in kills if k.unit == unit]
        print(f"{unit}: kills {len(mine)}")
        show(mine, "  ")
