"""Ancestor bitmasks of verification trees, from parent arrays (docs/contracts.md).

``triton_ancestor_words_from_parents(parent_row [B, N] int64, num_nodes [B] int64) -> int32 [B, N+1, W]``
with ``W = cdiv(N + 1, 32)``: bit ``c % 32`` of word ``c // 32`` of row ``r`` is set iff row
``c`` is ``r`` or an ancestor of ``r``. Row 0 (root) has only bit 0; rows past ``num_nodes[b]``
have only their own bit. Node row ``i + 1`` has parent row ``parent_row[b, i]``.

The plain-torch reference is ``vllm_gsd.graph.ancestor_words_from_parents`` (same signature;
the engine uses it, and tests compare this kernel against it). This Triton version gives each
program ``BLOCK_R`` rows of one request; every row climbs its parent chain in lockstep with the
others (one step per iteration, stopping when every row reached the root), OR-ing one bit per
step into a ``[BLOCK_R, WORDS_PAD]`` register tile. Cost ~ tree depth, not tree size.

Compile-time parameters (bounded compilation while serving; see _triton_compat.py): the node
budget ``N`` can change from batch to batch, so ``_launch_constants(N)`` (pure) buckets both
constexprs: ``WORDS_PAD`` = ``W`` rounded up to a power of two (the store is masked to the real
``num_words``), ``BLOCK_R`` = ``N + 1`` rounded up to a power of two, clamped to ``16..64`` and
to ``2048 / WORDS_PAD`` register words (spare rows are masked). For ``N <= 128`` that is at most
5 binaries, ``2 + log2(max WORDS_PAD)`` in general. ``num_cols`` (``N``), ``num_words`` (``W``) and
the per-batch strides are runtime ints without ==1 / %16 specialization.
"""

from __future__ import annotations

import torch

from . import launch_buckets
from ._triton_compat import jit, next_pow2, require_triton, tl

__all__ = ["triton_ancestor_words_from_parents"]


def _launch_constants(n: int) -> dict:
    """Constexprs (and ``num_warps``) of the kernel for a node budget ``n``, without launching."""
    words_pad = next_pow2((n + 1 + 31) // 32)
    block_r = max(1, min(64, max(16, next_pow2(n + 1)), 2048 // words_pad))
    return dict(WORDS_PAD=words_pad, BLOCK_R=block_r, num_warps=4)


@jit(do_not_specialize=("num_cols", "num_words", "stride_pb", "stride_ob", "stride_or"),
     do_not_specialize_on_alignment=("PARENT", "NUM_NODES"))
def _ancestor_words_kernel(
    PARENT, NUM_NODES, OUT,
    num_cols,  # N (node rows are 1..N)
    num_words,  # W = cdiv(N + 1, 32) <= WORDS_PAD
    stride_pb, stride_ob, stride_or,
    WORDS_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
):
    b = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows <= num_cols
    n_b = tl.load(NUM_NODES + b).to(tl.int32)
    offs_w = tl.arange(0, WORDS_PAD)
    words = tl.zeros([BLOCK_R, WORDS_PAD], tl.int32)
    cur = tl.where(row_ok, rows, -1)
    steps = 0
    # The step cap (N + 1 climbs reach the root of any valid tree) only guards against
    # malformed parent arrays looping forever.
    while (tl.max(cur, axis=0) >= 0) & (steps <= num_cols):
        active = cur >= 0
        c = tl.maximum(cur, 0)
        # int32 shift: bit 31 becomes the sign bit, as the contract says.
        bit = tl.full([BLOCK_R], 1, tl.int32) << (c % 32)
        hit = active[:, None] & (offs_w[None, :] == (c // 32)[:, None])
        words = words | tl.where(hit, bit[:, None], 0)
        # Row 0 and rows past n_b have no parent: their climb ends here.
        has_parent = active & (c >= 1) & (c <= n_b)
        par = tl.load(PARENT + b * stride_pb + (c - 1), mask=has_parent, other=-1)
        cur = tl.where(has_parent, par.to(tl.int32), -1)
        steps += 1
    tl.store(
        OUT + b * stride_ob + rows[:, None] * stride_or + offs_w[None, :], words,
        mask=row_ok[:, None] & (offs_w[None, :] < num_words),
    )


def triton_ancestor_words_from_parents(parent_row: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """Triton ancestor bitmasks; see module docstring. Returns int32 ``[B, N + 1, W]``."""
    require_triton("triton_ancestor_words_from_parents")
    num_reqs, n = parent_row.shape
    num_words = (n + 1 + 31) // 32
    out = torch.empty((num_reqs, n + 1, num_words), dtype=torch.int32, device=parent_row.device)
    if num_reqs == 0:
        return out
    parent_row = parent_row.contiguous()
    num_nodes = num_nodes.to(parent_row.device).contiguous()
    lc = _launch_constants(n)
    grid = (num_reqs, -(-(n + 1) // lc["BLOCK_R"]))
    launch_buckets.note("ancestor_words", lc, parent_row.dtype)
    _ancestor_words_kernel[grid](
        parent_row, num_nodes, out, n, num_words,
        parent_row.stride(0), out.stride(0), out.stride(1), **lc,
    )
    return out
