"""Syncer memory and CPU per shard, and the shards a model needs per machine size. Pure arithmetic from what the syncer
holds (syncer/state.py, store.py) and the merge speed measured by `diloco bench --only syncer_speed`; the assumptions
are in docs/simulator.md ("Syncer memory plan")."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

GIB = 2**30
FP32 = 4  # bytes
# Measured (bench syncer_speed, 2026-11-24, after the fused merge): one 100M-parameter fragment, 16 submissions,
# merge + outer step in 395 ms on one core of this machine. Merge time is taken as proportional to
# fragment parameters x submissions (one fused pass per submission plus a fixed few per merge).
MEASURED_MERGE_S = 0.395
MEASURED_FRAGMENT_PARAMS = 100e6
MEASURED_SUBMISSIONS = 16
PROCESS_OVERHEAD_BYTES = 0.5 * GIB  # Python + torch + aiohttp, measured RSS of an idle syncer is ~0.4-0.5 GiB


@dataclass(frozen=True)
class SyncerPlanInputs:
    """One model and run shape; every field has the meaning of the run config or the learners' pace."""

    params: float  # model parameters
    fragments: int = 24  # P
    learners: int = 8  # M: submissions per fragment per round
    sync_every: int = 24  # H: steps between two sends of the same fragment by one learner
    step_time_s: float = 1.0  # one inner step
    versions_kept: int = 8  # outer.versions_kept: published versions of each fragment held for late bases
    pending_bits: int = 32  # bits per element of a pending submission in memory (today: decoded to fp32)
    downlink_bits: int = 32  # 32: no quantized down-link; 8/4: its residual (fp32) and update history are held
    merge_threads: int = 1  # merges of different fragments running at once in one shard (the to_thread pool)
    standby: bool = True  # a warm standby per shard (holds no state: one more process overhead)

    def __post_init__(self) -> None:
        if not (isinstance(self.params, (int, float)) and math.isfinite(self.params) and self.params > 0):
            raise ValueError(f"params must be a positive number, got {self.params!r}")
        for name in ("fragments", "learners", "sync_every", "versions_kept", "merge_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.step_time_s > 0:
            raise ValueError(f"step_time_s must be > 0, got {self.step_time_s!r}")
        for name in ("pending_bits", "downlink_bits"):
            if getattr(self, name) not in (2, 4, 8, 16, 32):
                raise ValueError(f"{name} must be one of 2, 4, 8, 16, 32, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class ShardPlan:
    """What one of `shards` syncer shards holds (bytes) and how busy it keeps a core."""

    shards: int
    fragments_per_shard: int
    params_per_shard: float
    theta: float  # current Θ of its fragments, fp32
    momentum: float  # Nesterov buffer, fp32
    versions: float  # the other versions_kept − 1 published versions (new tensors each merge)
    pending: float  # M submissions per fragment waiting, at pending_bits
    merge_workspace: float  # per running merge: M re-anchored Δ, the merged Δ, new Θ, new momentum
    checkpoint_buffer: float  # safetensors bytes of the largest tensor group written at once (Θ, then momentum)
    downlink: float  # quantized down-link: fp32 residual + kept updates
    process: float  # interpreter + libraries, twice with a warm standby
    merge_s_per_round: float  # one round of merges (every fragment of the shard once), one core
    round_s: float  # a fragment receives M submissions every H steps

    @property
    def total(self) -> float:
        return (self.theta + self.momentum + self.versions + self.pending + self.merge_workspace
                + self.checkpoint_buffer + self.downlink + self.process)

    @property
    def cores(self) -> float:
        """Cores kept busy merging (merge time per round / round time)."""
        return self.merge_s_per_round / self.round_s

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "cores": self.cores}


def merge_seconds(fragment_params: float, submissions: int) -> float:
    """One merge + outer step of one fragment on one core, scaled from the measured point."""
    return MEASURED_MERGE_S * (fragment_params / MEASURED_FRAGMENT_PARAMS) * (submissions / MEASURED_SUBMISSIONS)


def valid_shard_counts(fragments: int) -> list[int]:
    """Shard counts that split P fragments evenly (every shard owns the same number of fragments)."""
    return [s for s in range(1, fragments + 1) if fragments % s == 0]


def shard_plan(x: SyncerPlanInputs, shards: int) -> ShardPlan:
    """Memory and CPU of one shard when the model is split over `shards` shards."""
    if shards not in valid_shard_counts(x.fragments):
        raise ValueError(f"shards must divide the {x.fragments} fragments evenly, got {shards}")
    per_shard_fragments = x.fragments // shards
    frag = x.params / x.fragments
    n = frag * per_shard_fragments
    running = min(x.merge_threads, per_shard_fragments)
    quantized = x.downlink_bits < 32
    return ShardPlan(
        shards=shards, fragments_per_shard=per_shard_fragments, params_per_shard=n,
        theta=FP32 * n, momentum=FP32 * n,
        versions=FP32 * n * (x.versions_kept - 1),
        pending=x.learners * n * x.pending_bits / 8,
        merge_workspace=running * FP32 * frag * (x.learners + 3),
        checkpoint_buffer=FP32 * n,
        downlink=(FP32 * n + x.versions_kept * n * x.downlink_bits / 8) if quantized else 0.0,
        process=PROCESS_OVERHEAD_BYTES * (2 if x.standby else 1),
        merge_s_per_round=per_shard_fragments * merge_seconds(frag, x.learners),
        round_s=x.sync_every * x.step_time_s)


@dataclass(frozen=True)
class Machine:
    ram_gib: float
    cores: int
    usable: float = 0.8  # of the RAM, for syncers (the OS, page cache for checkpoints, headroom)


@dataclass(frozen=True)
class Fit:
    machine: Machine
    shards: int | None  # fewest shards (a divisor of P) that fit one per machine; None: none fits
    shards_per_machine: int  # shards of that size one machine holds (by memory and by cores)
    machines: int | None  # machines for all shards
    per_shard_gib: float | None
    per_shard_cores: float | None


def fit(x: SyncerPlanInputs, machine: Machine) -> Fit:
    """The fewest shards whose every shard fits the machine (memory and cores), and how many machines they take."""
    for s in valid_shard_counts(x.fragments):
        plan = shard_plan(x, s)
        if plan.total <= machine.ram_gib * GIB * machine.usable and plan.cores <= machine.cores:
            by_memory = int(machine.ram_gib * GIB * machine.usable // plan.total)
            by_cores = int(machine.cores // max(plan.cores, 1e-9))
            per_machine = max(1, min(by_memory, by_cores, s))
            return Fit(machine, s, per_machine, math.ceil(s / per_machine), plan.total / GIB, plan.cores)
    return Fit(machine, None, 0, None, None, None)


PLAN_MODELS = (1e9, 12e9, 100e9)
PLAN_MACHINES = tuple(Machine(ram, cores) for ram in (64, 256, 1024) for cores in (16, 64))
