"""What every pod the operator creates runs as (Pod Security's `restricted` profile): the image's non-root user, no
privilege escalation, no capabilities, RuntimeDefault seccomp, a read-only root and one scratch emptyDir at /tmp
that HOME and TMPDIR point into (caches: the data cache, torch's and XLA's compile caches, Python's tempfile)."""

from __future__ import annotations

IMAGE_UID = 10001  # the Dockerfile's user (USER 10001:10001)
IMAGE_GID = 10001
SCRATCH_VOLUME = "scratch"
SCRATCH_DIR = "/tmp"
SCRATCH_ENV = {"HOME": SCRATCH_DIR, "TMPDIR": SCRATCH_DIR}
SECCOMP = {"type": "RuntimeDefault"}


def pod_security_context(fs_group: bool) -> dict:
    """The pod-level half: the image's user and group, never root, RuntimeDefault seccomp; with `fs_group`, volumes
    that support ownership (PVCs) are made writable by that group."""
    ctx = {"runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_GID, "seccompProfile": dict(SECCOMP)}
    if fs_group:
        ctx["fsGroup"] = IMAGE_GID
    return ctx


def container_security_context() -> dict:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def harden(pod_spec: dict, fs_group: bool = False) -> dict:
    """`pod_spec` (changed in place and returned) with the restricted profile on the pod and on every container and
    init container, each with the scratch volume at /tmp and HOME/TMPDIR in it. Lists are rebuilt, never appended
    to: containers copied from one another (the syncer's standby) may share them."""
    pod_spec["securityContext"] = {**pod_spec.get("securityContext", {}), **pod_security_context(fs_group)}
    for key in ("initContainers", "containers"):
        for container in pod_spec.get(key, []):
            container["securityContext"] = container_security_context()
            given = {e["name"] for e in container.get("env", [])}
            container["env"] = [*container.get("env", []),
                                *({"name": k, "value": v} for k, v in SCRATCH_ENV.items() if k not in given)]
            container["volumeMounts"] = [*container.get("volumeMounts", []),
                                         {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_DIR}]
    pod_spec["volumes"] = [*pod_spec.get("volumes", []), {"name": SCRATCH_VOLUME, "emptyDir": {}}]
    return pod_spec
