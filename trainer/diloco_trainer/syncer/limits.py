"""What one learner may make the syncer hold or weigh, derived from the run's config: the body and header size of a
fragment's submission under the configured compression, the tokens an inner step can cover, and the merge weight
a submission can carry (docs/security.md, "A learner with a valid token"). Pure: no I/O."""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco_trainer.config import TrainConfig
from diloco_trainer.protocol.wire import wire_bytes

# Metadata of a submission besides the tensors: two ids of at most 128 characters, four integers of at most 19
# digits, the scheme, the block size, and JSON punctuation. 2 KiB holds it with room to spare.
_HEADER_FIXED = 2048
# Per parameter: its shape in the "shapes" metadata and up to two tensor entries (q and scale) naming it, each
# `{"dtype":"U8","shape":[N],"data_offsets":[A,B]}` with numbers of at most 20 digits: ~100 bytes besides the name.
_HEADER_PER_NAME = 320
# Rounds of work a submission's merge weight may count (see `weighed_counts`).
WEIGHT_ROUNDS = 2


@dataclass(frozen=True)
class SubmissionLimits:
    """Bounds on one fragment submission; every field comes from the config and the model's shapes."""

    compression: tuple[str, int]  # (outer.compression, outer.block_size): the only ones accepted
    tokens_per_step: int  # the most tokens one inner step of one learner unit covers
    header_bytes: tuple[int, ...]  # per fragment: the longest safetensors header a valid submission has
    body_bytes: tuple[int, ...]  # per fragment: the longest valid body

    @classmethod
    def from_config(cls, config: TrainConfig, fragment_shapes: list[dict[str, tuple[int, ...]]],
                    max_unit_processes: int) -> "SubmissionLimits":
        """Limits for `config`, whose fragment p has parameters `fragment_shapes[p]`; a learner unit runs at most
        `max_unit_processes` processes (the syncer's --max-unit-processes; the operator passes its largest
        podsPerUnit)."""
        if max_unit_processes < 1:
            raise ValueError(f"max_unit_processes must be >= 1, got {max_unit_processes}")
        out = config.outer
        headers, bodies = [], []
        for shapes in fragment_shapes:
            header = _HEADER_FIXED + sum(_HEADER_PER_NAME + 4 * len(n) for n in shapes)
            payload = wire_bytes({n: math.prod(s) for n, s in shapes.items()}, out.compression, out.block_size)
            headers.append(header)
            bodies.append(8 + header + 8 + payload)  # length prefix, header, its alignment padding, tensors
        # The learner counts batch_size x world_size x seq_len tokens per inner step (learner/loop.py).
        tokens = config.inner.batch_size * config.model.seq_len * max_unit_processes
        return cls((out.compression, out.block_size), tokens, tuple(headers), tuple(bodies))

    def counts_error(self, c_steps: int, c_tokens: int) -> str | None:
        """Why a submission's declared counters are impossible under the config (None if they are possible)."""
        # One step of slack: with adopt=keep and keep_fraction < 1 a learner rounds its carried steps and tokens
        # separately (outer_sync.py), so its tokens may run up to half a step ahead of its steps.
        most = (c_steps + 1) * self.tokens_per_step
        if c_tokens > most:
            return (f"c_tokens {c_tokens} is more than c_steps {c_steps} inner steps can cover: at most "
                    f"{self.tokens_per_step} tokens a step (inner.batch_size x model.seq_len x "
                    f"--max-unit-processes), so at most {most} (one step of slack for rounding)")
        return None


def weighed_counts(c_steps: int, c_tokens: int, max_steps: int) -> tuple[int, float]:
    """(steps, tokens) a submission's merge weight counts: its own, or, past `max_steps` steps, that many steps at
    its own tokens per step. An honest learner sends every outer.sync_every (H) steps and carries at most one more
    round over an adoption (adopt=keep), so with max_steps = WEIGHT_ROUNDS x H only a learner that lies about its
    steps (or one that trained alone through a long outage) is cut down: it never weighs more than 2 H steps of
    the largest unit."""
    if c_steps <= max_steps:
        return c_steps, float(c_tokens)
    return max_steps, c_tokens * (max_steps / c_steps)
