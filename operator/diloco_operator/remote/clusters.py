"""Clients of the remote clusters a DilocoJob names in spec.clusters (docs/operator.md "Remote clusters").

Each (job, cluster) gets its own official-client `Kube`, built from the kubeconfig in the job's Secret (inline
credentials only: kubeconfig_policy refuses exec plugins, auth-providers and file paths before any client is built)
and rebuilt when that Secret changes. Whether a cluster answered the last
call is remembered per (job, cluster): the job's `ClustersReachable` condition is made from it.
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass

import yaml

from diloco_kube.answers import excerpt
from diloco_kube.client import NAMESPACES, SECRETS, ApiError, Kube

from diloco_operator.api import conditions as C
from diloco_operator.api import models as api
from diloco_operator.remote.kubeconfig_policy import KubeconfigRefused, check_inline

REMOTE_TIMEOUT_S = 5.0  # a remote apiserver that does not answer within this is unreachable for this pass
SECRET_TTL_S = 30.0  # the kubeconfig Secret is read again at most this often
WHY_CHARS = 400  # why a cluster failed, as conditions and Events say it: one line, never an answer's body


def why_failed(text: str) -> str:
    """`text` (a failure, with the client's error in it) fit for a condition or Event: one line, at most WHY_CHARS."""
    return excerpt(text, WHY_CHARS)


class ClusterUnavailable(Exception):
    """A remote cluster cannot be used now: its kubeconfig is missing, broken or refused, or its apiserver does not
    answer. The message says which and why; `reason` is the condition reason to show."""

    def __init__(self, message: str, reason: str = C.Reason.CLUSTER_UNREACHABLE):
        super().__init__(message)
        self.reason = reason


def parse_kubeconfig(raw: str) -> dict:
    """The kubeconfig in a Secret's base64 `raw` value, if the operator may load it (KubeconfigRefused otherwise,
    naming the field). Parse errors give a position, never the Secret's content."""
    try:
        config = yaml.safe_load(base64.b64decode(raw))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise KubeconfigRefused(f"not YAML{where}") from None
    except ValueError:
        raise KubeconfigRefused("not base64") from None
    check_inline(config)
    return config


@dataclass
class Remote:
    """One remote cluster of one job: its client and the namespace the job's objects go to there."""

    cluster: str
    kube: Kube
    namespace: str
    secret_version: str  # resourceVersion of the kubeconfig Secret this client was built from
    read_at: float  # when that Secret was last read
    namespace_ready: bool = False


# Errors of a call that did not reach an apiserver's answer (connection refused, timeouts, TLS): urllib3 raises
# these from the official client, wrapped or not.
def unreachable(exc: BaseException) -> bool:
    if isinstance(exc, ApiError):
        return exc.status == 0 or exc.status >= 500
    return isinstance(exc, (OSError, asyncio.TimeoutError)) or type(exc).__module__.startswith("urllib3")


class RemoteClusters:
    """The remote clusters' clients, keyed by (namespace, job, cluster); `home` reads the kubeconfig Secrets."""

    def __init__(self, home: Kube, timeout_s: float = REMOTE_TIMEOUT_S):
        self.home, self.timeout_s = home, timeout_s
        self.clients: dict[tuple[str, str, str], Remote] = {}
        self.errors: dict[tuple[str, str, str], str | None] = {}  # None: answered last time
        self._locks: dict[tuple[str, str, str], asyncio.Lock] = {}

    async def get(self, namespace: str, job: str, cluster: api.RemoteCluster) -> Remote:
        """The client of `cluster` for `job` (ClusterUnavailable if its kubeconfig cannot be used)."""
        key = (namespace, job, cluster.name)
        async with self._locks.setdefault(key, asyncio.Lock()):
            current = self.clients.get(key)
            if current is not None and time.monotonic() - current.read_at < SECRET_TTL_S:
                return current
            secret = await self.home.get(SECRETS, namespace, cluster.kubeconfigSecret.name)
            where = f"spec.clusters[{cluster.name}].kubeconfigSecret"
            if secret is None:
                raise ClusterUnavailable(f"{where}: Secret {cluster.kubeconfigSecret.name} not found")
            version = secret["metadata"].get("resourceVersion", "")
            if current is not None and current.secret_version == version:
                current.read_at = time.monotonic()
                return current
            raw = (secret.get("data") or {}).get(cluster.kubeconfigSecret.key)
            if not raw:
                raise ClusterUnavailable(f"{where}: Secret {cluster.kubeconfigSecret.name} has no key "
                                         f"{cluster.kubeconfigSecret.key!r}")
            try:
                config = parse_kubeconfig(raw)
            except KubeconfigRefused as exc:
                raise ClusterUnavailable(f"{where}: kubeconfig refused: {exc}", C.Reason.KUBECONFIG_REFUSED) from None
            try:
                kube = await Kube.from_kubeconfig(config, cluster.context, timeout_s=self.timeout_s, pool=4)
            except Exception as exc:  # noqa: BLE001 - any broken kubeconfig is the user's to fix, said in status
                raise ClusterUnavailable(f"{where}: not a usable kubeconfig: {exc}") from None
            if current is not None:
                current.kube.close()
            remote = Remote(cluster.name, kube, cluster.namespace or namespace, version, time.monotonic())
            self.clients[key] = remote
            return remote

    async def namespace(self, remote: Remote) -> None:
        """Create the job's namespace in the remote cluster if it is not there (once per client)."""
        if remote.namespace_ready:
            return
        await remote.kube.create(NAMESPACES, {"apiVersion": "v1", "kind": "Namespace",
                                              "metadata": {"name": remote.namespace}})
        remote.namespace_ready = True

    def answered(self, namespace: str, job: str, cluster: str) -> None:
        self.errors[(namespace, job, cluster)] = None

    def failed(self, namespace: str, job: str, cluster: str, why: str) -> None:
        self.errors[(namespace, job, cluster)] = why_failed(why)

    def unreachable_clusters(self, namespace: str, job: str) -> dict[str, str]:
        """Cluster -> why, for the clusters of `job` whose last use failed."""
        return {k[2]: why for k, why in self.errors.items() if k[:2] == (namespace, job) and why}

    def forget(self, namespace: str, job: str) -> None:
        for key in [k for k in self.clients if k[:2] == (namespace, job)]:
            self.clients.pop(key).kube.close()
        for key in [k for k in self.errors if k[:2] == (namespace, job)]:
            del self.errors[key]
