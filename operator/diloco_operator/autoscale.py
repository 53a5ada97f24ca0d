"""Capacity-aware autoscaling of a job's learner units (`spec.autoscaling`), as pure decisions: from the spec,
the units, the free accelerator capacity on matching nodes and the last autoscaling status to units per
template, units to park, the new autoscaling status and the Events each decision deserves."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from diloco_operator import api
from diloco_operator import conditions as C
from diloco_operator import objects as O

Event = tuple[str, str, str]  # (Normal|Warning, reason, message)
PARKED_HISTORY = 20  # how many parked units the status lists (the newest)


@dataclass(frozen=True)
class UnitState:
    """What the autoscaler needs to know about one existing unit."""

    name: str
    template: str
    index: int
    running: bool
    unschedulable_since: datetime | None = None  # PodsScheduled=False since
    unschedulable_message: str = ""
    finished: bool = False  # Succeeded or Failed: never parked, never counted as capacity


@dataclass
class Decision:
    """Units per template, units to park (delete), the autoscaling status and the Events."""

    counts: dict[str, int]
    park: list[str] = field(default_factory=list)
    status: dict = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    limited: tuple[bool, str, str] = (False, C.Reason.TARGET_MET, "")  # ScalingLimited: status, reason, message
    requeue_after: float | None = None


def unit_state(lu: dict) -> UnitState:
    """Read a LearnerUnit into what the autoscaler needs."""
    spec, status = lu.get("spec") or {}, lu.get("status") or {}
    sched = C.get_condition(status.get("conditions"), C.PODS_SCHEDULED)
    stuck = sched is not None and sched.get("status") == "False"
    return UnitState(name=lu["metadata"]["name"], template=spec.get("template", ""), index=int(spec.get("index", -1)),
                     running=status.get("phase") == "Running",
                     unschedulable_since=C.parse_time(sched.get("lastTransitionTime")) if stuck else None,
                     unschedulable_message=(sched or {}).get("message", "") if stuck else "",
                     finished=status.get("phase") in ("Succeeded", "Failed"))


def accelerator_usage(pods: list[dict]) -> dict[str, float]:
    """Node -> accelerators (nvidia.com/gpu + google.com/tpu) requested by the given pods bound to it."""
    used: dict[str, float] = {}
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        for c in (pod.get("spec") or {}).get("containers") or []:
            req = (c.get("resources") or {}).get("requests") or {}
            used[node] = used.get(node, 0.0) + sum(_quantity(req.get(r, 0)) for r in ("nvidia.com/gpu", "google.com/tpu"))
    return used


def free_by_template(job_name: str, spec: api.DilocoJobSpec, nodes: list[dict],
                     pods: list[dict]) -> dict[str, int | None]:
    """Template -> units that fit now (see free_units), with the tolerations its pods really get."""
    used = accelerator_usage(pods)
    return {t.name: free_units(t, O.learner_tolerations(O.unit_spec(job_name, spec, t, 0, 0)), nodes, used)
            for t in spec.units}


# --- capacity ---------------------------------------------------------------------------------------------------
def _tolerated(taint: dict, tolerations: list[dict]) -> bool:
    if taint.get("effect") not in ("NoSchedule", "NoExecute"):
        return True
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t["key"] == taint.get("key")):
            return True
        if t.get("key") == taint.get("key") and (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _ready(node: dict) -> bool:
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    conds = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def _quantity(value) -> float:
    s = str(value)
    if s.endswith("m"):
        return float(s[:-1]) / 1000
    try:
        return float(s)
    except ValueError:
        return 0.0


def free_units(template: api.UnitTemplate, pod_tolerations: list[dict], nodes: list[dict],
               used: dict[str, float]) -> int | None:
    """How many more units of `template` fit on ready, matching, tolerated nodes now (None for CPU templates:
    the operator does not account CPU/memory, so their capacity is unknown). `used`: node -> accelerators
    requested by the learner pods bound to it."""
    resource, label, _ = api.ACCELERATORS[template.accelerator.type]
    if resource is None:
        return None
    want = {**template.nodeSelector, label: template.accelerator.type}
    if template.accelerator.topology:
        want[api.TPU_TOPOLOGY_LABEL] = template.accelerator.topology
    pods = 0
    for node in nodes:
        labels = (node.get("metadata") or {}).get("labels") or {}
        if any(labels.get(k) != v for k, v in want.items()) or not _ready(node):
            continue
        if not all(_tolerated(t, pod_tolerations) for t in (node.get("spec") or {}).get("taints") or []):
            continue
        free = _quantity(((node.get("status") or {}).get("allocatable") or {}).get(resource, 0)) - used.get(
            (node.get("metadata") or {}).get("name", ""), 0.0)
        pods += max(0, int(free // template.accelerator.count))
    return pods // template.podsPerUnit


# --- decisions --------------------------------------------------------------------------------------------------
def target_units(spec: api.DilocoJobSpec) -> int:
    """The units the job asks for: spec.replicas (kubectl scale, an HPA) within [minUnits, maxUnits], else
    maxUnits."""
    a = spec.autoscaling
    want = spec.replicas if spec.replicas is not None else a.maxUnits
    return max(a.minUnits, min(a.maxUnits, want))


def preference(spec: api.DilocoJobSpec) -> list[api.UnitTemplate]:
    by_name = {t.name: t for t in spec.units}
    order = list(spec.autoscaling.preference) + [t.name for t in spec.units if t.name not in spec.autoscaling.preference]
    return [by_name[n] for n in order]


def _iso(t: datetime | None) -> str | None:
    return C.now_iso(t) if t else None


def decide(spec: api.DilocoJobSpec, units: list[UnitState], free: dict[str, int | None], old: dict | None,
           now: datetime) -> Decision:
    """Units per template and units to park. Rules: fill templates in preference order up to maxCount; a unit
    whose pods stay Unschedulable longer than provisioningTimeoutSeconds is parked (deleted) and its template
    is not used again before an exponential backoff ends or free capacity appears on its nodes; running units
    are never removed to make room; the job never asks for fewer than minUnits; cooldowns space scale-ups and
    parks."""
    a = spec.autoscaling
    assert a is not None
    old = old or {}
    old_t = {t["name"]: t for t in old.get("templates") or []}
    timeout = timedelta(seconds=a.provisioningTimeoutSeconds)
    last_up = C.parse_time(old.get("lastScaleUpTime"))
    last_down = C.parse_time(old.get("lastScaleDownTime"))
    events: list[Event] = []
    order = preference(spec)
    target = target_units(spec)
    by_t: dict[str, list[UnitState]] = {t.name: [] for t in order}
    for u in units:
        if u.template in by_t:
            by_t[u.template].append(u)

    # Template state: parked until retryAt (backoff); parkCount parks since the template last had all the units
    # it was asked for running. A template that was parked grows only by the room seen on its nodes, except
    # right after its backoff, when one unit probes (it may make a cluster autoscaler add a node).
    state: dict[str, dict] = {}
    probe: set[str] = set()
    for t in order:
        prev = old_t.get(t.name, {})
        st = {"retryAt": C.parse_time(prev.get("retryAt")), "parkCount": int(prev.get("parkCount") or 0),
              "reason": prev.get("reason") or ""}
        if st["retryAt"] is not None:
            if (free.get(t.name) or 0) > int(prev.get("freeUnits") or 0):  # more room than when last looked
                events.append(("Normal", C.Reason.CAPACITY_APPEARED,
                               f"template {t.name}: room for {free[t.name]} unit(s) on its nodes; retrying it now"))
                st["retryAt"], st["reason"] = None, ""
            elif now >= st["retryAt"]:
                events.append(("Normal", C.Reason.RETRYING_TEMPLATE,
                               f"template {t.name}: backoff over, trying to place a unit again"))
                st["retryAt"], st["reason"] = None, ""
                probe.add(t.name)
        state[t.name] = st

    # Stuck units: Unschedulable longer than the provisioning timeout (a cluster autoscaler had its chance).
    stuck = {t.name: [u for u in by_t[t.name] if not u.running and not u.finished and u.unschedulable_since
                      and now - u.unschedulable_since >= timeout] for t in order}
    down_ok = last_down is None or (now - last_down).total_seconds() >= a.scaleDownCooldownSeconds
    down_ok = down_ok and (last_up is None or (now - last_up).total_seconds() >= a.scaleDownCooldownSeconds)
    park: list[UnitState] = []
    if down_ok:
        for t in order:
            # Never below the template's minCount by parking: those units keep waiting for capacity.
            spare = len(by_t[t.name]) - t.minCount
            park += sorted(stuck[t.name], key=lambda u: -u.index)[:max(0, spare)]

    def keep_count(t: api.UnitTemplate, parked: set[str]) -> int:
        return sum(1 for u in by_t[t.name] if u.name not in parked)

    def available(t: api.UnitTemplate) -> bool:
        return state[t.name]["retryAt"] is None

    def fill(parked: set[str], allow_up: bool) -> dict[str, int]:
        counts = {t.name: max(t.minCount, keep_count(t, parked)) for t in order}
        if allow_up:
            for t in order:
                room = target - sum(counts.values())
                if room <= 0:
                    break
                if available(t) and not (t.name in {p.template for p in park}):
                    cap = (t.maxCount if t.maxCount is not None else 10**6) - counts[t.name]
                    if state[t.name]["parkCount"]:
                        room_seen = free.get(t.name)
                        # Units still waiting for their pods to run will take some of that room.
                        waiting_units = sum(1 for u in by_t[t.name] if not u.running and not u.finished
                                            and u.name not in parked)
                        room_seen = 1 if room_seen is None else max(0, room_seen - waiting_units)
                        cap = min(cap, max(room_seen, 1) if t.name in probe else room_seen)
                    counts[t.name] += max(0, min(room, cap))
        # Above the target (kubectl scale / HPA down): least preferred first, down to each minCount.
        excess = sum(counts.values()) - target
        for t in reversed(order):
            if excess <= 0:
                break
            cut = min(excess, counts[t.name] - t.minCount)
            if cut > 0:
                counts[t.name] -= cut
                excess -= cut
        return counts

    up_ok = last_up is None or (now - last_up).total_seconds() >= a.scaleUpCooldownSeconds
    parked = {u.name for u in park}
    counts = fill(parked, up_ok)
    # Never ask for fewer than minUnits on purpose: keep stuck units (best template first) rather than go below.
    while sum(counts.values()) < min(a.minUnits, target) and park:
        keep = min(park, key=lambda u: [t.name for t in order].index(u.template))
        park.remove(keep)
        parked.discard(keep.name)
        counts = fill(parked, up_ok)

    for t in order:
        mine = [u for u in park if u.template == t.name]
        if not mine:
            continue
        st = state[t.name]
        delay = min(a.retryBackoffSeconds * 2 ** st["parkCount"], a.maxRetryBackoffSeconds)
        st["parkCount"] += 1
        st["retryAt"] = now + timedelta(seconds=delay)
        why = mine[0].unschedulable_message or "unschedulable"
        st["reason"] = f"pods unschedulable for over {a.provisioningTimeoutSeconds:g}s: {why}"[:300]
        events.append(("Warning", C.Reason.UNITS_PARKED,
                       f"parked {len(mine)} unit(s) of template {t.name} ({', '.join(u.name for u in mine)}): "
                       f"{st['reason']}; retry in {delay:g}s"))

    for t in order:  # everything asked of the template runs and nothing more is wanted: its history is cleared
        full = counts[t.name] == (t.maxCount if t.maxCount is not None else -1) or sum(counts.values()) >= target
        if full and state[t.name]["retryAt"] is None and \
                sum(1 for u in by_t[t.name] if u.running and u.name not in parked) == counts[t.name]:
            state[t.name]["parkCount"] = 0
    existing = {t.name: keep_count(t, parked) for t in order}
    grown = {t: counts[t] - existing[t] for t in counts if counts[t] > existing[t]}
    shrunk = {t: existing[t] - counts[t] for t in counts if counts[t] < existing[t]}
    if grown and units:  # the first creation of a job's units is not a decision worth an Event
        events.append(("Normal", C.Reason.SCALED_UP, "added " + ", ".join(f"{n} unit(s) of {t}" for t, n in grown.items())
                       + f" (target {target} units)"))
    if shrunk:
        events.append(("Normal", C.Reason.SCALED_DOWN, "removed " + ", ".join(f"{n} unit(s) of {t}"
                                                                             for t, n in shrunk.items())
                       + f" (target {target} units)"))
    if grown:
        last_up = now
    if park or shrunk:
        last_down = now

    parked_list = [{"name": u.name, "template": u.template, "reason": state[u.template]["reason"], "time": C.now_iso(now)}
                   for u in park] + list(old.get("parkedUnits") or [])
    running = {t.name: sum(1 for u in by_t[t.name] if u.running and u.name not in parked) for t in order}
    templates = []
    for t in order:
        st = state[t.name]
        entry = {"name": t.name, "desired": counts[t.name], "running": running[t.name],
                 "parkCount": st["parkCount"]}
        if free.get(t.name) is not None:
            entry["freeUnits"] = free[t.name]
        if st["retryAt"] is not None:
            entry["retryAt"] = _iso(st["retryAt"])
            entry["reason"] = st["reason"]
        templates.append(entry)
    desired = sum(counts.values())
    status = {"targetUnits": target, "desiredUnits": desired, "runningUnits": sum(running.values()),
              "templates": templates, "parkedUnits": parked_list[:PARKED_HISTORY]}
    if last_up:
        status["lastScaleUpTime"] = _iso(last_up)
    if last_down:
        status["lastScaleDownTime"] = _iso(last_down)

    waiting = [t for t in order if state[t.name]["retryAt"] is not None]
    if desired < target and not up_ok:
        limited = (True, C.Reason.COOLDOWN, f"{desired}/{target} units: scale-up cooldown "
                                            f"({a.scaleUpCooldownSeconds:g}s)")
    elif desired < target:
        limited = (True, C.Reason.CAPACITY_UNAVAILABLE,
                   f"{desired}/{target} units placeable; parked: " + (", ".join(
                       f"{t.name} until {_iso(state[t.name]['retryAt'])}" for t in waiting) or "none (maxCount)"))
    else:
        limited = (False, C.Reason.TARGET_MET, f"{desired} units wanted (target {target})")
    # Wake up when a backoff or a cooldown ends, or a stuck unit reaches its provisioning timeout.
    wakes = [(s["retryAt"] - now).total_seconds() for s in state.values() if s["retryAt"] is not None]
    wakes += [(u.unschedulable_since + timeout - now).total_seconds() for u in units
              if u.unschedulable_since and not u.running and u.name not in parked]
    if not up_ok and last_up:
        wakes.append(a.scaleUpCooldownSeconds - (now - last_up).total_seconds())
    if any(stuck.values()) and not down_ok and last_down:
        wakes.append(a.scaleDownCooldownSeconds - (now - last_down).total_seconds())
    wakes = [w for w in wakes if w > 0]
    return Decision(counts=counts, park=[u.name for u in park], status=status, events=events, limited=limited,
                    requeue_after=min(wakes) + 0.5 if wakes else None)
