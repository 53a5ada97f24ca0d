"""A thin async Kubernetes client over kr8s's authenticated session: plain JSON in and out, by resource path.

kr8s finds the credentials (KUBECONFIG, ~/.kube/config, or the in-cluster service account).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from dataclasses import dataclass

import kr8s.asyncio

from diloco_operator import conditions as C


@dataclass(frozen=True)
class Resource:
    """Where a kind lives in the API."""

    group_version: str  # "v1", "apps/v1", "diloco.dev/v1alpha1"
    plural: str
    namespaced: bool = True


PODS = Resource("v1", "pods")
SERVICES = Resource("v1", "services")
SECRETS = Resource("v1", "secrets")
CONFIGMAPS = Resource("v1", "configmaps")
PVCS = Resource("v1", "persistentvolumeclaims")
EVENTS = Resource("v1", "events")
NODES = Resource("v1", "nodes", namespaced=False)
DEPLOYMENTS = Resource("apps/v1", "deployments")
DILOCOJOBS = Resource("diloco.dev/v1alpha1", "dilocojobs")
LEARNERUNITS = Resource("diloco.dev/v1alpha1", "learnerunits")
KINDS = {"Pod": PODS, "Service": SERVICES, "Secret": SECRETS, "ConfigMap": CONFIGMAPS,
         "PersistentVolumeClaim": PVCS, "Deployment": DEPLOYMENTS, "DilocoJob": DILOCOJOBS, "LearnerUnit": LEARNERUNITS}


class ApiError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class Kube:
    """Async JSON calls against the API server (one shared HTTP session)."""

    def __init__(self, api, timeout_s: float = 30.0):
        self.api = api
        self.api.timeout = timeout_s
        self.instance = os.environ.get("POD_NAME") or socket.gethostname()
        self._reauth = asyncio.Lock()

    @classmethod
    async def connect(cls, timeout_s: float = 30.0) -> "Kube":
        return cls(await kr8s.asyncio.api(), timeout_s)

    async def request(self, method: str, res: Resource, namespace: str | None = None, name: str | None = None,
                      subresource: str | None = None, body: dict | None = None, params: dict | None = None,
                      content_type: str = "application/json") -> dict:
        """One API call; raises ApiError with the server's status and message."""
        parts = [res.plural] + ([name] if name else []) + ([subresource] if subresource else [])
        kwargs: dict = {"params": params or {}}
        if body is not None:
            kwargs["content"] = json.dumps(body)
            kwargs["headers"] = {"Content-Type": content_type}
        base = "/api" if res.group_version == "v1" else "/apis"
        for attempt in (1, 2):
            # raise_for_status=False: kr8s would re-authenticate on every 403 (e.g. "namespace is being
            # terminated") and rebuild the session shared by concurrent reconciles; only 401 warrants that.
            async with self.api.call_api(method, version=res.group_version, base=base,
                                         namespace=namespace if res.namespaced else None,
                                         url="/".join(parts), raise_for_status=False, **kwargs) as resp:
                if resp.status_code == 401 and attempt == 1:
                    async with self._reauth:
                        await self.api.reauthenticate()  # e.g. a rotated service-account token
                    continue
                if resp.is_error:
                    try:
                        message = resp.json().get("message", resp.text)
                    except ValueError:
                        message = resp.text
                    raise ApiError(resp.status_code, message)
                return resp.json() if resp.content else {}
        raise AssertionError("unreachable")

    async def get(self, res: Resource, namespace: str | None, name: str) -> dict | None:
        """The object, or None if it does not exist."""
        try:
            return await self.request("GET", res, namespace, name)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, res: Resource, namespace: str | None, selector: str | None = None) -> list[dict]:
        params = {"labelSelector": selector} if selector else None
        return (await self.request("GET", res, namespace, params=params)).get("items", [])

    async def create(self, res: Resource, obj: dict) -> dict | None:
        """Create; None if an object of that name already exists (creation is idempotent by name)."""
        try:
            return await self.request("POST", res, obj["metadata"].get("namespace"), body=obj)
        except ApiError as exc:
            if exc.status == 409:
                return None
            raise

    async def merge_patch(self, res: Resource, namespace: str | None, name: str, patch: dict,
                          subresource: str | None = None) -> dict:
        return await self.request("PATCH", res, namespace, name, subresource, body=patch,
                                  content_type="application/merge-patch+json")

    async def delete(self, res: Resource, namespace: str | None, name: str, propagation: str = "Background") -> bool:
        """Delete; False if it was already gone."""
        try:
            await self.request("DELETE", res, namespace, name, params={"propagationPolicy": propagation})
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise

    async def event(self, obj: dict, type_: str, reason: str, message: str) -> None:
        """Record an Event on `obj` (what `kubectl describe` shows)."""
        meta = obj["metadata"]
        now = C.now_iso()
        ev = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta.get("namespace") or "default"},
            "involvedObject": {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": meta["name"],
                               "namespace": meta.get("namespace"), "uid": meta.get("uid")},
            "type": type_, "reason": reason, "message": message[:1024], "count": 1,
            "firstTimestamp": now, "lastTimestamp": now,
            "source": {"component": "diloco-operator"},
            "reportingComponent": "diloco.dev/operator", "reportingInstance": self.instance,
        }
        await self.request("POST", EVENTS, ev["metadata"]["namespace"], body=ev)


def status_patch(old: dict | None, new: dict) -> dict | None:
    """A JSON merge patch turning status `old` into `new` (None when nothing changed); removed keys become null."""
    old = old or {}
    if old == new:
        return None
    patch = {k: v for k, v in new.items() if old.get(k) != v}
    patch.update({k: None for k in old if k not in new})
    return patch
