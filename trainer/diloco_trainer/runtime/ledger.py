"""The ledger of a decoupled run: where every trained step ended (docs/protocol.md, Ledger). Pure arithmetic over
what the learners wrote (learners/<id>/ledger/<life>.json, learner/loop.py) and what the syncer merged (its final
state: per learner, and per life for its last LIVES_KEPT lives).

Units are fragment-steps: an inner step trains every one of the P fragments, and the syncer counts merged steps per
fragment submission, so trained = P · steps. The buckets:

- merged: the syncer merged it into a global version;
- discarded: an adoption overwrote it (the τ overlap of outer.adopt=overwrite);
- refused: the syncer refused its Δ (stale 409, or another non-2xx answer), or acknowledged it and never merged it
  (dropped at the syncer: acknowledged − merged of a life, where positive);
- lost: trained by a life that died (no final ledger: SIGKILL, a crash) and neither merged, discarded nor refused;
- unsent: trained by a life that stopped cleanly and covered by no Δ merged by the end (never sent, or in flight
  when it stopped and never merged; with outer.adopt=keep, also steps riding on a version it left before);
- unaccounted: trained − the buckets above: 0 unless a life's own books do not add up (or the syncer merged work
  of a life the learners left no ledger of). A negative bucket is never reported: what would make one shows here.

A life the syncer no longer lists (it keeps the last LIVES_KEPT) has its merged steps taken from the learner's
total less those of the lives it lists, pooled with the other unlisted lives.
"""

from __future__ import annotations

import json
from pathlib import Path

BUCKETS = ("merged", "discarded", "refused", "lost", "unsent")


def read_lives(learner_dir: Path) -> list[dict]:
    """A learner's lives' last ledger documents (learners/<id>/ledger/<life>.json), oldest first."""
    lives = []
    for path in sorted((learner_dir / "ledger").glob("*.json")):
        try:
            lives.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # a torn file cannot be: it is written aside and renamed
            continue
    return sorted(lives, key=lambda d: d.get("time", 0.0))


def _life_ledger(lives: list[dict], merged: int) -> dict[str, int]:
    """One life's buckets (or a pool of lives, counted as dead if any died) given what the syncer merged of it."""
    get = lambda k: sum(int(d.get(k, 0)) for d in lives)  # noqa: E731
    trained = sum(int(d.get("steps", 0)) * int(d.get("fragments", 1)) for d in lives)
    acked, discarded = get("acked"), get("discarded")
    dropped = max(0, acked - merged)  # acknowledged and never merged: dropped at the syncer
    out = {"trained": trained, "merged": merged, "discarded": discarded,
           "refused_stale": get("refused_stale"), "refused_other": get("refused_other"), "dropped": dropped,
           "lost": 0, "unsent": 0, "in_flight_merged": 0}
    refused = out["refused_stale"] + out["refused_other"] + dropped
    if lives and all(d.get("final") for d in lives):
        late = max(0, merged - acked)  # in flight when it stopped, merged afterwards (or resent by the next life)
        out["in_flight_merged"] = late
        out["unsent"] = get("in_flight") + get("unsent") - late
    else:
        out["lost"] = trained - merged - discarded - refused
    for k in ("lost", "unsent"):  # never negative: what would make it so stays unaccounted (trained − buckets)
        out[k] = max(0, out[k])
    return out


def learner_ledger(lives: list[dict], steps_merged: int, merged_by_life: dict[str, int]) -> dict[str, int]:
    """A learner's ledger from its lives' documents, the syncer's merged total and what it lists per life."""
    listed = [d for d in lives if d.get("life") in merged_by_life]
    pooled = [d for d in lives if d.get("life") not in merged_by_life]
    parts = [_life_ledger([d], merged_by_life[d["life"]]) for d in listed]
    rest = steps_merged - sum(merged_by_life[d["life"]] for d in listed)
    if pooled or rest:
        parts.append(_life_ledger(pooled, rest))
    keys = ("trained", "merged", "discarded", "refused_stale", "refused_other", "dropped", "lost", "unsent",
            "in_flight_merged")
    out = {k: sum(p[k] for p in parts) for k in keys}
    # A refused resend of a previous life's unsent work: that life's lost (or unsent) work, refused.
    resent = {k: sum(int(d.get(f"resent_refused_{k}", 0)) for d in lives) for k in ("stale", "other")}
    for k, n in resent.items():
        from_lost = min(n, max(0, out["lost"]))
        out["lost"] -= from_lost
        out["unsent"] -= n - from_lost
        out[f"refused_{k}"] += n
    return out


def _finish(raw: dict[str, int]) -> dict:
    """Buckets as reported: refused summed over its classes, none negative, the remainder unaccounted, shares."""
    refused = raw["refused_stale"] + raw["refused_other"] + raw["dropped"]
    buckets = {"merged": raw["merged"], "discarded": raw["discarded"], "refused": refused, "lost": raw["lost"],
               "unsent": raw["unsent"]}
    buckets = {k: max(0, v) for k, v in buckets.items()}
    trained = raw["trained"]
    out = {"trained": trained, **buckets, "unaccounted": trained - sum(buckets.values())}
    out["share"] = {k: v / trained if trained else None for k, v in buckets.items()}
    out["refused_by_class"] = {"stale": raw["refused_stale"], "other": raw["refused_other"],
                               "dropped": raw["dropped"]}
    out["in_flight_merged"] = raw["in_flight_merged"]
    return out


def run_ledger(run_dir: Path, merged: dict[str, dict]) -> dict | None:
    """The run's ledger (summary.json `ledger`): totals, shares and per learner, from the learners' ledger files and
    the syncer's merged figures `merged` ({id: {steps_merged, lives: [{id, steps_merged}]}}); None when no learner
    left a ledger (a synchronous baseline, a run from before the ledger)."""
    learners_dir = run_dir / "learners"
    names = {p.name for p in learners_dir.iterdir() if p.is_dir()} if learners_dir.is_dir() else set()
    per = {}
    for name in sorted(names | set(merged)):
        lives = read_lives(learners_dir / name)
        m = merged.get(name, {})
        if not lives and not m.get("steps_merged"):
            continue
        by_life = {str(w["id"]): int(w.get("steps_merged", 0)) for w in m.get("lives") or []}
        per[name] = learner_ledger(lives, int(m.get("steps_merged", 0)), by_life)
    if not per:
        return None
    total = {k: sum(v[k] for v in per.values()) for k in next(iter(per.values()))}
    return {**_finish(total), "per_learner": {n: _finish(v) for n, v in per.items()}}


def ledger_line(ledger: dict) -> str:
    """The printed summary's line: each bucket with its share of the trained fragment-steps."""
    trained = ledger["trained"]
    parts = [f"{k} {ledger[k]:,} ({100 * ledger[k] / trained:.1f}%)" if trained else f"{k} {ledger[k]:,}"
             for k in BUCKETS]
    c = ledger.get("refused_by_class") or {}
    refused = f" [refused: stale {c.get('stale', 0):,}, other {c.get('other', 0):,}, dropped {c.get('dropped', 0):,}]"
    return (f"ledger (fragment-steps): trained {trained:,} = " + " + ".join(parts)
            + f" + unaccounted {ledger['unaccounted']:,}" + (refused if ledger["refused"] else ""))
