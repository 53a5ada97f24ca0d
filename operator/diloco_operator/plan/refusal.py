"""A syncer that refuses its run (exit 2, reason in the termination message) as the job's InvalidSpec: what the CRD
cannot check at apply time (a model's tensor count, a checkpoint of another model) is read back from the pod."""

from __future__ import annotations

import re
from datetime import datetime

from diloco_operator.objects import builders as O
from diloco_trainer.config import TrainConfig

REFUSAL_EXIT_CODE = 2  # `diloco syncer` exits 2 on a run it cannot serve, and only then
MESSAGE_PREFIX = "diloco syncer: "
# A refused spec is tried again after this long even unchanged (the data volume's files may have been fixed);
# an edit of the job's spec tries again at once.
RETRY_AFTER_S = 600.0
_FIELD = re.compile(r"^([a-z_]+)((?:\.[A-Za-z_][A-Za-z_0-9]*)*)")


def name_the_field(message: str) -> str:
    """`outer.fragments (9) must ...` -> `spec.config.outer.fragments (9) must ...`: the syncer names fields of
    its config, which the job holds under spec.config."""
    found = _FIELD.match(message)
    if found and found.group(1) in TrainConfig.model_fields and found.group(2):
        return "spec.config." + message
    return message


def _terminations(status: dict) -> list[dict]:
    return [t for key in ("state", "lastState") if (t := (status.get(key) or {}).get("terminated"))]


def refusal_of(pods: list[dict], config_hash: str, image: str) -> str | None:
    """The reason a syncer pod of the current config (its `diloco.dev/config-hash`) and image gave for refusing the
    run, field named, or None. Pods of an older config or image, and other exits, are not refusals."""
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp") or (meta.get("annotations") or {}).get(O.ANNOTATION_CONFIG_HASH) != config_hash:
            continue
        images = {c.get("name"): c.get("image") for c in (pod.get("spec") or {}).get("containers") or []}
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            if images.get(container.get("name")) != image:
                continue
            for ended in _terminations(container):
                message = (ended.get("message") or "").strip()
                if ended.get("exitCode") == REFUSAL_EXIT_CODE and message.startswith(MESSAGE_PREFIX):
                    return name_the_field(message[len(MESSAGE_PREFIX):])
    return None


def still_refused(recorded: dict | None, generation: int | None, now: datetime) -> bool:
    """Whether a refusal recorded in the job's status (`syncerRefusal`) still holds: the spec it was given for is
    unchanged and it is younger than RETRY_AFTER_S."""
    if not recorded or recorded.get("generation") != generation:
        return False
    try:
        at = datetime.fromisoformat(recorded["at"].replace("Z", "+00:00"))
    except (KeyError, AttributeError, ValueError):
        return False
    return (now - at).total_seconds() < RETRY_AFTER_S
