"""A pod's phase as the kubelet will report it, read from what it has reported already."""

from __future__ import annotations


def effective_phase(pod: dict) -> str:
    """The pod's phase, or the terminal phase it is bound for: a `restartPolicy: Never` pod whose every container has
    terminated will never run again, and the kubelet reports that (the container's `terminated` state, with its
    exit code) about a second before it moves the phase: it first finishes stopping the pod (measured on the real
    node: container SIGKILLed -> state terminated at +0.32 s, phase Failed at +1.43 s). Failed when any container
    failed, else Succeeded, as the kubelet will decide."""
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    if phase in ("Succeeded", "Failed") or (pod.get("spec") or {}).get("restartPolicy") != "Never":
        return phase
    containers = (pod.get("spec") or {}).get("containers") or []
    states = [(cs.get("state") or {}).get("terminated") for cs in status.get("containerStatuses") or []]
    if not containers or len(states) != len(containers) or not all(states):
        return phase
    return "Failed" if any(t.get("exitCode", 0) != 0 for t in states) else "Succeeded"
