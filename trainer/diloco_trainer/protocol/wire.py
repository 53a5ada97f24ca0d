"""Outer-gradient compression (none / bf16 / int8 / int4 blockwise, error feedback) and the safetensors wire format.

Never pickle: bodies are safetensors with string metadata, and every field is checked before use.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import asdict, dataclass

import safetensors.torch
import torch
from torch import Tensor

SCHEMES = ("none", "bf16", "int8", "int4")
_QMAX = {"int8": 127, "int4": 7}  # symmetric absmax: int8 in [-127, 127], int4 in [-7, 7] (nibble 0 unused)
_RAW_DTYPE = {"none": torch.float32, "bf16": torch.bfloat16}
_META_INTS = ("fragment", "base_version", "c_steps", "c_tokens")
# Ids end up in logs, metrics labels and spool file names on the syncer: keep them to a safe alphabet.
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
_MAX_HEADER = 100 * 1024 * 1024


class WireError(ValueError):
    """A body or its metadata is malformed; `reason` names what is wrong (sent back to the client)."""

    def __init__(self, reason: str, label: str = "malformed"):
        super().__init__(reason)
        self.reason, self.label = reason, label  # label: the syncer's metrics reason


def _check_scheme(scheme: str, block_size: int) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown compression scheme {scheme!r}; expected one of {SCHEMES}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")


def _layout(numel: int, scheme: str, block_size: int) -> tuple[int, int]:
    """(number of q elements, number of scales) that `quantize` produces for `numel` values."""
    blocks = -(-numel // block_size)
    padded = blocks * block_size
    return (padded if scheme == "int8" else -(-padded // 2)), blocks


def quantize(t: Tensor, scheme: str, block_size: int) -> dict[str, Tensor]:
    """Compress one tensor: {"": raw} for none/bf16, {"q", "scale"} blockwise for int8/int4 (absmax, fp32 scales)."""
    _check_scheme(scheme, block_size)
    x = t.detach()
    if not bool(torch.isfinite(x).all()):
        raise ValueError("cannot compress a tensor with non-finite values")
    if scheme in _RAW_DTYPE:
        return {"": x.to(_RAW_DTYPE[scheme], copy=True)}
    qmax = _QMAX[scheme]
    flat = x.reshape(-1).to(torch.float32)
    blocks = -(-flat.numel() // block_size)
    padded = torch.nn.functional.pad(flat, (0, blocks * block_size - flat.numel())).view(blocks, block_size)
    scale = padded.abs().amax(dim=1) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block quantizes to zeros
    q = torch.round(padded / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8).reshape(-1)
    if scheme == "int4":
        u = (q + 8).to(torch.uint8)  # nibble = value + 8, in [1, 15]
        if u.numel() % 2:
            u = torch.cat([u, u.new_full((1,), 8)])
        q = u[0::2] | (u[1::2] << 4)
    return {"q": q.contiguous(), "scale": scale.contiguous()}


def _check_parts(parts: dict[str, Tensor], scheme: str, numel: int, block_size: int, name: str = "tensor") -> None:
    """Raise WireError unless `parts` has exactly the keys, dtypes and lengths `quantize` would produce."""
    want = {""} if scheme in _RAW_DTYPE else {"q", "scale"}
    if set(parts) != want:
        raise WireError(f"{name}: expected parts {sorted(want)} for {scheme}, got {sorted(parts)}")
    if scheme in _RAW_DTYPE:
        raw = parts[""]
        if raw.dtype != _RAW_DTYPE[scheme]:
            raise WireError(f"{name}: dtype {raw.dtype} does not match compression {scheme}")
        if raw.numel() != numel:
            raise WireError(f"{name}: {raw.numel()} values, expected {numel}")
        return
    n_q, n_scale = _layout(numel, scheme, block_size)
    q, scale = parts["q"], parts["scale"]
    q_dtype = torch.int8 if scheme == "int8" else torch.uint8
    if q.dtype != q_dtype:
        raise WireError(f"{name}.q: dtype {q.dtype}, expected {q_dtype} for {scheme}")
    if q.numel() != n_q:
        raise WireError(f"{name}.q: length {q.numel()}, expected {n_q}")
    if scale.dtype != torch.float32:
        raise WireError(f"{name}.scale: dtype {scale.dtype}, expected torch.float32")
    if scale.numel() != n_scale:
        raise WireError(f"{name}.scale: length {scale.numel()}, expected {n_scale}")
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise WireError(f"{name}.scale: scales must be finite and non-negative")


def dequantize(parts: dict[str, Tensor], scheme: str, shape: tuple[int, ...], block_size: int) -> Tensor:
    """Inverse of `quantize`: a float32 tensor of `shape` (may share memory with parts for scheme none)."""
    _check_scheme(scheme, block_size)
    numel = math.prod(shape)
    _check_parts(parts, scheme, numel, block_size)
    if scheme in _RAW_DTYPE:
        return parts[""].to(torch.float32).reshape(shape)
    q, scale = parts["q"], parts["scale"]
    if scheme == "int4":
        q = torch.stack([q & 0x0F, q >> 4], dim=1).reshape(-1)[: scale.numel() * block_size].to(torch.int8) - 8
    values = q.to(torch.float32).view(-1, block_size) * scale[:, None]
    return values.reshape(-1)[:numel].reshape(shape)


class ErrorFeedback:
    """Per-parameter residual of what compression dropped, added back before the next compression."""

    def __init__(self) -> None:
        self._residual: dict[str, Tensor] = {}

    def compress(self, deltas: dict[str, Tensor], scheme: str, block_size: int) -> dict[str, dict[str, Tensor]]:
        """Quantize residual + delta per name and keep (input - dequantized) as the new residual."""
        _check_scheme(scheme, block_size)
        out: dict[str, dict[str, Tensor]] = {}
        new_residual: dict[str, Tensor] = {}
        for name, delta in deltas.items():
            x = delta.detach().to(torch.float32)
            if name in self._residual:
                x = x + self._residual[name]
            parts = quantize(x, scheme, block_size)
            out[name] = parts
            if scheme != "none":  # lossless: the residual stays zero, so keep none
                new_residual[name] = x - dequantize(parts, scheme, tuple(x.shape), block_size)
        # Commit only once every tensor compressed (a ValueError above changes no state). Residuals are
        # replaced, never mutated, so a state_dict() taken earlier stays a valid snapshot.
        for name in deltas:
            self._residual.pop(name, None)
        self._residual.update(new_residual)
        return out

    def residual(self, name: str) -> Tensor | None:
        """The current residual of one parameter (None if zero)."""
        return self._residual.get(name)

    def reset(self, names) -> None:
        """Forget the residuals of these parameters (e.g. after re-adopting a fragment from scratch)."""
        for name in names:
            self._residual.pop(name, None)

    def state_dict(self) -> dict[str, Tensor]:
        return dict(self._residual)

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self._residual = {name: t.detach().to(torch.float32) for name, t in state.items()}


@dataclass(frozen=True)
class SubmissionMeta:
    """Who sent a fragment's outer gradient, against which base version, after how much work."""

    learner_id: str
    submission_id: str
    fragment: int
    base_version: int
    c_steps: int
    c_tokens: int
    # A rider: a Δ sent outside its fragment's merge cycle, a restarted learner's resend of its predecessor's unsent
    # work. The syncer applies it to the fragment's current version as it is (base_version may be older) and merges
    # it with the fragment's next merge rather than alone (syncer/state.py, SyncerState.new_contribution, decide).
    rider: bool = False

    def __post_init__(self) -> None:
        for field in ("learner_id", "submission_id"):
            value = getattr(self, field)
            if not isinstance(value, str) or not _ID_RE.fullmatch(value):
                raise WireError(f"{field} must be 1-128 characters of [A-Za-z0-9_.:-] starting with a letter "
                                f"or digit, got {value!r}")
        for field in _META_INTS:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool):
                raise WireError(f"{field} must be an integer, got {value!r}")
            if value < 0:
                raise WireError(f"{field} must be non-negative, got {value}")
        if self.c_steps == 0:
            raise WireError("c_steps must be >= 1 (a submission follows at least one inner step)")
        if self.c_tokens == 0:
            raise WireError("c_tokens must be >= 1 (every inner step consumes tokens)")
        if not isinstance(self.rider, bool):
            raise WireError(f"rider must be a boolean, got {self.rider!r}")


