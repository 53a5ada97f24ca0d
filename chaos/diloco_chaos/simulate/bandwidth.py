"""WAN bandwidth calculator: data-parallel gradient all-reduce across sites vs Decoupled DiLoCo fragment
traffic. Pure arithmetic; the formulas and the assumptions behind them are in docs/simulator.md."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

GIGA = 1e9


@dataclass(frozen=True)
class BandwidthInputs:
    """One training setup; every rate is sized so communication fully overlaps compute."""

    params: float                  # model parameters
    step_time_s: float             # one inner (or data-parallel) step of compute
    sync_every: int = 24           # H: steps between two sends of the same fragment
    fragments: int = 24            # P
    bits: int = 4                  # bits per element of the outer gradient on the wire (32/16/8/4/2)
    sites: int = 8                 # datacenters; data-parallel all-reduces across all of them
    learners_per_site: int = 1     # decoupled: learners sharing one site's WAN link
    dp_bits: int = 16              # bits per gradient element in the data-parallel all-reduce (bf16)
    down_bits: int | None = None   # bits of the merged fragment sent back (default: same as `bits`)
    block_size: int = 0            # quantization block with an fp32 scale (0: ignore scale overhead)
    link_gbps: float | None = None  # optional: WAN link per site, to compare achievable step times

    def __post_init__(self) -> None:
        for name in ("params", "step_time_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        for name in ("sync_every", "fragments", "bits", "sites", "learners_per_site", "dp_bits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.fragments > self.sync_every:
            raise ValueError(f"fragments ({self.fragments}) must be <= sync_every ({self.sync_every}): "
                             "each fragment is sent once every H steps, at most one fragment per step")
        for name in ("bits", "dp_bits"):
            if getattr(self, name) > 32:
                raise ValueError(f"{name} must be <= 32, got {getattr(self, name)!r}")
        if self.down_bits is not None and (isinstance(self.down_bits, bool) or not isinstance(
                self.down_bits, int) or not 1 <= self.down_bits <= 32):
            raise ValueError(f"down_bits must be an integer in [1, 32], got {self.down_bits!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 0:
            raise ValueError(f"block_size must be an integer >= 0, got {self.block_size!r}")
        if self.link_gbps is not None and not (math.isfinite(self.link_gbps) and self.link_gbps > 0):
            raise ValueError(f"link_gbps must be a positive number, got {self.link_gbps!r}")


@dataclass(frozen=True)
class BandwidthReport:
    """Per-site WAN requirements in Gbit/s (egress; ingress is equal for the ring, given for decoupled)."""

    dp_gbps: float               # ring all-reduce of the full gradient every step
    decoupled_up_gbps: float     # outer gradients of this site's learners to the syncer
    decoupled_down_gbps: float   # merged fragments back to this site's learners
    decoupled_gbps: float        # full-duplex link requirement: max(up, down)
    ratio: float                 # dp_gbps / decoupled_gbps
    fragment_mb: float           # one compressed outer-gradient fragment, megabytes
    dp_step_time_s: float | None = None        # with link_gbps: data-parallel step time (compute vs WAN)
    decoupled_step_time_s: float | None = None
    speedup: float | None = None               # dp_step_time_s / decoupled_step_time_s

    def as_dict(self) -> dict:
        return asdict(self)


def wire_bits(bits: int, block_size: int) -> float:
    """Bits per element on the wire, including one fp32 scale per block when quantized below 16 bits."""
    return bits + (32.0 / block_size if block_size and bits < 16 else 0.0)


def ring_allreduce_factor(sites: int) -> float:
    """Data each site sends (and receives) in a ring all-reduce, as a multiple of the buffer: 2(S-1)/S."""
    return 2.0 * (sites - 1) / sites


def required_bandwidth(x: BandwidthInputs) -> BandwidthReport:
    """WAN bandwidth per site for data-parallel vs Decoupled DiLoCo, sized to hide behind compute."""
    # Data-parallel: sites reduce inside first (fast local network), then one cross-site ring all-reduce of
    # the whole gradient per step, which must finish within the step to keep chips busy.
    dp_bits_per_step = ring_allreduce_factor(x.sites) * x.params * x.dp_bits
    dp = dp_bits_per_step / x.step_time_s / GIGA
    # Decoupled: each fragment (params / P) goes up once per H steps, so params / H elements per step,
    # whatever P is; P only sets how smooth the stream is. The merged fragment comes back at down_bits.
    down_bits = x.bits if x.down_bits is None else x.down_bits
    per_step_elems = x.params / x.sync_every * x.learners_per_site
    up = per_step_elems * wire_bits(x.bits, x.block_size) / x.step_time_s / GIGA
    down = per_step_elems * wire_bits(down_bits, x.block_size) / x.step_time_s / GIGA
    dec = max(up, down)
    fragment_mb = x.params / x.fragments * wire_bits(x.bits, x.block_size) / 8 / 1e6
    report = dict(dp_gbps=dp, decoupled_up_gbps=up, decoupled_down_gbps=down, decoupled_gbps=dec,
                  ratio=dp / dec if dec > 0 else math.inf, fragment_mb=fragment_mb)
    if x.link_gbps is not None:
        # Communication overlaps compute, so a step takes whichever is longer.
        dp_step = max(x.step_time_s, dp_bits_per_step / (x.link_gbps * GIGA))
        dec_step = max(x.step_time_s, x.step_time_s * dec / x.link_gbps)
        report.update(dp_step_time_s=dp_step, decoupled_step_time_s=dec_step, speedup=dp_step / dec_step)
    return BandwidthReport(**report)
