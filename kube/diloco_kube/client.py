"""The operator's and chaos' own API access: the official `kubernetes` client, plain JSON in and out by resource
path, its blocking calls run on a small thread pool so the event loop never waits on the network.

Credentials: an explicit kubeconfig (remote clusters), else KUBECONFIG / ~/.kube/config, else the in-cluster
service account (whose token the client re-reads when it rotates).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from urllib.parse import quote

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from prometheus_client import Counter

from diloco_kube.answers import MAX_ANSWER_BYTES, AnswerRefused, CappedPool, excerpt

CALL_GRACE_S = 5.0  # past timeout_s, before a call stops waiting for its thread (whose own bounds usually end it)
API_REQUESTS = Counter("diloco_operator_api_requests_total", "Requests the operator's own client sent to the API server",
                       ["verb", "resource"])


def _now_iso() -> str:
    """RFC 3339 UTC timestamp with seconds precision, as Kubernetes writes them."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


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
NAMESPACES = Resource("v1", "namespaces", namespaced=False)
DEPLOYMENTS = Resource("apps/v1", "deployments")
DILOCOJOBS = Resource("diloco.dev/v1alpha1", "dilocojobs")
LEARNERUNITS = Resource("diloco.dev/v1alpha1", "learnerunits")
NETWORKPOLICIES = Resource("networking.k8s.io/v1", "networkpolicies")
WORKLOADS = Resource("kueue.x-k8s.io/v1beta2", "workloads")  # Kueue (operator --kueue)
RESOURCEFLAVORS = Resource("kueue.x-k8s.io/v1beta2", "resourceflavors", namespaced=False)
WORKLOADPRIORITYCLASSES = Resource("kueue.x-k8s.io/v1beta2", "workloadpriorityclasses", namespaced=False)
KINDS = {"Pod": PODS, "Service": SERVICES, "Secret": SECRETS, "ConfigMap": CONFIGMAPS,
         "PersistentVolumeClaim": PVCS, "Deployment": DEPLOYMENTS, "DilocoJob": DILOCOJOBS, "LearnerUnit": LEARNERUNITS,
         "NetworkPolicy": NETWORKPOLICIES}

# StatusCause types and Status reasons the operator acts on (never the human-readable message).
CAUSE_NAMESPACE_TERMINATING = "NamespaceTerminating"
REASON_NOT_FOUND = "NotFound"
REASON_ALREADY_EXISTS = "AlreadyExists"
REASON_CONFLICT = "Conflict"


class ApiError(Exception):
    """A non-2xx answer from the API server, with its Status body (`reason`, `code`, `details`) kept; its message
    (what str() and conditions show) is a short single-line excerpt, never the answer's body (docs/security.md)."""

    def __init__(self, status: int, body: dict | None = None, text: str = ""):
        body = body if isinstance(body, dict) else {}
        self.status = status
        self.body = body
        self.reason: str = excerpt(str(body.get("reason") or ""), 64)
        code = body.get("code")
        self.code: int = code if isinstance(code, int) else status
        self.message: str = excerpt(str(body.get("message") or text))
        super().__init__(f"{status} {self.reason}: {self.message}")

    @property
    def causes(self) -> list[str]:
        """The StatusCause types of the error (e.g. NamespaceTerminating)."""
        details = self.body.get("details")
        causes = details.get("causes") if isinstance(details, dict) else None
        return [str(c.get("reason") or c.get("type") or "") for c in causes or [] if isinstance(c, dict)]

    @property
    def namespace_terminating(self) -> bool:
        return self.status == 403 and CAUSE_NAMESPACE_TERMINATING in self.causes


def _api_client(kubeconfig: str | None, context: str | None, pool: int) -> k8s.ApiClient:
    cfg = k8s.Configuration()
    if kubeconfig or os.environ.get("KUBECONFIG") or os.path.exists(os.path.expanduser("~/.kube/config")):
        k8s_config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
    else:
        k8s_config.load_incluster_config(client_configuration=cfg)
    cfg.connection_pool_maxsize = pool
    cfg.retries = False  # a failed call is retried by the controller's backoff, not hidden in urllib3
    return k8s.ApiClient(cfg)


