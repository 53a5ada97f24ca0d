"""The compressed down-link: fragment versions published as quantized updates that every learner reconstructs
bit-identically, the bounded history of those updates, and their safetensors wire format (docs/protocol.md).

With `outer.downlink` int8/int4 the syncer's published Θ_p is *defined* by its updates:
  Θ_p(v) = Θ_p(prev) + dequantize(quantize(Θ_p*(v) − Θ_p(prev) + r)),  r ← what quantization dropped,
where Θ_p* is the exact outer-step result. `apply_update` is the one function both sides use for the sum, so a
learner holding Θ_p(prev) gets exactly the syncer's Θ_p(v) (elementwise fp32 multiply then add: no fused op).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from .wire import WireError, decode_tensors, dequantize, encode_tensors, quantize

DOWNLINKS = ("fp32", "bf16", "int8", "int4")
QUANTIZED = ("int8", "int4")
Parts = dict[str, dict[str, Tensor]]  # parameter name -> {"q", "scale"}


def is_quantized(downlink: str) -> bool:
    return downlink in QUANTIZED


def fragment_digest(tensors: dict[str, Tensor]) -> str:
    """sha256 of a fragment's fp32 values (names sorted; name, shape and raw little-endian bytes of each)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode() + b"\0" + json.dumps(list(t.shape)).encode() + b"\0")
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def apply_update(held: dict[str, Tensor], parts: Parts, scheme: str, block_size: int) -> dict[str, Tensor]:
    """Θ(prev) + dequantize(parts): new fp32 tensors (never mutates `held`). Raises WireError on bad parts."""
    if set(parts) != set(held):
        raise WireError(f"update names {sorted(set(parts) ^ set(held))[:5]} do not match the fragment")
    out = {}
    for name, base in held.items():
        step = dequantize(parts[name], scheme, tuple(base.shape), block_size)
        out[name] = torch.add(base.to(torch.float32), step)
    return out


def publish(current: dict[str, Tensor], exact: dict[str, Tensor], residual: dict[str, Tensor], scheme: str,
            block_size: int) -> tuple[dict[str, Tensor], Parts, dict[str, Tensor]]:
    """(published Θ, the update's parts, the new residual) for moving `current` towards `exact` (pure)."""
    parts: Parts = {}
    new_residual: dict[str, Tensor] = {}
    for name, base in current.items():
        x = exact[name] - base
        if name in residual:
            x = x + residual[name]
        parts[name] = quantize(x, scheme, block_size)
        new_residual[name] = x - dequantize(parts[name], scheme, tuple(x.shape), block_size)
    return apply_update(current, parts, scheme, block_size), parts, new_residual


@dataclass(frozen=True)
class Update:
    """One published update: version `version` = version `prev` + dequantize(parts)."""

    prev: int
    version: int
    parts: Parts
    nbytes: int  # tensor payload bytes
    digest: str  # fragment_digest of version `version`


class UpdateHistory:
    """The last `keep` updates of one fragment, by the version they produce (in memory: gone after a restart,
    when a learner behind the restored version simply gets the full fragment)."""

    def __init__(self, keep: int):
        self.keep = keep
        self._by_version: OrderedDict[int, Update] = OrderedDict()

    def add(self, update: Update) -> None:
        self._by_version[update.version] = update
        while len(self._by_version) > self.keep:
            self._by_version.popitem(last=False)

    def chain(self, base: int, current: int) -> list[Update] | None:
        """The updates leading from `base` to `current`, oldest first ([] if equal); None if not all are kept."""
        out: list[Update] = []
        v = current
        while v != base:
            u = self._by_version.get(v)
            if u is None:
                return None
            out.append(u)
            v = u.prev
        return out[::-1]

    def __len__(self) -> int:
        return len(self._by_version)


def update_nbytes(parts: Parts) -> int:
    """Tensor payload bytes of one update."""
    return sum(t.numel() * t.element_size() for p in parts.values() for t in p.values())


