"""The compressed down-link: fragment versions published as quantized updates that every learner reconstructs
bit-identically, the bounded history of those updates, and their safetensors wire format (docs/protocol.md).

With `outer.downlink` int8/int4/int2 the syncer's published Θ_p is *defined* by its updates:
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

from diloco_trainer.model.build import build_model
from diloco_trainer.protocol.wire import WireError, decode_tensors, dequantize, encode_tensors, quantize

QUANTIZED = ("int8", "int4", "int2")
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


def initial_theta(config) -> dict[str, Tensor]:
    """Version 0 of every fragment: the run's initial parameters, as the syncer builds them (fp32)."""
    model = build_model(config.model, config.seed)
    return {n: p.detach().clone().float() for n, p in model.named_parameters()}


def quantize_update(x: Tensor, scheme: str, block_size: int) -> dict[str, Tensor]:
    """wire.quantize for int8/int4; int2 here: four levels {-3, -1, 1, 3}·absmax/3 per block, four codes per byte
    (the up-link never uses int2: without the syncer's error feedback it collapses; docs/protocol.md, "Down-link")."""
    if scheme != "int2":
        return quantize(x, scheme, block_size)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("cannot compress a tensor with non-finite values")
    flat = x.detach().reshape(-1).to(torch.float32)
    blocks = -(-flat.numel() // block_size)
    padded = torch.nn.functional.pad(flat, (0, blocks * block_size - flat.numel())).view(blocks, block_size)
    scale = padded.abs().amax(dim=1) / 3
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    # The nearest odd level: code c in 0..3 stands for 2c - 3.
    code = torch.floor(padded / safe[:, None] / 2 + 2).clamp_(0, 3).to(torch.uint8).reshape(-1)
    code = torch.nn.functional.pad(code, (0, -code.numel() % 4)).view(-1, 4)
    q = code[:, 0] | (code[:, 1] << 2) | (code[:, 2] << 4) | (code[:, 3] << 6)
    return {"q": q.contiguous(), "scale": scale.contiguous()}


def dequantize_update(parts: dict[str, Tensor], scheme: str, shape: tuple[int, ...], block_size: int) -> Tensor:
    """Inverse of `quantize_update` (WireError if the parts do not fit `shape`)."""
    if scheme != "int2":
        return dequantize(parts, scheme, shape, block_size)
    numel = math.prod(shape)
    blocks = -(-numel // block_size)
    if set(parts) != {"q", "scale"}:
        raise WireError(f"int2 update: expected parts ['q', 'scale'], got {sorted(parts)}")
    q, scale = parts["q"], parts["scale"]
    if q.dtype != torch.uint8 or q.numel() != -(-blocks * block_size // 4):
        raise WireError(f"int2 update: q must be {-(-blocks * block_size // 4)} uint8 values")
    if scale.dtype != torch.float32 or scale.numel() != blocks or not bool(torch.isfinite(scale).all()) \
            or bool((scale < 0).any()):
        raise WireError(f"int2 update: scale must be {blocks} finite non-negative float32 values")
    codes = torch.stack([(q >> s) & 3 for s in (0, 2, 4, 6)], dim=1).reshape(-1)[: blocks * block_size]
    levels = codes.to(torch.float32) * 2 - 3  # exact small integers
    values = levels.view(blocks, block_size) * scale[:, None]
    return values.reshape(-1)[:numel].reshape(shape)


def apply_update(held: dict[str, Tensor], parts: Parts, scheme: str, block_size: int) -> dict[str, Tensor]:
    """Θ(prev) + dequantize(parts): new fp32 tensors (never mutates `held`). Raises WireError on bad parts."""
    if set(parts) != set(held):
        raise WireError(f"update names {sorted(set(parts) ^ set(held))[:5]} do not match the fragment")
    out = {}
    for name, base in held.items():
        step = dequantize_update(parts[name], scheme, tuple(base.shape), block_size)
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
        parts[name] = quantize_update(x, scheme, block_size)
        new_residual[name] = x - dequantize_update(parts[name], scheme, tuple(x.shape), block_size)
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
