"""What reconciles read instead of the API server: kopf's indexes (filled by its own list + watch of jobs, units,
learner pods, syncer Deployments and Nodes), overlaid with the operator's own writes until the watch has caught
up with them (client-go's "mutation cache"), so a reconcile right after a write never acts on the state before it.

kopf runs no event handler before every index has its initial listing, and every reconcile is queued by an event
handler, so no reconcile ever reads a half-filled cache.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from diloco_kube.labels import LABEL_JOB, LABEL_SPARE, SPARE_WAITING

GONE = "gone"  # an overlay entry for an object the operator deleted and the watch still shows
OVERLAY_TTL_S = 30.0  # an unconfirmed write stops shadowing the watch after this (the watch always wins then)


def _rv(obj: Mapping | None) -> int:
    try:
        return int(((obj or {}).get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:  # resourceVersions are opaque by contract; etcd's are integers
        return 0


def _name(obj: Mapping) -> str:
    return obj["metadata"]["name"]


Key = tuple[str, str, str]  # (plural, namespace, name)


class Cache:
    """Lookups by the keys the index functions in handlers.py emit, merged with recent writes. The overlay is
    indexed by name, by label and by namespace, so a lookup looks only at the writes it may concern (not at every
    write of the last OVERLAY_TTL_S: with 1,000 units that would be thousands per reconcile)."""

    def __init__(self, indexes: Mapping[str, Mapping[Any, Iterable[dict]]]):
        self.indexes = indexes  # "jobs" | "units" | "pods" | "deployments" | "nodes" | "workloads" -> kopf.Index
        self.watches_nodes = "nodes" in indexes  # not with --no-watch-nodes (a namespaced install)
        self.watches_workloads = "workloads" in indexes  # Kueue's Workloads: only with --kueue
        # (plural, namespace, name) -> (object or GONE, resourceVersion the write produced/saw, when)
        self.overlay: dict[Key, tuple[dict | str, int, float]] = {}
        self.deleting: set[Key] = set()  # overlay entries that are the answer to a delete
        self._by_label: dict[tuple[str, str, str, str], set[str]] = {}  # (plural, ns, label, value) -> names
        self._by_ns: dict[tuple[str, str], set[str]] = {}  # (plural, ns) -> names
        self._unlabeled: dict[tuple[str, str], set[str]] = {}  # deletions of objects never seen: match any label
        self._labels: dict[Key, list[tuple[str, str]]] = {}
        self._swept = time.monotonic()
        # Deletions the watch delivered: key -> (resourceVersion of the deletion, when). A write answered before
        # its object's deletion but recorded after the watch delivered it is not made to shadow the watch again.
        self._tombstones: dict[Key, tuple[int, float]] = {}

    # --- writes ----------------------------------------------------------------------------------------------
    def _put(self, key: Key, entry: tuple[dict | str, int, float], labels: Mapping | None) -> None:
        self._drop(key)
        plural, ns, name = key
        self.overlay[key] = entry
        self._by_ns.setdefault((plural, ns), set()).add(name)
        if labels is None:
            self._unlabeled.setdefault((plural, ns), set()).add(name)
        else:
            self._labels[key] = [(k, str(v)) for k, v in labels.items()]
            for k, v in self._labels[key]:
                self._by_label.setdefault((plural, ns, k, v), set()).add(name)
        self._sweep(entry[2])

    def _sweep(self, now: float) -> None:
        """Entries no lookup asked for expire too (and the watch's deletions, past the same time)."""
        if now - self._swept > OVERLAY_TTL_S:
            self._swept = now
            for old in [k for k, (_, _, at) in self.overlay.items() if now - at > OVERLAY_TTL_S]:
                self._drop(old)
            for old in [k for k, (_, at) in self._tombstones.items() if now - at > OVERLAY_TTL_S]:
                del self._tombstones[old]

    def wrote(self, plural: str, obj: dict | None) -> None:
        """Remember the object the API answered a create/patch with (not a Status)."""
        if obj and obj.get("kind") not in (None, "Status") and obj.get("metadata", {}).get("name"):
            meta = obj["metadata"]
            key = (plural, meta.get("namespace") or "", meta["name"])
            if key in self._tombstones and self._tombstones[key][0] >= _rv(obj):
                return  # the watch already delivered this object's deletion
            self._put(key, (obj, _rv(obj), time.monotonic()), meta.get("labels") or {})

    def deleted(self, plural: str, namespace: str, name: str, answer: dict | None, last_seen: dict | None) -> None:
        """Remember a delete: the object with its deletionTimestamp (graceful, finalizers), else gone (the API
        answered with a Status, a 404, or the object's last state)."""
        if answer and answer.get("kind") not in (None, "Status") and answer["metadata"].get("deletionTimestamp"):
            self.wrote(plural, answer)
            if (plural, namespace or "", name) in self.overlay:  # (not if the watch already had it gone)
                self.deleting.add((plural, namespace or "", name))
        else:
            labels = ((last_seen or {}).get("metadata") or {}).get("labels") if last_seen else None
            self._put((plural, namespace or "", name), (GONE, _rv(last_seen), time.monotonic()), labels)

    def observed(self, plural: str, event_type: str | None, obj: Mapping) -> None:
        """A watch event (after kopf indexed it): an own write the watch has now caught up with stops shadowing it.
        Without this, a pod the operator created and the watch then saw created and deleted before any lookup
        would be shown from the overlay, as created, until OVERLAY_TTL_S: its unit would wait that long to heal."""
        meta = obj.get("metadata") or {}
        key = (plural, meta.get("namespace") or "", meta.get("name") or "")
        rv, now = _rv(obj), time.monotonic()
        if event_type == "DELETED":
            self._tombstones[key] = (rv, now)
            self._sweep(now)
        entry = self.overlay.get(key)
        if entry is not None and (event_type == "DELETED" or (rv and entry[1] and rv >= entry[1])):
            self._drop(key)

    # --- reads -----------------------------------------------------------------------------------------------
    def _merge(self, plural: str, namespace: str, seen: list[dict], match, candidates: Iterable[str]) -> list[dict]:
        """The watched objects of one lookup, with newer own writes (among `candidates`, by name) replacing them
        and deletions removing them."""
        now = time.monotonic()
        out = {_name(o): o for o in seen}
        for name in list(candidates):
            key = (plural, namespace or "", name)
            if key not in self.overlay:
                continue
            obj, rv, at = self.overlay[key]
            watched = out.get(name)
            if now - at > OVERLAY_TTL_S:
                self._drop(key)
            elif obj == GONE:
                if watched is None or (rv and _rv(watched) > rv):
                    self._drop(key)  # the watch saw the deletion, or a newer object of that name
                else:
                    out.pop(name, None)
            elif watched is not None and _rv(watched) >= rv:
                self._drop(key)  # the watch caught up
            elif watched is None and key in self.deleting:
                self._drop(key)  # it was being deleted, and now the watch has it gone
            elif match(obj):
                out[name] = obj
            else:
                out.pop(name, None)  # a newer own write says it no longer matches (a spare relabelled as a unit's)
        return sorted(out.values(), key=_name)

    def _drop(self, key: Key) -> None:
        if self.overlay.pop(key, None) is None:
            return
        plural, ns, name = key
        self.deleting.discard(key)
        self._by_ns.get((plural, ns), set()).discard(name)
        self._unlabeled.get((plural, ns), set()).discard(name)
        for k, v in self._labels.pop(key, []):
            names = self._by_label.get((plural, ns, k, v))
            if names is not None:
                names.discard(name)
                if not names:
                    del self._by_label[(plural, ns, k, v)]

    def _named(self, plural: str, namespace: str, name: str) -> list[str]:
        return [name] if (plural, namespace or "", name) in self.overlay else []

    def _labelled(self, plural: str, namespace: str, label: str, value: str) -> list[str]:
        ns = namespace or ""
        return [*self._by_label.get((plural, ns, label, value), ()), *self._unlabeled.get((plural, ns), ())]

    def _lookup(self, index: str, key) -> list[dict]:
        store = self.indexes.get(index, {}).get(key)
        return list(store) if store is not None else []

    def job(self, namespace: str, name: str) -> dict | None:
        found = self._merge("dilocojobs", namespace, self._lookup("jobs", (namespace, name)),
                            lambda o: _name(o) == name, self._named("dilocojobs", namespace, name))
        return next((o for o in found if _name(o) == name), None)

    def unit(self, namespace: str, name: str) -> dict | None:
        found = self._merge("learnerunits", namespace, self._lookup("units", ("name", namespace, name)),
                            lambda o: _name(o) == name, self._named("learnerunits", namespace, name))
        return next((o for o in found if _name(o) == name), None)

    def units_of_job(self, namespace: str, job: str) -> list[dict]:
        return self._merge("learnerunits", namespace, self._lookup("units", ("job", namespace, job)),
                           lambda o: (o.get("spec") or {}).get("jobName") == job,
                           self._by_ns.get(("learnerunits", namespace or ""), ()))

    def pods_of_unit(self, namespace: str, unit: str, label: str) -> list[dict]:
        return self._merge("pods", namespace, self._lookup("pods", (namespace, unit)),
                           lambda o: (o["metadata"].get("labels") or {}).get(label) == unit,
                           self._labelled("pods", namespace, label, unit))

    def spare_pods(self, namespace: str, job: str) -> list[dict]:
        """The job's spare pods that are no unit's yet (objects/spares.py)."""
        seen = self._lookup("pods", ("spare", namespace, job))
        return self._merge("pods", namespace, seen,
                           lambda o: (lab := o["metadata"].get("labels") or {}).get(LABEL_SPARE) == SPARE_WAITING
                           and lab.get(LABEL_JOB) == job,
                           [*(_name(o) for o in seen), *self._labelled("pods", namespace, LABEL_SPARE, SPARE_WAITING)])

    def workload(self, namespace: str, name: str) -> dict | None:
        """A unit's Kueue Workload (watched only with --kueue)."""
        found = self._merge("workloads", namespace, self._lookup("workloads", (namespace, name)),
                            lambda o: _name(o) == name, self._named("workloads", namespace, name))
        return next((o for o in found if _name(o) == name), None)

    def syncer_deployment(self, namespace: str, job: str, name: str) -> dict | None:
        found = self._merge("deployments", namespace, self._lookup("deployments", (namespace, job)),
                            lambda o: _name(o) == name, self._named("deployments", namespace, name))
        return next((o for o in found if _name(o) == name), None)

    def all_pods(self) -> list[dict]:
        """Every watched learner pod (the autoscaler's view of what its units use on each node)."""
        return [p for key, store in self.indexes["pods"].items() if key[0] != "syncer" for p in store]

    def syncer_pods(self, namespace: str, job: str) -> list[dict]:
        """The job's syncer pods as watched (the operator never writes them: no overlay)."""
        return self._lookup("pods", ("syncer", namespace, job))

    def node(self, name: str) -> dict | None:
        return next(iter(self._lookup("nodes", name)), None)

    def nodes(self) -> list[dict]:
        return [n for store in self.indexes.get("nodes", {}).values() for n in store]