def full_nbytes(shapes: dict[str, tuple[int, ...]]) -> int:
    """Payload bytes of the fragment as fp32 (what a full answer carries)."""
    return 4 * sum(math.prod(s) for s in shapes.values())


# ------------------------------------------------------------------------------------------ wire format


def encode_chain(fragment: int, base: int, version: int, chain: list[Update], scheme: str, block_size: int,
                 digest: str) -> bytes:
    """A delta answer: the chain's updates as `{i}:{name}.q` / `{i}:{name}.scale`, and the resulting digest."""
    tensors: dict[str, Tensor] = {}
    for i, u in enumerate(chain):
        for name, p in u.parts.items():
            tensors[f"{i}:{name}.q"], tensors[f"{i}:{name}.scale"] = p["q"], p["scale"]
    meta = {"fragment": str(fragment), "version": str(version), "encoding": "delta", "base": str(base),
            "chain": json.dumps([u.version for u in chain]), "compression": scheme, "block_size": str(block_size),
            "sha256": digest}
    return encode_tensors(tensors, meta)


@dataclass
class Answer:
    """A decoded `GET /v1/fragments/{p}` body: the version and either full tensors or a chain to apply."""

    fragment: int
    version: int
    encoding: str  # "full" | "delta"
    tensors: dict[str, Tensor] | None = None  # full
    base: int | None = None  # delta
    steps: list[Parts] | None = None
    scheme: str = ""
    block_size: int = 0
    digest: str | None = None


def _int(meta: dict[str, str], field: str) -> int:
    raw = meta.get(field)
    if raw is None or not raw.lstrip("-").isdigit() or len(raw) > 20:
        raise WireError(f"fragment answer: metadata field {field!r} must be an integer, got {raw!r}")
    return int(raw)


def decode_answer(body: bytes) -> Answer:
    """Parse a fragment answer (full or delta); WireError if it is malformed."""
    tensors, meta = decode_tensors(body)
    fragment, version = _int(meta, "fragment"), _int(meta, "version")
    if meta.get("encoding", "full") == "full":
        return Answer(fragment, version, "full", tensors=tensors, digest=meta.get("sha256"))
    if meta["encoding"] != "delta":
        raise WireError(f"fragment answer: unknown encoding {meta['encoding']!r}")
    scheme, block_size = meta.get("compression", ""), _int(meta, "block_size")
    if scheme not in QUANTIZED or block_size < 1:
        raise WireError(f"fragment answer: a delta needs int8/int4 and a positive block size, got {scheme!r}")
    try:
        chain = json.loads(meta.get("chain", ""))
    except ValueError:
        raise WireError("fragment answer: metadata field 'chain' is not JSON") from None
    if not isinstance(chain, list) or not meta.get("sha256"):
        raise WireError("fragment answer: a delta needs a 'chain' list and a 'sha256' digest")
    steps: list[Parts] = [{} for _ in chain]
    for key, t in tensors.items():
        idx, sep, rest = key.partition(":")
        name, dot, part = rest.rpartition(".")
        if not (sep and dot and idx.isdigit() and int(idx) < len(steps) and part in ("q", "scale")):
            raise WireError(f"fragment answer: unexpected tensor {key[:80]!r}")
        steps[int(idx)].setdefault(name, {})[part] = t
    return Answer(fragment, version, "delta", base=_int(meta, "base"), steps=steps, scheme=scheme,
                  block_size=block_size, digest=meta["sha256"])


def reconstruct(held: dict[str, Tensor], answer: Answer) -> dict[str, Tensor]:
    """Apply a delta answer's chain to `held` and check the digest; WireError if anything does not fit."""
    assert answer.encoding == "delta" and answer.steps is not None
    theta = held
    for parts in answer.steps:
        theta = apply_update(theta, parts, answer.scheme, answer.block_size)
    if fragment_digest(theta) != answer.digest:
        raise WireError(f"fragment {answer.fragment} version {answer.version}: the reconstructed values do not "
                        "match the syncer's digest")
    return theta
