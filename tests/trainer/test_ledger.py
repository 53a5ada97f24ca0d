"""The run's ledger (runtime/ledger.py): where every trained fragment-step ended, from the learners' ledger files and
what the syncer merged of each life."""

from __future__ import annotations

import json

from diloco_trainer.runtime.ledger import BUCKETS, learner_ledger, ledger_line, run_ledger


def life(name, steps, final, P=4, **counts):
    return {"life": name, "time": float(len(name)), "steps": steps, "fragments": P, "final": final,
            **{k: counts.get(k, 0) for k in ("acked", "discarded", "refused_stale", "refused_other", "in_flight",
                                              "unsent")}, **{k: v for k, v in counts.items() if k.startswith("resent")}}


def exact(ledger):
    return ledger["trained"] == sum(ledger[k] for k in BUCKETS) + ledger["unaccounted"]


def test_a_clean_life_whose_books_add_up_leaves_nothing_unaccounted_and_late_merges_leave_unsent():
    # 10 steps x 4 fragments = 40: 20 acked, 12 discarded, 3 refused, 5 in flight at its stop (4 of them merged late)
    lv = life("a", 10, True, acked=20, discarded=12, refused_stale=3, in_flight=5)
    out = learner_ledger([lv], steps_merged=24, merged_by_life={"a": 24})
    assert (out["merged"], out["discarded"], out["refused_stale"], out["unsent"], out["lost"]) == (24, 12, 3, 1, 0)


def test_a_killed_lifes_work_that_is_neither_merged_discarded_nor_refused_is_lost():
    killed = life("a", 10, False, acked=20, discarded=8, refused_other=2, unsent=10)
    clean = life("bb", 5, True, acked=20, resent_refused_stale=3)
    out = learner_ledger([killed, clean], steps_merged=38, merged_by_life={"a": 18, "bb": 20})
    # The killed life: 40 − 18 merged − 8 discarded − (2 refused + 2 acked, never merged) = 10, of which the next
    # life resent 3 that the syncer refused as stale.
    assert (out["lost"], out["refused_stale"], out["refused_other"], out["dropped"]) == (7, 3, 2, 2)
    assert out["trained"] == 60 and out["merged"] == 38


def test_lives_the_syncer_no_longer_lists_share_what_it_merged_beyond_the_listed_ones(tmp_path):
    d = tmp_path / "learners" / "learner-0" / "ledger"
    d.mkdir(parents=True)
    for lv in (life("a", 5, False, acked=8), life("bb", 5, False, acked=8), life("ccc", 5, True, acked=20)):
        (d / f"{lv['life']}.json").write_text(json.dumps(lv))
    merged = {"learner-0": {"steps_merged": 40, "lives": [{"id": "ccc", "steps_merged": 20}]}}
    ledger = run_ledger(tmp_path, merged)
    assert ledger["trained"] == 60 and ledger["merged"] == 40 and ledger["lost"] == 20 and ledger["unaccounted"] == 0
    assert exact(ledger) and exact(ledger["per_learner"]["learner-0"])
    assert "unaccounted 0" in ledger_line(ledger)


def test_books_that_do_not_add_up_show_as_unaccounted_never_as_a_negative_bucket():
    lv = life("a", 10, True, acked=20)  # 40 trained, 20 booked: 20 missing
    out = run_ledger_of([lv], merged=20)
    assert out["unaccounted"] == 20 and min(out[k] for k in BUCKETS) >= 0
    killed = life("a", 2, False, acked=8)  # its last ledger says 8 trained, yet the syncer merged 12 of it
    out = run_ledger_of([killed], merged=12)
    assert out["lost"] == 0 and out["unaccounted"] == -4


def run_ledger_of(lives, merged):
    from diloco_trainer.runtime.ledger import _finish

    return _finish(learner_ledger(lives, merged, {lv["life"]: merged for lv in lives[:1]}))


def test_a_run_without_ledger_files_has_no_ledger(tmp_path):
    (tmp_path / "learners" / "learner-0").mkdir(parents=True)
    assert run_ledger(tmp_path, {}) is None


def test_the_live_line_shows_the_buckets_so_far_with_what_is_still_open():
    from diloco_trainer.runtime.progress import View, plain_line, render

    ledger = {"trained": 400, "merged": 200, "discarded": 100, "refused": 20, "lost": 80, "unsent": 0,
              "unaccounted": 0}
    view = View(title="t", elapsed_s=1.0, budget_s=None, ledger=ledger)
    line = plain_line(view)
    assert "ledger: trained 400 = merged 200 50% + discarded 100 25% + refused 20 5% + open 80 20%" in line
    assert render(view) is not None
    assert "ledger" not in plain_line(View(title="t", elapsed_s=1.0, budget_s=None))
    waiting = ledger | {"refused_by_class": {"stale": 5, "other": 0, "dropped": 15}}
    assert "refused 5 1% + open 95 24%" in plain_line(View(title="t", elapsed_s=1.0, budget_s=None, ledger=waiting)), \
        "acknowledged and not merged yet is open while the learner runs"
