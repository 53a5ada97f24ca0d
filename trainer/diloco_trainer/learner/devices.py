"""Device selection (cpu / cuda / xla), the few device-specific calls, and the unit's process group, so the
learner loop branches neither on the device nor on the number of processes in its unit."""

from __future__ import annotations

import importlib
import json
import logging
import os

import torch

log = logging.getLogger(__name__)

DEVICE_CHOICES = ("auto", "cpu", "cuda", "xla")


def _torch_xla():
    """The torch_xla module, or None when torch_xla is not installed (or fails to import)."""
    try:
        return importlib.import_module("torch_xla")
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
        xla = _torch_xla()
        if xla is not None:
            return xla.device()
        if name == "xla":
            raise ValueError("device 'xla' requested but torch_xla is not installed (see docs/xla.md)")
    return torch.device("cpu")


def sync(device: torch.device) -> None:
    """Make queued work run: mark_step on XLA (where ops are lazy), a stream sync on CUDA, nothing on CPU."""
    if device.type == "xla":
        _torch_xla().sync()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


def run_lazy(device: torch.device) -> None:
    """Run the operations queued on an XLA device as a graph of their own (nothing elsewhere): what the outer sync
    changed (an adoption) must not ride into the next inner step's graph, which would then differ from the one
    compiled and compile again."""
    if device.type == "xla":
        _torch_xla().sync()


def outer_state_device(device: torch.device) -> torch.device | None:
    """Where a learner keeps its outer state (bases, outer gradients, their compression): in host memory for XLA
    (each tensor's compression and checks would otherwise compile graphs of their own), beside the parameters
    elsewhere (None)."""
    return torch.device("cpu") if device.type == "xla" else None


def xla_graph_counts(device: torch.device) -> dict[str, float]:
    """torch_xla's own count of graph compilations and executions so far, and the seconds spent compiling
    (torch_xla.debug.metrics); empty off XLA. A step whose graph changes compiles again: the count shows it."""
    if device.type != "xla":
        return {}
    import torch_xla.debug.metrics as met

    compiled, executed = met.metric_data("CompileTime"), met.metric_data("ExecuteTime")
    return {"xla_compiles": compiled[0] if compiled else 0,
            "xla_compile_s": compiled[1] / 1e9 if compiled else 0.0,  # the metric accumulates nanoseconds
            "xla_executions": executed[0] if executed else 0}


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


class UnitGroup:
    """The processes of one learner unit (torch.distributed, env:// variables); one process is a group of one.

    Every collective is a no-op for a group of one, so the learner loop reads the same either way.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, device: torch.device | None = None):
        self.rank, self.world_size = rank, world_size
        self.is_main = rank == 0
        self.device = device  # this rank's device when the group chose it (cuda:LOCAL_RANK), else None
        # gloo moves CPU tensors; nccl needs them on the GPU.
        self.comm_device = device if device is not None and dist_backend(device) != "gloo" else torch.device("cpu")

    @classmethod
    def from_env(cls, device: torch.device) -> "UnitGroup":
        """Join the unit's process group when WORLD_SIZE > 1 (MASTER_ADDR, MASTER_PORT, RANK from the env)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        import torch.distributed as dist

        rank = int(os.environ.get("RANK", "0"))
        if device.type == "cuda":
            local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
        dist.init_process_group(dist_backend(device), init_method="env://", rank=rank, world_size=world)
        log.info("joined unit process group: rank %d of %d (%s)", rank, world, dist_backend(device))
        return cls(rank, world, device)

    def broadcast_json(self, obj):
        """Rank 0's JSON-able object on every rank (JSON bytes in a tensor: never pickle)."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        data = json.dumps(obj).encode() if self.is_main else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.comm_device)
        dist.broadcast(size, src=0)
        buf = torch.zeros(int(size), dtype=torch.uint8, device=self.comm_device)
        if self.is_main:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(buf, src=0)
        return json.loads(bytes(buf.cpu().tolist()))

    def broadcast_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite these tensors on every rank with rank 0's values (in place)."""
        if self.world_size == 1 or not tensors:
            return
        import torch.distributed as dist

        flat = torch.cat([t.detach().reshape(-1).to(self.comm_device, torch.float32) for t in tensors])
        dist.broadcast(flat, src=0)
        offset = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()

    def mean(self, value: torch.Tensor) -> float:
        """The unit's mean of a scalar every rank holds (e.g. its loss)."""
        if self.world_size == 1:
            return float(value)
        import torch.distributed as dist

        flat = value.detach().reshape(1).to(self.comm_device, torch.float32)
        dist.all_reduce(flat)
        return float(flat[0]) / self.world_size

    def step_header(self, stop: bool, adopted: list[tuple[int, int]], slots: int) -> tuple[bool, list[tuple[int, int]]]:
        """One collective per step: whether any rank must stop, and rank 0's (fragment, version) adoptions."""
        if self.world_size == 1:
            return stop, adopted
        import torch.distributed as dist

        assert len(adopted) <= slots
        header = torch.zeros(2 + 2 * slots, dtype=torch.int64, device=self.comm_device)
        header[0] = int(stop)
        if self.is_main:  # everyone else adds zeros, so the sum carries rank 0's list
            header[1] = len(adopted)
            for i, (p, v) in enumerate(adopted):
                header[2 + 2 * i], header[3 + 2 * i] = p, v
        dist.all_reduce(header)
        n = int(header[1])
        values = header[2: 2 + 2 * n].tolist()
        return bool(header[0]), [(values[2 * i], values[2 * i + 1]) for i in range(n)]

    def close(self) -> None:
        """Leave the unit's process group: every rank calls it, after its last collective."""
        if self.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                if dist.get_backend() == "gloo":
                    # A gloo worker thread releases a finished collective's tensors under the GIL, and it outlives
                    # destroy_process_group (DDP and FSDP2 still hold the group). One still waiting for the GIL when
                    # the interpreter exits aborts the process ("terminate called without an active exception").
                    # The barrier waits for every earlier collective with the GIL released.
                    dist.barrier()
                dist.destroy_process_group()