class Kube:
    """JSON calls against one API server (official client, blocking I/O on `pool` threads). Each answer is read up to
    `max_answer_bytes` and within `timeout_s` (answers.CappedPool); a call waits at most that long for its thread."""

    def __init__(self, api_client: k8s.ApiClient, timeout_s: float = 30.0, pool: int = 16,
                 max_answer_bytes: int = MAX_ANSWER_BYTES):
        self.api_client = api_client
        rest = api_client.rest_client
        if isinstance(rest.pool_manager, CappedPool):  # a client shared with another Kube
            rest.pool_manager = rest.pool_manager.pool
        rest.pool_manager = CappedPool(rest.pool_manager, max_answer_bytes, timeout_s)
        self.timeout_s = timeout_s
        self.executor = ThreadPoolExecutor(max_workers=pool, thread_name_prefix="kube")
        self.instance = os.environ.get("POD_NAME") or socket.gethostname()

    @classmethod
    async def connect(cls, kubeconfig: str | None = None, context: str | None = None, timeout_s: float = 30.0,
                      pool: int = 16) -> "Kube":
        """A client for `kubeconfig` (a remote cluster), else the default credentials."""
        api_client = await asyncio.to_thread(_api_client, kubeconfig, context, pool)
        return cls(api_client, timeout_s, pool)

    @classmethod
    async def from_kubeconfig(cls, config: dict, context: str | None = None, timeout_s: float = 30.0,
                              pool: int = 16, max_answer_bytes: int = MAX_ANSWER_BYTES) -> "Kube":
        """A client for a kubeconfig given as a document (a remote cluster's, read from a Secret)."""
        def build() -> k8s.ApiClient:
            cfg = k8s.Configuration()
            k8s_config.load_kube_config_from_dict(config, context=context, client_configuration=cfg)
            cfg.connection_pool_maxsize = pool
            cfg.retries = False
            return k8s.ApiClient(cfg)
        return cls(await asyncio.to_thread(build), timeout_s, pool, max_answer_bytes)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.api_client.close()

    def _call(self, method: str, path: str, params: list[tuple[str, str]], body: dict | None,
              content_type: str) -> dict:
        try:
            resp = self.api_client.call_api(
                path, method, query_params=params, header_params={"Content-Type": content_type,
                                                                  "Accept": "application/json"},
                body=body, auth_settings=["BearerToken"], _preload_content=False, _request_timeout=self.timeout_s)
        except ApiException as exc:  # its body read bounded by CappedPool
            text = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else (exc.body or exc.reason or "")
            try:
                status_body = json.loads(text)
            except ValueError:
                status_body = None
            raise ApiError(exc.status or 0, status_body, text) from None
        except AnswerRefused as exc:  # too large or too slow: no usable answer
            raise ApiError(0, None, str(exc)) from None
        return json.loads(resp.data) if resp.data else {}

    async def request(self, method: str, res: Resource, namespace: str | None = None, name: str | None = None,
                      subresource: str | None = None, body: dict | None = None, params: dict | None = None,
                      content_type: str = "application/json") -> dict:
        """One API call; raises ApiError carrying the server's Status."""
        base = "/api/v1" if res.group_version == "v1" else f"/apis/{res.group_version}"
        path = base + (f"/namespaces/{quote(namespace)}" if namespace and res.namespaced else "") + f"/{res.plural}"
        path += "".join(f"/{quote(p)}" for p in (name, subresource) if p)
        API_REQUESTS.labels(method, res.plural).inc()
        loop = asyncio.get_running_loop()
        # The thread's socket reads time out on their own; this bounds what they cannot (e.g. trickled headers).
        return await asyncio.wait_for(loop.run_in_executor(self.executor, self._call, method, path,
                                                           list((params or {}).items()), body, content_type),
                                      self.timeout_s + CALL_GRACE_S)

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
            if exc.reason == REASON_ALREADY_EXISTS:
                return None
            raise

    async def merge_patch(self, res: Resource, namespace: str | None, name: str, patch: dict,
                          subresource: str | None = None) -> dict:
        return await self.request("PATCH", res, namespace, name, subresource, body=patch,
                                  content_type="application/merge-patch+json")

    async def delete(self, res: Resource, namespace: str | None, name: str, propagation: str = "Background",
                     grace_seconds: int | None = None) -> dict | None:
        """Delete; the API's answer (the object being deleted, or a Status), None if it was already gone."""
        body = {"propagationPolicy": propagation}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        try:
            return await self.request("DELETE", res, namespace, name, body=body)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def event(self, obj: dict, type_: str, reason: str, message: str, source: str = "diloco-operator",
                    labels: dict | None = None) -> None:
        """Record an Event on `obj` (what `kubectl describe` shows)."""
        meta = obj["metadata"]
        now = _now_iso()
        ns = meta.get("namespace") or "default"
        ev = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": ns, **({"labels": labels} if labels else {})},
            "involvedObject": {"apiVersion": obj.get("apiVersion", "v1"), "kind": obj.get("kind", "Pod"),
                               "name": meta["name"], "namespace": meta.get("namespace"), "uid": meta.get("uid")},
            "type": type_, "reason": reason, "message": message[:1024], "count": 1,
            "firstTimestamp": now, "lastTimestamp": now,
            "source": {"component": source},
            "reportingComponent": f"diloco.dev/{source.removeprefix('diloco-')}",
            "reportingInstance": self.instance,
        }
        await self.request("POST", EVENTS, ns, body=ev)


def status_patch(old: dict | None, new: dict) -> dict | None:
    """A JSON merge patch turning status `old` into `new` (None when nothing changed); removed keys become null, in
    nested objects too (a merge patch merges objects: a key a new `lastFault` lacks would stay from the old one)."""
    old = old or {}
    if old == new:
        return None
    patch = {}
    for key, value in new.items():
        was = old.get(key)
        if was != value:
            patch[key] = status_patch(was, value) if isinstance(was, dict) and isinstance(value, dict) else value
    patch.update({k: None for k in old if k not in new})
    return patch
