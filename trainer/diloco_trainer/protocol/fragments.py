"""Balanced tensor fragmentation (greedy LPT) and the staggered schedule on which fragments are sent.

Torch-free: the syncer computes the plan once from (name, numel) pairs and hands it to every learner.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


def plan_fragments(sizes: Sequence[tuple[str, int]], num_fragments: int) -> list[list[str]]:
    """Split tensors into P non-empty fragments: largest first into the currently smallest fragment.

    Ties are broken deterministically (equal sizes by name; equal loads by fewer tensors, then lower
    fragment index), so every process computes the same plan. Within a fragment, names keep the order
    of `sizes` (the model's own order).
    """
    names = [name for name, _ in sizes]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"tensor names must be unique; repeated: {dup}")
    for name, size in sizes:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"size of tensor {name!r} must be a non-negative integer, got {size!r}")
    if not isinstance(num_fragments, int) or num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments!r}")
    if num_fragments > len(sizes):
        raise ValueError(f"num_fragments ({num_fragments}) exceeds the number of tensors ({len(sizes)}); "
                         "every fragment must hold at least one tensor")

    order = {name: i for i, name in enumerate(names)}
    # Heap key (load, count, index): the count tie-break keeps fragments non-empty even with 0-size tensors.
    heap = [(0, 0, p) for p in range(num_fragments)]
    members: list[list[str]] = [[] for _ in range(num_fragments)]
    for name, size in sorted(sizes, key=lambda ns: (-ns[1], ns[0])):
        load, count, p = heapq.heappop(heap)
        members[p].append(name)
        heapq.heappush(heap, (load + size, count + 1, p))
    return [sorted(m, key=order.__getitem__) for m in members]


def fragment_sizes(plan: Sequence[Sequence[str]], sizes: Sequence[tuple[str, int]]) -> list[int]:
    """Total elements per fragment of a plan."""
    by_name = dict(sizes)
    return [sum(by_name[n] for n in frag) for frag in plan]


def imbalance(plan: Sequence[Sequence[str]], sizes: Sequence[tuple[str, int]]) -> float:
    """Largest fragment size divided by the ideal size total / P (1.0 is perfect balance)."""
    loads = fragment_sizes(plan, sizes)
    total = sum(loads)
    if total == 0:
        return 1.0
    return max(loads) / (total / len(plan))


def fragment_of(plan: Sequence[Sequence[str]]) -> dict[str, int]:
    """Parameter name -> fragment index."""
    return {name: p for p, frag in enumerate(plan) for name in frag}


def _check_schedule(sync_every: int, num_fragments: int) -> None:
    if sync_every < 1:
        raise ValueError(f"sync_every (H) must be >= 1, got {sync_every}")
    if num_fragments < 1:
        raise ValueError(f"num_fragments (P) must be >= 1, got {num_fragments}")


def fragment_offset(p: int, sync_every: int, num_fragments: int) -> int:
    """Step offset of fragment p inside each window of H steps: (p * H) // P."""
    _check_schedule(sync_every, num_fragments)
    if not 0 <= p < num_fragments:
        raise ValueError(f"fragment {p} out of range 0..{num_fragments - 1}")
    return (p * sync_every) // num_fragments


def first_due_step(p: int, sync_every: int, num_fragments: int) -> int:
    """Steps after a (re)start until fragment p is first due: its offset, or H for offset 0 (staggered sends)."""
    return fragment_offset(p, sync_every, num_fragments) or sync_every


def aligned_first_due(seconds_since_published: float, step_s: float, sync_every: int) -> int:
    """Steps until a joining learner first sends a fragment whose current version was published
    `seconds_since_published` ago, to land with the others' next sends of it: they adopted that version about when
    it was published and send it again H steps (of ~`step_s` s) later. In [1, H]; rounded towards sooner, since a Δ
    that arrives before the others' waits for them in the grace window while one that arrives after their merge
    makes a version of its own."""
    _check_schedule(sync_every, 1)
    if step_s <= 0:
        raise ValueError(f"step_s must be > 0, got {step_s}")
    passed = max(0, math.ceil(seconds_since_published / step_s))
    return sync_every - passed % sync_every


def due_fragments(step: int, sync_every: int, num_fragments: int) -> list[int]:
    """Fragments due after the learner's own inner step `step` (1-based): those with step % H == offset(p).

    Over any H consecutive steps every fragment is due exactly once; offsets are spread evenly so about
    P / H fragments go out per step (never all at once).
    """
    _check_schedule(sync_every, num_fragments)
    if step < 1:
        raise ValueError(f"step is 1-based (the first completed inner step is 1), got {step}")
    r = step % sync_every
    return [p for p in range(num_fragments) if (p * sync_every) // num_fragments == r]
