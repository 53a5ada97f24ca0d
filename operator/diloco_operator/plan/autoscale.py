"""Capacity-aware autoscaling of a job's learner units (`spec.autoscaling`), as pure decisions: from the spec,
the units, the free accelerator capacity on matching nodes and the last autoscaling status to units per
template, units to park, the new autoscaling status and the Events each decision deserves."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from diloco_operator.api import conditions as C
from diloco_operator.api import models as api
from diloco_operator.objects import builders as O

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
    queued: bool = False  # its Kueue Workload waits for quota (Admitted=False): kept, never parked, takes no room


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
    spec, status = lu.get("spec") or {}, api.LearnerUnitStatus.read(lu.get("status"))
    conds = status.condition_dicts()
    sched = C.get_condition(conds, C.PODS_SCHEDULED)
    stuck = sched is not None and sched.get("status") == "False"
    return UnitState(name=lu["metadata"]["name"], template=spec.get("template", ""), index=int(spec.get("index", -1)),
                     running=status.phase == "Running",
                     unschedulable_since=C.parse_time(sched.get("lastTransitionTime")) if stuck else None,
                     unschedulable_message=(sched or {}).get("message", "") if stuck else "",
                     finished=status.phase in ("Succeeded", "Failed"),
                     queued=(C.get_condition(conds, C.ADMITTED) or {}).get("status") == "False")


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


@dataclass
class _Template:
    """One template's autoscaling state during a decision (read from and written back to its status)."""

    spec: api.UnitTemplate
    units: list[UnitState]
    free: int | None
    retry_at: datetime | None = None
    park_count: int = 0
    reason: str = ""
    probe: bool = False  # its backoff just ended: one unit may probe for room

    def running(self, parked: set[str]) -> int:
        return sum(1 for u in self.units if u.running and u.name not in parked)

    def kept(self, parked: set[str]) -> int:
        return sum(1 for u in self.units if u.name not in parked)

    def queued(self) -> int:
        return sum(1 for u in self.units if u.queued and not u.running and not u.finished)


def _templates(spec: api.DilocoJobSpec, units: list[UnitState], free: dict[str, int | None],
               old: api.AutoscalingStatus, now: datetime) -> tuple[list[_Template], list[Event]]:
    """Templates in preference order with their state; a parked one is retried when its backoff ends or when
    more room shows on its nodes than when last looked."""
    prev = {t.name: t for t in old.templates}
    out, events = [], []
    for t in preference(spec):
        p = prev.get(t.name) or api.TemplateScaling(name=t.name)
        mine = [u for u in units if u.template == t.name]
        # Room not yet promised: units whose pods the scheduler has not placed nor refused will take some (a unit
        # queued in Kueue has no pod yet: it takes room only once admitted).
        pending = sum(1 for u in mine if not u.running and not u.finished and not u.queued
                      and u.unschedulable_since is None)
        room = free.get(t.name)
        tpl = _Template(t, mine, None if room is None else max(0, room - pending),
                        C.parse_time(p.retryAt), p.parkCount, p.reason or "")
        if tpl.retry_at is not None:
            if (tpl.free or 0) > (p.freeUnits or 0):
                events.append(("Normal", C.Reason.CAPACITY_APPEARED,
                               f"template {t.name}: room for {tpl.free} unit(s) on its nodes; retrying it now"))
                tpl.retry_at, tpl.reason = None, ""
            elif now >= tpl.retry_at:
                events.append(("Normal", C.Reason.RETRYING_TEMPLATE,
                               f"template {t.name}: backoff over, trying to place a unit again"))
                tpl.retry_at, tpl.reason, tpl.probe = None, "", True
        out.append(tpl)
    return out, events


def _stuck(tpl: _Template, now: datetime, timeout: timedelta) -> list[UnitState]:
    """Units Unschedulable longer than the provisioning timeout (a cluster autoscaler had its chance). A unit queued
    in Kueue never is: it waits for quota, not for a node (see docs/operator.md, Kueue and autoscaling)."""
    return [u for u in tpl.units if not u.running and not u.finished and not u.queued and u.unschedulable_since
            and now - u.unschedulable_since >= timeout]


