"""Greedy tree walk for the whole batch in one launch.

``triton_walk_tree(draft_token_ids [B, N], parent_row [B, N], num_nodes [B], row_target_token [B, N+1])
-> (accepted_rows [B, N+1], output_token_ids [B, N+1], num_accepted [B])``, all int64.

From the root (row 0): at row ``r`` the target's token is ``row_target_token[b, r]``; if a node
child of ``r`` (``parent_row[b, i] == r``, ``i < num_nodes[b]``) carries that token the walk
moves to row ``i + 1`` (the smallest such row if several do), else it emits the target token and
stops. ``accepted_rows`` = rows of the path starting with 0, ``output_token_ids`` = tokens of
the accepted nodes then the final target token (vLLM's ``sampled_token_ids`` layout),
``num_accepted`` = number of accepted nodes ``a``; both row tensors are ``-1`` padded.

The plain-torch reference is ``vllm_gsd.graph.walk_tree`` (the engine's walk; it returns an
``AcceptedPaths`` dataclass with the same three fields). Here one program walks one request,
holding the request's node tokens and parents in registers (``BLOCK_N >= N``) and building the
outputs in registers, written once at the end (no ordering hazards between threads).

Compile-time parameters (bounded compilation while serving; see _triton_compat.py): the only
constexpr, ``BLOCK_N``, follows the node budget ``N`` of the batch, so ``_launch_constants(N)``
(pure) buckets it: ``N + 1`` rounded up to a power of two, at least 16 (``num_warps`` follows
``BLOCK_N``). For ``N <= 128`` that is at most 5 binaries (16 .. 256), ``log2(BLOCK_N / 16) + 1``
in general. ``num_cols`` (``N``) and the strides (all ``N`` or ``N + 1``) are runtime ints
without ==1 / %16 specialization.
"""

from __future__ import annotations

import torch

from . import launch_buckets
from ._triton_compat import jit, next_pow2, require_triton, tl

__all__ = ["triton_walk_tree"]


def _launch_constants(n: int) -> dict:
    """Constexprs (and ``num_warps``) of the kernel for a node budget ``n``, without launching."""
    block_n = max(16, next_pow2(n + 1))
    return dict(BLOCK_N=block_n, num_warps=4 if block_n <= 512 else 8)


@jit(do_not_specialize=("num_cols", "stride_db", "stride_pb", "stride_tb", "stride_ab", "stride_ob"),
     do_not_specialize_on_alignment=("DRAFT", "PARENT", "NUM_NODES", "TARGET"))
def _walk_tree_kernel(
    DRAFT, PARENT, NUM_NODES, TARGET, ACC_ROWS, OUT_TOK, NUM_ACC,
    num_cols,  # N
    stride_db, stride_pb, stride_tb, stride_ab, stride_ob,
    BLOCK_N: tl.constexpr,  # >= N + 1
):
    b = tl.program_id(0)
    idx = tl.arange(0, BLOCK_N)
    n_b = tl.load(NUM_NODES + b).to(tl.int32)
    node_ok = (idx < n_b) & (idx < num_cols)
    toks = tl.load(DRAFT + b * stride_db + idx, mask=node_ok, other=-1)
    parents = tl.load(PARENT + b * stride_pb + idx, mask=node_ok, other=-2).to(tl.int32)

    acc_rows = tl.full([BLOCK_N], -1, tl.int64)
    out_toks = tl.full([BLOCK_N], -1, tl.int64)
    acc_rows = tl.where(idx == 0, 0, acc_rows)
    row = 0
    k = 0
    walking = 1
    while walking != 0:
        target = tl.load(TARGET + b * stride_tb + row)
        hit = node_ok & (parents == row) & (toks == target)
        child = tl.min(tl.where(hit, idx, BLOCK_N), axis=0)
        if child < BLOCK_N:
            # Accept node row child + 1; its token (== target) is emitted.
            out_toks = tl.where(idx == k, target, out_toks)
            row = child + 1
            k += 1
            acc_rows = tl.where(idx == k, row.to(tl.int64), acc_rows)
        else:
            out_toks = tl.where(idx == k, target, out_toks)  # the target's own token
            walking = 0
    ok = idx <= num_cols
    tl.store(ACC_ROWS + b * stride_ab + idx, acc_rows, mask=ok)
    tl.store(OUT_TOK + b * stride_ob + idx, out_toks, mask=ok)
    tl.store(NUM_ACC + b, k.to(tl.int64))


def triton_walk_tree(
    draft_token_ids: torch.Tensor,  # int64 [B, N]
    parent_row: torch.Tensor,  # int64 [B, N]
    num_nodes: torch.Tensor,  # int64 [B]
    row_target_token: torch.Tensor,  # int64 [B, N + 1]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton greedy tree walk; returns ``(accepted_rows, output_token_ids, num_accepted)``."""
    require_triton("triton_walk_tree")
    num_reqs, n = draft_token_ids.shape
    dev = draft_token_ids.device
    accepted_rows = torch.empty((num_reqs, n + 1), dtype=torch.int64, device=dev)
    output_token_ids = torch.empty((num_reqs, n + 1), dtype=torch.int64, device=dev)
    num_accepted = torch.empty((num_reqs,), dtype=torch.int64, device=dev)
    if num_reqs == 0:
        return accepted_rows, output_token_ids, num_accepted
    draft_token_ids = draft_token_ids.to(torch.int64).contiguous()
    parent_row = parent_row.contiguous()
    row_target_token = row_target_token.to(torch.int64).contiguous()
    num_nodes = num_nodes.to(dev).contiguous()
    lc = _launch_constants(n)
    launch_buckets.note("walk_tree", lc, parent_row.dtype)
    _walk_tree_kernel[(num_reqs,)](
        draft_token_ids, parent_row, num_nodes, row_target_token,
        accepted_rows, output_token_ids, num_accepted,
        n, draft_token_ids.stride(0), parent_row.stride(0), row_target_token.stride(0),
        accepted_rows.stride(0), output_token_ids.stride(0),
        **lc,
    )
    return accepted_rows, output_token_ids, num_accepted
