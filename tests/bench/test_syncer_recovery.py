"""The syncer recovery benchmark's arithmetic (bench/diloco_bench/syncer_recovery.py) on run directories written the
way `diloco local` and `diloco chaos` write theirs, and its summary and plot from known figures."""

import json
import time

from diloco_bench import report, syncer_recovery

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = time.mktime(time.strptime("2026-11-25 00:00:00", "%Y-%m-%d %H:%M:%S"))


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f",{int(round((t % 1) * 1000)):03d}"


def _run_dir(tmp_path, incarnations: bool):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "syncer").mkdir()
    kills = [T0 + 20.0, T0 + 35.0]
    log = [f"{_stamp(T0 + 1.0)} INFO diloco.syncer: state loaded from x in 0.05 s: versions [0], 0 pending",
           f"{_stamp(T0 + 10.0)} INFO diloco_trainer.syncer.app: fragment 0: merged 3 contributions from [] -> v",
           f"{_stamp(T0 + 26.5)} INFO diloco.syncer: state loaded from x in 0.05 s: versions [1], 0 pending",
           f"{_stamp(T0 + 27.0)} INFO diloco_trainer.syncer.app: fragment 0: merged 1 contributions from [] -> v",
           f"{_stamp(T0 + 35.4)} INFO diloco.syncer: state loaded from x in 0.05 s: versions [2], 0 pending",
           f"{_stamp(T0 + 38.0)} INFO diloco_trainer.syncer.app: fragment 1: merged 2 contributions from [] -> v"]
    (run / "logs" / "syncer.log").write_text("\n".join(log) + "\n")
    if incarnations:  # these win over the log lines: serving 0.3 s and 0.5 s after the kills
        lines = [{"pid": 1, "serving_at": T0 + 1.1}, {"pid": 2, "serving_at": kills[0] + 0.3},
                 {"pid": 3, "serving_at": kills[1] + 0.5}]
        (run / "syncer" / "incarnations.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    record = tmp_path / "chaos.jsonl"
    events = [{"event": "experiment", "time": T0}] + [
        {"event": "fault", "time": k, "back_at": k, "unit": "syncer", "dry_run": False} for k in kills] + [
        {"event": "fault", "time": T0 + 50, "back_at": T0 + 50, "unit": "syncer", "dry_run": True}]
    record.write_text("".join(json.dumps(e) + "\n" for e in events))
    return run, record


def test_kill_to_serving_and_to_first_merge_from_the_log_of_a_syncer_without_incarnations(tmp_path):
    run, record = _run_dir(tmp_path, incarnations=False)
    kills = syncer_recovery.kills_of(record)
    assert kills == [("syncer", T0 + 20.0), ("syncer", T0 + 35.0)]  # the dry-run fault is not a kill
    t = syncer_recovery.recovery_times(run, kills)
    assert [round(x, 3) for x in t["to_serving_s"]] == [6.5, 0.4]
    assert [round(x, 3) for x in t["to_merge_s"]] == [7.0, 3.0]


def test_incarnations_give_the_serving_times_when_the_syncer_wrote_them(tmp_path):
    run, record = _run_dir(tmp_path, incarnations=True)
    t = syncer_recovery.recovery_times(run, syncer_recovery.kills_of(record))
    assert [round(x, 3) for x in t["to_serving_s"]] == [0.3, 0.5]


def test_each_kill_of_a_sharded_run_is_measured_on_the_shard_it_hit(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    serving = {"syncer-0": [T0 + 1.0, T0 + 20.6], "syncer-1": [T0 + 1.0, T0 + 35.9]}
    merges = {"syncer-0": [T0 + 21.0, T0 + 36.0], "syncer-1": [T0 + 25.0, T0 + 37.5]}
    for unit in serving:
        (run / unit).mkdir()
        (run / unit / "incarnations.jsonl").write_text("".join(json.dumps({"serving_at": t}) + "\n"
                                                               for t in serving[unit]))
        (run / "logs" / f"{unit}.log").write_text("".join(
            f"{_stamp(t)} INFO diloco_trainer.syncer.app: fragment 0: merged 1 contributions from [] -> v\n"
            for t in merges[unit]))
    record = tmp_path / "chaos.jsonl"
    events = [{"event": "fault", "time": T0 + 20, "back_at": T0 + 20, "unit": "syncer-0", "role": "syncer"},
              {"event": "fault", "time": T0 + 30, "back_at": T0 + 30, "unit": "learner-1", "role": "learner"},
              {"event": "fault", "time": T0 + 35, "back_at": T0 + 35, "unit": "syncer-1", "role": "syncer"}]
    record.write_text("".join(json.dumps(e) + "\n" for e in events))
    kills = syncer_recovery.kills_of(record)
    assert kills == [("syncer-0", T0 + 20), ("syncer-1", T0 + 35)]  # a learner's fault is no syncer kill
    t = syncer_recovery.recovery_times(run, kills)
    # syncer-1's own serving and merge, not syncer-0's (which merged at T0 + 36, 1 s after the kill of syncer-1)
    assert [round(x, 3) for x in t["to_serving_s"]] == [0.6, 0.9]
    assert [round(x, 3) for x in t["to_merge_s"]] == [1.0, 2.5]


def _figures(serving: list[float], merged: float, uptime: float) -> dict:
    return {"standby": True, "kills": len(serving), "to_serving_s": syncer_recovery._stats(serving),
            "to_merge_s": syncer_recovery._stats([s + 1 for s in serving]), "merged_fraction": merged,
            "uptime": uptime, "stall_threshold_s": 3.0, "uptime_fixed": uptime, "goodput": 0.7, "load": [1.0, 2.0]}


def test_targets_and_plot_from_known_figures(tmp_path):
    result = report.new_result(syncer_recovery.NAME, "tiny")
    cold, warm = _figures([7.0, 9.4], 0.58, 0.18), _figures([0.4, 0.7], 0.9, 0.8)
    result["figures"] = {"cold": cold, "standby": warm, "experiment": "x", "fixed_stall_s": 6.0}
    syncer_recovery._summarize(result, cold, warm)
    met = {t["claim"].split(": ")[-1]: t["met"] for t in result["targets"]}
    assert met == {"serving again": True, "trained steps merged": True, "system uptime": False}
    assert any("0.067×" in n for n in result["notes"])  # standby / cold median: 0.55 s / 8.2 s
    path = syncer_recovery.plot(result, tmp_path / "syncer_recovery.png")
    assert path.read_bytes()[:8] == PNG_MAGIC