def _fill(templates: list[_Template], target: int, parked: set[str], allow_up: bool) -> dict[str, int]:
    """Units per template: the existing ones (at least minCount), then the best available templates up to
    maxCount until the target; above the target, the least preferred templates shrink first."""
    counts = {t.spec.name: max(t.spec.minCount, t.kept(parked)) for t in templates}
    parked_templates = {u.template for t in templates for u in t.units if u.name in parked}
    for t in templates if allow_up else []:
        room = target - sum(counts.values())
        if room <= 0:
            break
        if t.retry_at is not None or t.spec.name in parked_templates:
            continue
        cap = (t.spec.maxCount if t.spec.maxCount is not None else 10**6) - counts[t.spec.name]
        if t.park_count:  # it has failed to place units: grow by the room seen (not promised yet)
            seen = 1 if t.free is None else t.free
            cap = min(cap, max(seen, 1) if t.probe else seen)
        counts[t.spec.name] += max(0, min(room, cap))
    excess = sum(counts.values()) - target
    for t in reversed(templates):
        cut = min(excess, counts[t.spec.name] - t.spec.minCount)
        if cut > 0:
            counts[t.spec.name] -= cut
            excess -= cut
    return counts


def _since(now: datetime, then: datetime | None) -> float:
    return float("inf") if then is None else (now - then).total_seconds()


def decide(spec: api.DilocoJobSpec, units: list[UnitState], free: dict[str, int | None], old: dict | None,
           now: datetime) -> Decision:
    """Units per template and units to park. Rules: fill templates in preference order up to maxCount; a unit
    whose pods stay Unschedulable longer than provisioningTimeoutSeconds is parked (deleted) and its template
    is not used again before an exponential backoff ends or free capacity appears on its nodes; running units
    are never removed to make room; the job never asks for fewer than minUnits; cooldowns space scale-ups and
    parks."""
    a = spec.autoscaling
    assert a is not None
    prev = api.AutoscalingStatus.model_validate(old or {})
    timeout = timedelta(seconds=a.provisioningTimeoutSeconds)
    last_up, last_down = C.parse_time(prev.lastScaleUpTime), C.parse_time(prev.lastScaleDownTime)
    target = target_units(spec)
    templates, events = _templates(spec, units, free, prev, now)
    rank = {t.spec.name: i for i, t in enumerate(templates)}

    stuck = [u for t in templates for u in _stuck(t, now, timeout)]
    down_ok = min(_since(now, last_down), _since(now, last_up)) >= a.scaleDownCooldownSeconds
    up_ok = _since(now, last_up) >= a.scaleUpCooldownSeconds
    park: list[UnitState] = []
    if down_ok:  # never below a template's minCount by parking: those units keep waiting for room
        for t in templates:
            park += sorted(_stuck(t, now, timeout), key=lambda u: -u.index)[:max(0, len(t.units) - t.spec.minCount)]
    parked = {u.name for u in park}
    counts = _fill(templates, target, parked, up_ok)
    # Never ask for fewer than minUnits on purpose: keep stuck units (best template first) rather than go below.
    while sum(counts.values()) < min(a.minUnits, target) and park:
        keep = min(park, key=lambda u: rank[u.template])
        park.remove(keep)
        parked.discard(keep.name)
        counts = _fill(templates, target, parked, up_ok)

    for t in templates:
        mine = [u for u in park if u.template == t.spec.name]
        if mine:
            delay = min(a.retryBackoffSeconds * 2 ** t.park_count, a.maxRetryBackoffSeconds)
            t.park_count += 1
            t.retry_at = now + timedelta(seconds=delay)
            why = mine[0].unschedulable_message or "unschedulable"
            t.reason = f"pods unschedulable for over {a.provisioningTimeoutSeconds:g}s: {why}"[:300]
            events.append(("Warning", C.Reason.UNITS_PARKED,
                           f"parked {len(mine)} unit(s) of template {t.spec.name} ({', '.join(u.name for u in mine)}): "
                           f"{t.reason}; retry in {delay:g}s"))
        # Everything asked of it runs and nothing more is wanted: its history of parks is cleared.
        full = counts[t.spec.name] == t.spec.maxCount or sum(counts.values()) >= target
        if full and t.retry_at is None and t.running(parked) == counts[t.spec.name]:
            t.park_count = 0

    existing = {t.spec.name: t.kept(parked) for t in templates}
    grown = {n: counts[n] - existing[n] for n in counts if counts[n] > existing[n]}
    shrunk = {n: existing[n] - counts[n] for n in counts if counts[n] < existing[n]}
    if grown and units:  # the first creation of a job's units is not a decision worth an Event
        events.append(("Normal", C.Reason.SCALED_UP, "added " + ", ".join(f"{k} unit(s) of {n}" for n, k in grown.items())
                       + f" (target {target} units)"))
    if shrunk:
        events.append(("Normal", C.Reason.SCALED_DOWN, "removed " + ", ".join(f"{k} unit(s) of {n}"
                                                                             for n, k in shrunk.items())
                       + f" (target {target} units)"))
    last_up = now if grown else last_up
    last_down = now if park or shrunk else last_down

    by_name = {t.spec.name: t for t in templates}
    status = api.AutoscalingStatus(
        targetUnits=target, desiredUnits=sum(counts.values()), runningUnits=sum(t.running(parked) for t in templates),
        queuedUnits=sum(t.queued() for t in templates),
        templates=[api.TemplateScaling(name=t.spec.name, desired=counts[t.spec.name], running=t.running(parked),
                                       queued=t.queued(),
                                       parkCount=t.park_count, freeUnits=t.free, retryAt=_iso(t.retry_at),
                                       reason=t.reason if t.retry_at else None) for t in templates],
        parkedUnits=([api.ParkedUnit(name=u.name, template=u.template, reason=by_name[u.template].reason,
                                     time=C.now_iso(now)) for u in park] + prev.parkedUnits)[:PARKED_HISTORY],
        lastScaleUpTime=_iso(last_up), lastScaleDownTime=_iso(last_down))
    return Decision(counts=counts, park=[u.name for u in park], status=status.model_dump(mode="json", exclude_none=True),
                    events=events, limited=_limited(status, templates, up_ok, a),
                    requeue_after=_wake(templates, units, parked, now, timeout, a, last_up, last_down, up_ok,
                                        down_ok, bool(stuck)))


