"""Copies of kopf's watch bodies, made for what they hold: JSON trees.

The operator's CPU while thousands of units start goes mostly to handling watch events (docs/operator.md, "Scale
benchmark"), and most of that was copying: `copy.deepcopy` of every body for the cache, and kopf's diff base
(`AnnotationsDiffBaseStorage.build`, run on every event of every watched kind) deep-copies the *whole* body (status
and managedFields included) only to delete all but the spec, labels and annotations from the copy."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import kopf


def tree_copy(value: Any) -> Any:
    """A deep copy of a JSON tree (mappings, lists, scalars) as plain dicts and lists: what `copy.deepcopy` gives for
    a parsed API object, ~3x faster (no memo, no per-type dispatch). Strings and numbers are immutable and shared."""
    if isinstance(value, Mapping):
        return {k: tree_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [tree_copy(v) for v in value]
    return value


# The metadata kopf's annotation storage reads when it builds an essence: the labels and annotations it keeps, and
# the owners its storage-key convention looks at (`mark_key`: a Deployment's ReplicaSet gets its own key).
_ESSENCE_METADATA = ("labels", "annotations", "ownerReferences")


class SlimDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's default diff base (the `last-handled-configuration` annotation, same keys, same essence), built from
    the parts of the body that end up in the essence instead of from a deep copy of all of it."""

    def build(self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None) -> kopf.BodyEssence:
        fields = list(extra_fields or ())
        if fields:  # a handler on a chosen field (e.g. in status) may keep any part: kopf's own way
            return super().build(body=body, extra_fields=fields)
        meta = body.get("metadata") or {}
        slim = {k: v for k, v in body.items() if k not in ("metadata", "status")}
        slim["metadata"] = {k: meta[k] for k in _ESSENCE_METADATA if k in meta}
        return super().build(body=kopf.Body(slim))
