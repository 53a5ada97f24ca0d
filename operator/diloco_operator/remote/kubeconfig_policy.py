"""Which remote-cluster kubeconfigs the operator accepts: inline credentials only, checked before any client is
built, so a kubeconfig Secret can neither run a program inside the operator nor make it read (and send) its own files.
"""

from __future__ import annotations

from urllib.parse import urlsplit

# Fields the official client turns into a program run or a file read, and why each is refused.
_EXEC = "an exec plugin would run a program inside the operator"
_AUTH_PROVIDER = "an auth-provider runs a command (cmd-path) or reads files inside the operator"
_FILE = "a file path would make the operator read its own files (and send them to that server)"
REFUSED_USER = {
    "exec": _EXEC, "auth-provider": _AUTH_PROVIDER, "tokenFile": _FILE, "client-certificate": _FILE,
    "client-key": _FILE,
}
REFUSED_CLUSTER = {
    "certificate-authority": _FILE,
    "insecure-skip-tls-verify": "the server's certificate must be verified (give certificate-authority-data): "
                                "whoever answers in its place would get the credential",
    "proxy-url": "the operator does not dial through proxies named by a Secret",
}
# Everything else a user or cluster entry may hold; anything not listed is refused too, so a field a future client
# learns to execute or read is not accepted by default.
ALLOWED_USER = {"token", "client-certificate-data", "client-key-data", "username", "password", "extensions"}
ALLOWED_CLUSTER = {"server", "certificate-authority-data", "tls-server-name", "disable-compression", "extensions"}
ALLOWED_TOP = {"apiVersion", "kind", "clusters", "contexts", "users", "current-context", "preferences", "extensions"}
ALLOWED_CONTEXT = {"cluster", "user", "namespace", "extensions"}
INLINE_HINT = ("use only inline credentials: users[].user.token or client-certificate-data + client-key-data, and "
               "clusters[].cluster.certificate-authority-data")


class KubeconfigRefused(ValueError):
    """A kubeconfig the operator will not load; the message names the field and why."""


def _entries(config: dict, section: str, body: str) -> list[tuple[str, dict]]:
    items = config.get(section) or []
    if not isinstance(items, list):
        raise KubeconfigRefused(f"{section}: must be a list")
    out = []
    for i, item in enumerate(items):
        where = f"{section}[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get(body) or {}, dict):
            raise KubeconfigRefused(f"{where}: must be a mapping with a {body!r} mapping")
        out.append((f"{where}.{body}", item.get(body) or {}))
    return out


def _check_fields(where: str, fields: dict, refused: dict[str, str], allowed: set[str]) -> None:
    for key in fields:
        if key in refused:
            raise KubeconfigRefused(f"{where}.{key}: {refused[key]}; {INLINE_HINT}")
        if key not in allowed:
            raise KubeconfigRefused(f"{where}.{key}: not accepted in a remote cluster's kubeconfig; {INLINE_HINT}")


def check_inline(config: object) -> None:
    """Raise KubeconfigRefused unless every user and cluster of `config` (a parsed kubeconfig) holds only inline
    credentials and an https server: the whole document is checked, not just the context in use."""
    if not isinstance(config, dict):
        raise KubeconfigRefused("not a kubeconfig: the document must be a mapping")
    _check_fields("kubeconfig", config, {}, ALLOWED_TOP)
    for where, user in _entries(config, "users", "user"):
        _check_fields(where, user, REFUSED_USER, ALLOWED_USER)
        if ("client-certificate-data" in user) != ("client-key-data" in user):
            raise KubeconfigRefused(f"{where}: client-certificate-data and client-key-data go together")
    for where, cluster in _entries(config, "clusters", "cluster"):
        _check_fields(where, cluster, REFUSED_CLUSTER, ALLOWED_CLUSTER)
        server = cluster.get("server")
        if not isinstance(server, str) or urlsplit(server).scheme != "https" or not urlsplit(server).hostname:
            raise KubeconfigRefused(f"{where}.server: must be an https:// URL (got {str(server)[:80]!r}): "
                                    "a credential sent over plain HTTP can be read on the way")
    for where, context in _entries(config, "contexts", "context"):
        _check_fields(where, context, {}, ALLOWED_CONTEXT)