def _limited(status: api.AutoscalingStatus, templates: list[_Template], up_ok: bool,
             a: api.Autoscaling) -> tuple[bool, str, str]:
    """The ScalingLimited condition: (status, reason, message)."""
    desired, target = status.desiredUnits, status.targetUnits
    if desired >= target and status.queuedUnits:
        return True, C.Reason.WAITING_FOR_QUOTA, (f"{desired} units wanted (target {target}); {status.queuedUnits} "
                                                  "wait for quota in Kueue: their Workloads stay queued")
    if desired >= target:
        return False, C.Reason.TARGET_MET, f"{desired} units wanted (target {target})"
    if not up_ok:
        return True, C.Reason.COOLDOWN, f"{desired}/{target} units: scale-up cooldown ({a.scaleUpCooldownSeconds:g}s)"
    waiting = ", ".join(f"{t.spec.name} until {_iso(t.retry_at)}" for t in templates if t.retry_at is not None)
    return True, C.Reason.CAPACITY_UNAVAILABLE, f"{desired}/{target} units placeable; parked: {waiting or 'none (maxCount)'}"


def _wake(templates: list[_Template], units: list[UnitState], parked: set[str], now: datetime, timeout: timedelta,
          a: api.Autoscaling, last_up: datetime | None, last_down: datetime | None, up_ok: bool, down_ok: bool,
          stuck: bool) -> float | None:
    """Seconds until the next decision is due: a backoff or a cooldown ends, or a pending unit times out."""
    wakes = [(t.retry_at - now).total_seconds() for t in templates if t.retry_at is not None]
    wakes += [(u.unschedulable_since + timeout - now).total_seconds() for u in units
              if u.unschedulable_since and not u.running and not u.queued and u.name not in parked]
    if not up_ok and last_up:
        wakes.append(a.scaleUpCooldownSeconds - (now - last_up).total_seconds())
    if stuck and not down_ok and last_down:
        wakes.append(a.scaleDownCooldownSeconds - (now - last_down).total_seconds())
    wakes = [w for w in wakes if w > 0]
    return min(wakes) + 0.5 if wakes else None
