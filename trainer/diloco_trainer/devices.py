"""Device selection (cpu / cuda / xla) and the few device-specific calls, so the algorithm code never branches."""

from __future__ import annotations

import importlib
import logging

import torch

log = logging.getLogger(__name__)

DEVICE_CHOICES = ("auto", "cpu", "cuda", "xla")


def _xla_model():
    """torch_xla's xla_model module, or None when torch_xla is not installed (or fails to import)."""
    try:
        return importlib.import_module("torch_xla.core.xla_model")
    except Exception as exc:  # noqa: BLE001 - a broken torch_xla install must read as "no XLA"
        log.debug("torch_xla unavailable: %s", exc)
        return None


def select_device(name: str = "auto") -> torch.device:
    """The requested device; 'auto' picks cuda, then xla, then cpu. A device that is not there → ValueError."""
    if name not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}, got {name!r}")
    if name == "cpu":
        return torch.device("cpu")
    if name in ("cuda", "auto") and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if name == "cuda":
        raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False on this machine")
    if name in ("xla", "auto"):
        xm = _xla_model()
        if xm is not None:
            return xm.xla_device()
        if name == "xla":
            raise ValueError("device 'xla' requested but torch_xla is not installed (pip install torch_xla)")
    return torch.device("cpu")


def sync(device: torch.device) -> None:
    """Make queued work run: mark_step on XLA (where ops are lazy), a stream sync on CUDA, nothing on CPU."""
    if device.type == "xla":
        _xla_model().mark_step()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


def dist_backend(device: torch.device) -> str:
    """torch.distributed backend for a unit's process group on this device (xla: untested here, no TPU)."""
    if device.type == "xla":
        importlib.import_module("torch_xla.distributed.xla_backend")  # registers the "xla" backend
        return "xla"
    return "nccl" if device.type == "cuda" else "gloo"


def describe(device: torch.device) -> str:
    """Short human-readable device name for registration and logs (e.g. 'cuda:0 (NVIDIA A100)')."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
