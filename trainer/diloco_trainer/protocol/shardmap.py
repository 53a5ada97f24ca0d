"""Which syncer shard owns which fragment: round-robin by fragment index, shard of p = p mod N.

Why round-robin: it depends only on (P, N), so every process and every restart computes the same map with no
coordination and nothing stored; fragments are already balanced in size (fragments.py, greedy LPT), so N shards
own P/N fragments each (counts differ by at most one) and about 1/N of the bytes; and a fragment's send offset
in the staggered schedule is (p * H) // P, so consecutive fragments going to different shards spreads each
shard's submissions evenly over every window of H steps (contiguous blocks would send one shard a burst).
Torch-free: the syncer, the learner, the local runtime and tests share it.
"""

from __future__ import annotations

from collections.abc import Sequence


def _check(num_fragments: int, shards: int) -> None:
    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards!r}")
    if not isinstance(num_fragments, int) or num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments!r}")
    if shards > num_fragments:
        raise ValueError(f"shards ({shards}) must not exceed the fragments ({num_fragments}): every shard owns "
                         "at least one fragment")


def shard_of(p: int, num_fragments: int, shards: int) -> int:
    """The shard that owns fragment p."""
    _check(num_fragments, shards)
    if not 0 <= p < num_fragments:
        raise ValueError(f"fragment {p} out of range 0..{num_fragments - 1}")
    return p % shards


def owned_fragments(shard: int, num_fragments: int, shards: int) -> list[int]:
    """The fragments shard `shard` owns, ascending."""
    _check(num_fragments, shards)
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} out of range 0..{shards - 1}")
    return list(range(shard, num_fragments, shards))


def shard_map(num_fragments: int, shards: int) -> list[int]:
    """Fragment index -> owning shard, for every fragment."""
    _check(num_fragments, shards)
    return [p % shards for p in range(num_fragments)]


def shard_sizes(fragment_sizes: Sequence[int], shards: int) -> list[int]:
    """Elements each shard owns, given every fragment's size (for balance checks and memory plans)."""
    owner = shard_map(len(fragment_sizes), shards)
    totals = [0] * shards
    for p, size in enumerate(fragment_sizes):
        totals[owner[p]] += size
    return totals


def split_syncer_urls(text: str) -> list[str]:
    """`--syncer URL0,URL1,...`: one http(s) URL per shard, in shard order (one URL for an unsharded syncer).
    Each shard says at registration which shard it is and how many there are, so a wrong order or count is caught
    there (client.py)."""
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    if not urls:
        raise ValueError("--syncer needs at least one URL")
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"--syncer must be http(s) URLs separated by commas, got {u!r}")
    if len(set(urls)) != len(urls):
        raise ValueError(f"--syncer names the same URL twice: {text!r}")
    return urls
