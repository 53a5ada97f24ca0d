"""Lost nodes (spec.failurePolicy.nodeLostSeconds): when a node counts as lost, and which learner pods the operator
force-deletes because of it. Pure: Nodes, pods and the time in, decisions out (the controller does the I/O)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from diloco_operator.api import conditions as C
from diloco_operator.plan.unitplan import PodView


@dataclass(frozen=True)
class NotReady:
    """A node whose Ready condition is not True, and since when."""

    node: str
    status: str  # Ready's status: False (its kubelet says so) or Unknown (it stopped reporting; or no condition)
    reason: str
    since: datetime


@dataclass(frozen=True)
class LostPod:
    """A pod whose node is lost: not Ready for nodeLostSeconds, or silent about the pod's deletion that long past its
    grace period."""

    pod: str
    node: str
    seconds: float  # how long the node has not been Ready, or has not confirmed the deletion past the grace period
    message: str


def not_ready(node: dict, first_seen: datetime) -> NotReady | None:
    """The node's NotReady state, None while Ready is True. `since` is Ready's lastTransitionTime, or `first_seen`
    (when the operator first saw it not Ready; now, the first time) if earlier or if there is none: a False ->
    Unknown flip moves the transition time, but the node has not been Ready since the first."""
    ready = C.get_condition((node.get("status") or {}).get("conditions"), C.READY) or {}
    if ready.get("status") == "True":
        return None
    since = min(C.parse_time(ready.get("lastTransitionTime")) or first_seen, first_seen)
    return NotReady(node["metadata"]["name"], ready.get("status") or "Unknown", ready.get("reason") or "", since)


def lost_pods(pods: Iterable[PodView], down: Mapping[str, NotReady], now: datetime,
              after_s: float) -> tuple[list[LostPod], float | None]:
    """The pods to force-delete: every pod that is not finished and sits on a node not Ready for at least `after_s`
    (also one already being deleted: its kubelet will never confirm a graceful delete). And in how many seconds
    the next pod on a node not Ready for less than that will be (None: no such pod)."""
    lost, wait = [], None
    for p in pods:
        if p.terminal or p.node not in down:
            continue
        seconds = (now - down[p.node].since).total_seconds()
        if seconds >= after_s:
            lost.append(LostPod(p.name, p.node, seconds,
                                f"node {p.node} not Ready (Ready={down[p.node].status}) for {seconds:.0f}s"))
        else:
            wait = after_s - seconds if wait is None else min(wait, after_s - seconds)
    return lost, wait


def overdue_pods(pods: Iterable[PodView], now: datetime, after_s: float) -> tuple[list[LostPod], float | None]:
    """Pods still there `after_s` past the end of their deletion's grace period (deletionTimestamp), whose kubelet has
    so never confirmed it: the sign of a lost node that needs no right on Nodes (e.g. the controller-manager's taint
    eviction on a dead node). A live kubelet stops the containers at that deadline and removes the pod within
    seconds. And in how many seconds the next pod being deleted will be overdue (None: none)."""
    lost, wait = [], None
    for p in pods:
        if p.deletion_deadline is None or not p.node:
            continue
        seconds = (now - p.deletion_deadline).total_seconds()
        if seconds >= after_s:
            lost.append(LostPod(p.name, p.node, seconds, f"node {p.node} has not confirmed the deletion of pod "
                                                           f"{p.name} {seconds:.0f}s past its grace period"))
        else:
            wait = after_s - seconds if wait is None else min(wait, after_s - seconds)
    return lost, wait