def _read_header(body: bytes, max_header: int = _MAX_HEADER) -> dict:
    """The safetensors JSON header, checked for length (at most `max_header` bytes, before any parsing) and shape
    before safetensors parses the tensors."""
    if len(body) < 8:
        raise WireError(f"body is not safetensors: {len(body)} bytes is shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", body[:8])
    if n > len(body) - 8:
        raise WireError(f"body is not safetensors or is truncated: header of {n} bytes, body of {len(body)}")
    if n > max_header:
        raise WireError(f"safetensors header of {n} bytes: the limit for this body is {max_header}",
                        "header_too_large")
    try:
        header = json.loads(body[8 : 8 + n])
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, an int over 4300 digits, nested too deep
        raise WireError(f"body is not safetensors: header is not JSON ({str(exc)[:120]})") from None
    if not isinstance(header, dict):
        raise WireError("body is not safetensors: header is not a JSON object")
    return header


def _load(body: bytes, max_header: int = _MAX_HEADER) -> tuple[dict[str, Tensor], dict[str, str]]:
    header = _read_header(body, max_header)
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise WireError("safetensors metadata must map strings to strings")
    try:
        # Offsets are validated against the buffer, so a lying header cannot make this allocate past the body.
        tensors = safetensors.torch.load(bytes(body))
    except Exception as exc:  # safetensors raises its own error types (SafetensorError, ValueError, ...)
        raise WireError(f"body is not valid safetensors or is truncated: {exc}") from None
    return tensors, metadata


