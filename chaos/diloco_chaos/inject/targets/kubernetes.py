"""Faults on the pods of one DilocoJob (the official kubernetes client, off the event loop): kill = delete the pod at once (grace 0); fail = kwok's
pod-failure stage with an exit code (fake nodes only); an Event on every victim. Only the job's namespace.

Exec-less on purpose: the target needs get/list on the job, its units and pods, delete/patch on pods and create
on Events (chaos/rbac.yaml), never pods/exec.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

from diloco_kube.client import DILOCOJOBS, LEARNERUNITS, NODES, PODS, ApiError, Kube
from diloco_kube.labels import (FAIL_POD_EXIT_CODE_ANNOTATION, FAIL_POD_LABEL, KWOK_ANNOTATION, LABEL_COMPONENT,
                                 LABEL_INCARNATION, LABEL_JOB, LABEL_SHARD, LABEL_UNIT)

from diloco_chaos.inject.experiment import Experiment
from diloco_chaos.inject.guards import Candidate
from diloco_chaos.inject.record import UnitObservation
from diloco_chaos.inject.targets import Fault

SOURCE = "diloco-chaos"
REASONS = {"kill": "ChaosPodKilled", "fail": "ChaosPodFailed"}


def _ts(value: str | None) -> float | None:
    """Unix seconds of an RFC 3339 timestamp as the API server writes it."""
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _ready_since(pod: dict) -> float | None:
    """When the pod became Running and Ready, or None if it is not."""
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return None
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if not ready or ready.get("status") != "True":
        return None
    return _ts(ready.get("lastTransitionTime")) or _ts(status.get("startTime"))


class KubernetesTarget:
    """The learner units (LearnerUnit + pods) and the syncer pod of one DilocoJob."""

    def __init__(self, job: str, namespace: str, kubeconfig: str | None = None, kube: Kube | None = None):
        self.job, self.namespace, self.kubeconfig = job, namespace, kubeconfig
        self.kube = kube
        self.owns_kube = False
        self.units: dict[str, dict] = {}  # unit name -> LearnerUnit, from the last listing
        self.pods: dict[str, list[dict]] = {}  # unit or syncer shard name -> its live pods, from the last listing
        self.syncers: list[str] = []  # the syncer's Deployment names: <job>-syncer, or <job>-syncer-<i> per shard
        # API timestamps have 1 s resolution; a pod's start is also bounded by when we first saw it, so a
        # replacement created within the second of a fault is still told apart from its victim.
        self.first_seen: dict[str, float] = {}

    def describe(self) -> dict:
        return {"kind": "kubernetes", "namespace": self.namespace, "job": self.job}

    async def _api(self) -> Kube:
        if self.kube is None:
            self.kube = await Kube.connect(kubeconfig=self.kubeconfig)
            self.owns_kube = True
        return self.kube

    async def preflight(self, exp: Experiment) -> None:
        if exp.action.type == "pause":
            raise ValueError("action.type pause: freezing a container needs a node agent or pods/exec; on "
                             "Kubernetes use kill or fail (see docs/chaos.md)")
        if exp.schedule.downtime_s:
            raise ValueError("schedule.downtime: on Kubernetes the operator recreates a unit after its own backoff "
                             "(spec.restartPolicy.backoffSeconds); set that instead")
        if exp.safety.namespace is not None and exp.safety.namespace != self.namespace:
            raise ValueError(f"safety.namespace is {exp.safety.namespace}, but the job is in {self.namespace}")
        kube = await self._api()
        if await kube.get(DILOCOJOBS, self.namespace, self.job) is None:
            raise ValueError(f"DilocoJob {self.namespace}/{self.job} not found")

    async def ended(self) -> str | None:
        job = await (await self._api()).get(DILOCOJOBS, self.namespace, self.job)
        if job is None:
            return "the DilocoJob was deleted"
        phase = (job.get("status") or {}).get("phase")
        return f"the DilocoJob is {phase}" if phase in ("Succeeded", "Failed") else None

    async def _refresh(self) -> list[dict]:
        kube = await self._api()
        units = await kube.list(LEARNERUNITS, self.namespace, f"{LABEL_JOB}={self.job}")
        pods = await kube.list(PODS, self.namespace, f"{LABEL_JOB}={self.job}")
        pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        seen = time.time()
        for p in pods:
            self.first_seen.setdefault(p["metadata"]["uid"], seen)
        self.units = {u["metadata"]["name"]: u for u in units}
        self.pods = {}
        for p in pods:
            labels = p["metadata"].get("labels") or {}
            if labels.get(LABEL_COMPONENT) == "syncer":  # each shard is a target of its own
                key = f"{self.job}-syncer" + (f"-{labels[LABEL_SHARD]}" if LABEL_SHARD in labels else "")
            else:
                key = labels.get(LABEL_UNIT) if labels.get(LABEL_COMPONENT) == "learner" else None
            if key:
                self.pods.setdefault(key, []).append(p)
        self.syncers = sorted(k for k, ps in self.pods.items()
                              if (ps[0]["metadata"].get("labels") or {}).get(LABEL_COMPONENT) == "syncer")
        return pods

    def _current(self, unit: str) -> list[dict]:
        """The unit's pods of its current incarnation (older ones may still be terminating)."""
        pods = self.pods.get(unit, [])
        lu = self.units.get(unit)
        inc = ((lu or {}).get("status") or {}).get("incarnation")
        if inc is None:
            return pods
        return [p for p in pods if (p["metadata"].get("labels") or {}).get(LABEL_INCARNATION) == str(inc)]

    async def candidates(self) -> list[Candidate]:
        await self._refresh()
        out = []
        for name, lu in sorted(self.units.items()):
            spec = lu.get("spec") or {}
            pods = self._current(name)
            alive = len(pods) == int(spec.get("podsPerUnit", 1)) and all(_ready_since(p) for p in pods)
            labels = {**(lu["metadata"].get("labels") or {}), LABEL_COMPONENT: "learner", LABEL_UNIT: name}
            out.append(Candidate(name, "learner", spec.get("unitIndex"),
                                 tuple(sorted(p["metadata"]["name"] for p in pods)), labels, alive, self.namespace))
        for syncer in self.syncers:
            pods = self.pods[syncer]
            labels = pods[0]["metadata"].get("labels") or {}
            out.append(Candidate(syncer, "syncer", None, tuple(sorted(p["metadata"]["name"] for p in pods)),
                                 labels, all(_ready_since(p) for p in pods), self.namespace))
        return out

    async def inject(self, fault: Fault) -> dict:
        kube = await self._api()
        await self._refresh()
        victims = {p["metadata"]["name"]: p for p in self.pods.get(fault.unit, [])}
        missing = [m for m in fault.members if m not in victims]
        if missing:
            raise RuntimeError(f"pod(s) {', '.join(missing)} of {fault.unit} are gone already")
        if fault.action == "fail":
            for name in fault.members:
                node = await kube.get(NODES, None, victims[name]["spec"].get("nodeName") or "")
                if not node or ((node["metadata"].get("annotations") or {}).get(KWOK_ANNOTATION) != "fake"):
                    raise RuntimeError(f"{name} runs on a real node: a pod failure with an exit code needs kwok's "
                                       f"chaos stage (exec-less); use the kill action on real clusters")
        done = []
        for name in fault.members:
            pod = victims[name]
            message = (f"chaos experiment {fault.experiment}, fault #{fault.id}: {fault.action}"
                       f"{f' (exit code {fault.exit_code})' if fault.exit_code else ''} pod {name} — {fault.why}")
            await self._event(pod, REASONS[fault.action], message)
            try:
                if fault.action == "kill":
                    if await kube.delete(PODS, self.namespace, name, grace_seconds=0) is None:
                        continue  # gone in the meantime
                else:
                    await kube.merge_patch(PODS, self.namespace, name, {"metadata": {
                        "labels": {FAIL_POD_LABEL: "true"},
                        "annotations": {FAIL_POD_EXIT_CODE_ANNOTATION: str(fault.exit_code)}}})
            except ApiError as exc:
                if exc.status != 404:
                    raise RuntimeError(f"could not {fault.action} {name}: {exc}") from exc
                continue  # gone in the meantime
            done.append(name)
        lu = self.units.get(fault.unit)
        if lu is not None:
            await self._event(lu, REASONS[fault.action], f"chaos experiment {fault.experiment}, fault #{fault.id}: "
                                                         f"{fault.action} {', '.join(done)} — {fault.why}")
        return {"pods": done, "uids": {n: victims[n]["metadata"]["uid"] for n in done}}

    async def _event(self, obj: dict, reason: str, message: str) -> None:
        obj = {**obj, "metadata": {**obj["metadata"], "namespace": self.namespace}}
        await (await self._api()).event(obj, "Warning", reason, message, source=SOURCE, labels={LABEL_JOB: self.job})

    async def hold(self, fault: Fault) -> dict | None:
        return None  # downtime is refused in preflight: the operator's backoff decides when a unit comes back

    async def release(self, fault: Fault) -> dict | None:
        return None

    async def close(self) -> None:
        if self.owns_kube and self.kube is not None:
            self.kube.close()
            self.kube = None

    async def observe(self) -> dict[str, UnitObservation]:
        await self._refresh()
        out = {}
        names = set(self.units) | set(self.syncers)
        for name in names:
            pods = self._current(name) if name in self.units else self.pods.get(name, [])
            want = int((self.units.get(name, {}).get("spec") or {}).get("podsPerUnit", 1)) if name in self.units else 1
            started = [max(_ts(p["metadata"].get("creationTimestamp")) or 0.0, self.first_seen[p["metadata"]["uid"]])
                       for p in pods]
            since = [_ready_since(p) for p in pods]
            complete = len(pods) >= want and all(since)
            out[name] = UnitObservation(
                started=max(started, default=None), running=complete, lines=None,
                running_since=max(since + started) if complete else None, merged=None)
        return out
