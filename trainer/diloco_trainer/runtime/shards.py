"""The local runtime's view of a sharded syncer (`diloco local --syncer-shards N`): one supervised child per shard
(`syncer-0` ... `syncer-{N-1}`, each with its own state directory and warm standby), read as one syncer.

`merge_statuses` is pure: the shards' /v1/status documents as the one status the progress display, syncer.jsonl and
goodput already read (each shard reports only the fragments it owns, so the per-fragment maps are disjoint).
"""

from __future__ import annotations

import json
from pathlib import Path

from diloco_trainer.protocol.messages import IncarnationWork, LearnerStatus, SyncerStatus
from diloco_trainer.runtime.syncer_client import SyncerClient

_SUMMED = ("tokens_merged", "steps_merged", "submissions_merged")


def merge_lives(a: list[IncarnationWork], b: list[IncarnationWork]) -> list[IncarnationWork]:
    """One learner's lives over two shards: each shard merged only its own fragments (summed); what a life trained
    is what its latest heartbeat to either said."""
    lives = {w.id: w.model_copy() for w in a}
    for w in b:
        have = lives.get(w.id)
        if have is None:
            lives[w.id] = w.model_copy()
            continue
        latest = w if w.last_seen > have.last_seen else have
        lives[w.id] = latest.model_copy(update={
            "first_seen": min(have.first_seen, w.first_seen), "steps_merged": have.steps_merged + w.steps_merged,
            "tokens_merged": have.tokens_merged + w.tokens_merged})
    return sorted(lives.values(), key=lambda w: w.first_seen)


def syncer_names(shards: int) -> list[str]:
    """Child names: "syncer" for an unsharded run (as always), "syncer-<i>" per shard otherwise."""
    return ["syncer"] if shards == 1 else [f"syncer-{i}" for i in range(shards)]


def merge_statuses(statuses: list[SyncerStatus]) -> SyncerStatus:
    """One status for the shards that answered: maps united, counters summed, a learner live if any shard sees it,
    its merged work summed over the shards; grace the longest, uptime the shortest."""
    assert statuses
    learners: dict[str, LearnerStatus] = {}
    for s in statuses:
        for lid, ls in s.learners.items():
            have = learners.get(lid)
            if have is None:
                learners[lid] = ls.model_copy()
                continue
            merged = {k: getattr(have, k) + getattr(ls, k) for k in _SUMMED}
            newer = ls if (ls.last_seen or 0) > (have.last_seen or 0) else have
            learners[lid] = newer.model_copy(update={**merged, "live": have.live or ls.live,
                                                     "incarnations": merge_lives(have.incarnations, ls.incarnations)})
    first = statuses[0]
    uptimes = [s.uptime_s for s in statuses if s.uptime_s is not None]
    checkpoints = [s.last_checkpoint for s in statuses if s.last_checkpoint is not None]
    return SyncerStatus(
        versions={p: v for s in statuses for p, v in s.versions.items()},
        outer_steps=sum(s.outer_steps for s in statuses),
        outer_steps_per_fragment={p: n for s in statuses for p, n in s.outer_steps_per_fragment.items()},
        merges=sum(s.merges for s in statuses),
        contributions_merged=sum(s.contributions_merged for s in statuses),
        tokens_merged=sum(s.tokens_merged for s in statuses),
        learners=dict(sorted(learners.items())),
        live_learners=sum(1 for ls in learners.values() if ls.live),
        pending={p: n for s in statuses for p, n in s.pending.items()},
        grace_s=max(s.grace_s for s in statuses),
        quorum=first.quorum,
        fragments=first.fragments,
        shard=0,
        shards=first.shards,
        owned=sorted(p for s in statuses for p in s.owned),
        uptime_s=min(uptimes) if uptimes else None,
        last_checkpoint=min(checkpoints) if checkpoints else None,
    )


class ShardsClient:
    """The supervisor's blocking client of every shard, with SyncerClient's interface for the run session."""

    def __init__(self, urls: list[str], token: str, ca: Path | None = None):
        self.clients = [SyncerClient(u, token, ca=ca) for u in urls]
        self.up: list[bool] = [False] * len(urls)  # which shards answered the last status()

    def status(self) -> SyncerStatus | None:
        """The merged status of the shards that answer (None if none does); `up` says which did."""
        answers = [c.status() for c in self.clients]
        self.up = [a is not None for a in answers]
        got = [a for a in answers if a is not None]
        return merge_statuses(got) if got else None

    def state_bytes(self) -> bytes | None:
        """All of Θ from every shard as one safetensors document, or None unless every shard answers."""
        from diloco_trainer.protocol.wire import decode_tensors, encode_tensors  # torch: only when Θ is fetched

        parts = [c.state_bytes() for c in self.clients]
        if any(p is None for p in parts):
            return None
        tensors: dict = {}
        for part in parts:
            tensors |= decode_tensors(part)[0]
        return encode_tensors(tensors, {})

    def metrics_texts(self) -> list[str | None]:
        return [c.metrics_text() for c in self.clients]


def merge_checkpoint_states(states: list[dict]) -> dict:
    """The shards' checkpoint state.json documents as one (what summary.py reads): per-fragment maps united, merged
    counters summed, per learner too."""
    learners: dict[str, dict] = {}
    for st in states:
        for lid, d in (st.get("learners") or {}).items():
            have = learners.setdefault(lid, {**{k: 0 for k in _SUMMED}, "lives": []})
            for k in _SUMMED:
                have[k] += int(d.get(k, 0))
            lives = [IncarnationWork.model_validate(w) for w in d.get("lives") or []]
            have["lives"] = [w.model_dump() for w in merge_lives(
                [IncarnationWork.model_validate(w) for w in have["lives"]], lives)]
    merged = {k: {p: v for st in states for p, v in (st.get(k) or {}).items()} for k in ("versions", "outer_steps")}
    return {**merged, "learners": learners, "tokens_merged": sum(int(st.get("tokens_merged", 0)) for st in states),
            "contributions_merged": sum(int(st.get("contributions_merged", 0)) for st in states),
            "shards": len(states)}


class StandbyGroup:
    """One warm standby per shard (runtime/standby.py) behind the supervisor's single `syncer_standby` slot: each
    takes over only its own shard's state directory (`take` matches the dead child's command line)."""

    def __init__(self, standbys: list):
        self.standbys = standbys

    def refill(self) -> None:
        for s in self.standbys:
            s.refill()

    def take(self, argv: list[str]):
        for s in self.standbys:
            proc = s.take(argv)
            if proc is not None:
                return proc
        return None

    def close(self) -> None:
        for s in self.standbys:
            s.close()

    @property
    def taken(self) -> int:
        return sum(s.taken for s in self.standbys)


def combine_final_checkpoints(shard_dirs: list[Path], final: Path) -> None:
    """final/theta.safetensors and state.json from every shard's last checkpoint, as one syncer would have written
    them; if a shard has none, final/ stays empty (the summary then has no final model to evaluate)."""
    from safetensors.torch import load_file, save_file

    from diloco_trainer.syncer.store import load_checkpoint

    theta, states = {}, []
    for d in shard_dirs:
        try:  # the shard's newest whole checkpoint: a damaged one is passed over, as its syncer would
            loaded = load_checkpoint(d)
        except ValueError:
            return
        if loaded is None:
            return
        theta |= load_file(str(loaded.path / "theta.safetensors"))
        states.append(json.loads((loaded.path / "state.json").read_text()))
    final.mkdir(parents=True, exist_ok=True)
    save_file(theta, str(final / "theta.safetensors"))
    (final / "state.json").write_text(json.dumps(merge_checkpoint_states(states)))
