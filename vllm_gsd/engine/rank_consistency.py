"""Every tensor-parallel rank must propose the same trees: checked, not assumed.

Each rank drafts and builds its trees on its own (the draft runs sharded like the target, so its
logits are the same on every rank, and the graph code is deterministic). If ranks ever disagreed
(a nondeterministic kernel, a different library build), their KV caches would silently diverge.
So after each proposal step the ranks compare a fingerprint of their trees over the CPU side of
vLLM's tensor-parallel group, and a mismatch stops the engine with a clear error.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist


class RankDivergence(RuntimeError):
    pass


def tree_fingerprint(drafts: list[list[int]], parent_rows: list[list[int]]) -> int:
    """A 63-bit digest of every request's proposed node tokens and tree shape."""
    digest = hashlib.blake2b(digest_size=8)
    for tokens, parents in zip(drafts, parent_rows):
        digest.update(repr((tokens, parents)).encode())
    return int.from_bytes(digest.digest(), "little") >> 1


def check_same_on_all_ranks(fingerprint: int, group, rank: int) -> None:
    """Raise RankDivergence unless every rank of `group` passed the same fingerprint."""
    both = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if int(both[0]) != fingerprint or -int(both[1]) != fingerprint:
        raise RankDivergence(
            f"gsd: tensor-parallel rank {rank} proposed different trees from another rank "
            f"(fingerprint {fingerprint:#x}, max {int(both[0]):#x}, min {-int(both[1]):#x}); "
            "the ranks' KV caches would diverge, so the engine stops"
        )