def _portable(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Contiguous CPU tensors with no shared storage (safetensors refuses aliases, e.g. tied weights)."""
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
        elif ptr is not None:
            seen.add(ptr)
        out[name] = t
    return out


def encode_tensors(tensors: dict[str, Tensor], metadata: dict[str, str]) -> bytes:
    """Serialize tensors plus string metadata (fragment versions, full state) as safetensors bytes."""
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("safetensors metadata must map strings to strings")
    return safetensors.torch.save(_portable(tensors), metadata=dict(metadata))


def decode_tensors(body: bytes) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Parse safetensors bytes into (tensors, metadata); WireError if malformed."""
    return _load(body)


def encode_submission(meta: SubmissionMeta, parts: dict[str, dict[str, Tensor]], scheme: str, block_size: int,
                      shapes: dict[str, tuple]) -> bytes:
    """A learner's outer-gradient body: compressed tensors (`name` or `name.q`/`name.scale`) and all metadata."""
    _check_scheme(scheme, block_size)
    if set(parts) != set(shapes):
        raise ValueError(f"parts and shapes name different tensors: {sorted(set(parts) ^ set(shapes))}")
    tensors: dict[str, Tensor] = {}
    for name, p in parts.items():
        shape = tuple(int(d) for d in shapes[name])
        _check_parts(p, scheme, math.prod(shape), block_size, name)
        if scheme in _RAW_DTYPE:
            tensors[name] = p[""].reshape(shape)
        else:
            tensors[f"{name}.q"], tensors[f"{name}.scale"] = p["q"], p["scale"]
    metadata = {k: str(v) for k, v in asdict(meta).items() if k != "rider"}
    if meta.rider:  # absent otherwise: the bodies of every other submission are unchanged
        metadata["rider"] = "1"
    metadata |= {
        "compression": scheme,
        "block_size": str(block_size),
        "shapes": json.dumps({name: [int(d) for d in shapes[name]] for name in sorted(shapes)}),
    }
    return encode_tensors(tensors, metadata)


def _int_field(metadata: dict[str, str], field: str) -> int:
    if field not in metadata:
        raise WireError(f"metadata field {field!r} is missing")
    raw = metadata[field]
    if not re.fullmatch(r"-?[0-9]{1,19}", raw.strip()):
        raise WireError(f"metadata field {field!r} must be an integer, got {raw[:40]!r}")
    return int(raw)


def decode_submission(body: bytes, expected_shapes: dict[str, tuple[int, ...]], *, max_header: int = _MAX_HEADER,
                      require: tuple[str, int] | None = None) -> tuple[SubmissionMeta, dict[str, Tensor]]:
    """Validate a submission against the fragment's parameter shapes; return its metadata and float32 deltas.

    `max_header` caps the safetensors header before it is parsed; `require` = (scheme, block_size) refuses any other
    compression before anything is expanded (the block size only matters to int8/int4). Raises WireError naming the
    problem for anything malformed, incomplete, inconsistent, non-finite, or not the required compression.
    """
    tensors, md = _load(body, max_header)
    for field in ("learner_id", "submission_id", "compression", "shapes"):
        if field not in md:
            raise WireError(f"metadata field {field!r} is missing")
    rider = md.get("rider", "0")
    if rider not in ("0", "1"):
        raise WireError(f"metadata field 'rider' must be '0' or '1', got {rider[:40]!r}")
    meta = SubmissionMeta(md["learner_id"], md["submission_id"], *(_int_field(md, f) for f in _META_INTS),
                          rider=rider == "1")  # validates ids and counters
    scheme = md["compression"]
    if scheme not in SCHEMES:
        raise WireError(f"unknown compression {scheme!r}; expected one of {SCHEMES}")
    block_size = _int_field(md, "block_size")
    if block_size < 1:
        raise WireError(f"block_size must be >= 1, got {block_size}")
    if require is not None and scheme != require[0]:
        raise WireError(f"compression {scheme!r} is not this run's outer.compression {require[0]!r}",
                        "wrong_compression")
    if require is not None and scheme in _QMAX and block_size != require[1]:
        raise WireError(f"block_size {block_size} is not this run's outer.block_size {require[1]}",
                        "wrong_compression")
    try:
        declared = json.loads(md["shapes"])
    except (ValueError, RecursionError):  # not JSON, an int over 4300 digits, nested too deep (fuzz test)
        raise WireError("metadata field 'shapes' is not JSON") from None
    if not isinstance(declared, dict):
        raise WireError("metadata field 'shapes' must be a JSON object of name -> shape")

    expected = {name: tuple(int(d) for d in shape) for name, shape in expected_shapes.items()}
    missing, unknown = sorted(set(expected) - set(declared)), sorted(set(declared) - set(expected))
    if missing:
        raise WireError(f"parameters missing from the submission: {missing}")
    if unknown:
        raise WireError(f"unknown parameters for this fragment: {unknown}")
    for name, shape in expected.items():
        got = declared[name]
        if not isinstance(got, list) or tuple(got) != shape:
            raise WireError(f"{name}: shape {got} does not match the expected {list(shape)}")

    keys = {name: ([name] if scheme in _RAW_DTYPE else [f"{name}.q", f"{name}.scale"]) for name in expected}
    stray = sorted(set(tensors) - {k for ks in keys.values() for k in ks})
    if stray:
        raise WireError(f"unknown tensors in the submission: {stray[:10]}")
    deltas: dict[str, Tensor] = {}
    for name, shape in expected.items():
        absent = [k for k in keys[name] if k not in tensors]
        if absent:
            raise WireError(f"tensors missing from the submission: {absent}")
        if scheme in _RAW_DTYPE:
            parts = {"": tensors[name]}
            if tuple(tensors[name].shape) != shape:
                raise WireError(f"{name}: tensor shape {list(tensors[name].shape)} does not match {list(shape)}")
        else:
            parts = {"q": tensors[f"{name}.q"], "scale": tensors[f"{name}.scale"]}
        # Element counts are checked before anything is expanded (no allocation driven by the header alone).
        _check_parts(parts, scheme, math.prod(shape), block_size, name)
        value = dequantize(parts, scheme, shape, block_size)
        if not bool(torch.isfinite(value).all()):
            raise WireError(f"{name}: non-finite values")
        deltas[name] = value
    return meta, deltas


def wire_bytes(numels: dict[str, int], scheme: str, block_size: int) -> int:
    """Tensor payload bytes of one submission (excluding the small safetensors header)."""
    _check_scheme(scheme, block_size)
    total = 0
    for n in numels.values():
        if scheme in _RAW_DTYPE:
            total += n * _RAW_DTYPE[scheme].itemsize
        else:
            n_q, n_scale = _layout(n, scheme, block_size)
            total += n_q + 4 * n_scale
    return total
