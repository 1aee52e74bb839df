"""The graph mask for tree rows over vLLM's CPU paged KV cache, in plain torch: the plan and
the attention that the CPU_ATTN backend subclass (vllm_v0_32/attention/cpu_backend.py) runs.

vLLM 0.32's C++ CPU kernel knows causal and non-causal masks only. Tree rows are attended in
float32 (`paged_tree_attention`) under the exact mask of docs/contracts.md (`vllm_gsd.kernels.graph_attention.
visibility_mask`, the mask the Triton kernel is tested against), reading the paged cache: one
batched call per layer over the tree requests, padded to the longest. What every layer of a
forward shares (mask, KV pages to read, rows) is planned once, when the metadata is built
(`plan_cpu_tree`).

The cache is read in the packing of the ISA vLLM picked for the C++ kernel (kernels/paged_layout.py:
"vec"/"vec16", or the tiled "amx" of bf16 on CPUs with AMX tiles); on CPUs whose packing this
package has not checked (ARM, POWER, s390x, RISC-V) the backend pins the portable "vec"/"vec16".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_gsd.kernels.graph_attention import visibility_mask
from vllm_gsd.kernels.paged_layout import CpuPacking, factor_view


@dataclass(frozen=True)
class CpuTreePlan:
    """The tree requests' attention, shared by every layer of one forward.

    Bt tree requests, each padded to Q query rows and S = P * block_size keys (P pages).
    """

    token_index: torch.Tensor  # int64 [Bt, Q]: forward token of each padded query row
    pages: torch.Tensor  # int64 [Bt, P]: cache blocks of each request, in order
    hidden: torch.Tensor  # bool [Bt, 1, 1, Q, S]: True = the row may not see the key
    key_valid: torch.Tensor | None  # bool [Bt, 1, S, 1]: the key is one of its request's tokens
    # (None: every key is, S being every request's length)
    covers_all_rows: bool
    tokens: torch.Tensor  # int64 [T_tree]: forward token of each real row, in row order
    valid_rows: torch.Tensor | None  # int64 [T_tree]: the real rows among [Bt * Q] (None: all are)
    packing: CpuPacking  # how the cache's ISA packs a block (kernels/paged_layout.py)
    # The mask as a float bias in the layers' score layout, built by the first layer that asks
    # (a model's layers share their head counts) rather than broadcast and filled in every layer.
    _bias: dict = field(default_factory=dict, compare=False, repr=False)

    def bias(self, num_kv_heads: int, group: int) -> torch.Tensor:
        """float32 [Bt * Hkv, g * Q, S]: -inf where the row may not see the key, else 0."""
        key = (num_kv_heads, group)
        if key not in self._bias:
            num, _, _, num_rows, num_keys = self.hidden.shape
            bias = torch.zeros(self.hidden.shape, dtype=torch.float32).masked_fill_(self.hidden, float("-inf"))
            self._bias[key] = bias.expand(num, num_kv_heads, group, num_rows, num_keys).reshape(
                num * num_kv_heads, group * num_rows, num_keys)
        return self._bias[key]


def plan_cpu_tree(block_table: torch.Tensor, seq_lens: list[int], query_start: list[int], query_len: list[int],
                  tree_base: list[int], query_tree_row: torch.Tensor, ancestor_words: torch.Tensor,
                  block_size: int, covers_all_rows: bool, packing: CpuPacking) -> CpuTreePlan:
    """The plan of `paged_tree_attention` for Bt tree requests: request b's query rows are the
    forward's tokens query_start[b] + [0, query_len[b]), its KV the first seq_lens[b] slots of
    its block_table row [Bt, >= P]; query_tree_row [T] and ancestor_words [Bt, R, W] as in
    docs/contracts.md."""
    num, max_q, num_keys = len(query_start), max(query_len), max(seq_lens)
    token_index = torch.zeros((num, max_q), dtype=torch.int64)
    row_valid = torch.zeros((num, max_q), dtype=torch.bool)
    visible = torch.zeros((num, max_q, num_keys), dtype=torch.bool)
    visible[..., 0] = True  # padding rows attend to one key, so the softmax stays finite; dropped later
    key_valid = torch.zeros((num, 1, num_keys, 1), dtype=torch.bool)
    for b, (q0, q_len, seq_len) in enumerate(zip(query_start, query_len, seq_lens)):
        token_index[b, :q_len] = torch.arange(q0, q0 + q_len)
        row_valid[b, :q_len] = True
        visible[b, :q_len, :seq_len] = visibility_mask(
            query_tree_row[q0:q0 + q_len].long(), seq_len, tree_base[b], ancestor_words[b])
        key_valid[b, 0, :seq_len] = True
    padded = min(seq_lens) < num_keys
    valid_rows = None if min(query_len) == max_q else torch.nonzero(row_valid.view(-1)).squeeze(1)
    return CpuTreePlan(token_index, block_table[:, :-(-num_keys // block_size)].long(),
                       ~visible.view(num, 1, 1, max_q, num_keys), key_valid if padded else None, covers_all_rows,
                       token_index[row_valid], valid_rows, packing)


def paged_tree_attention(query: torch.Tensor, kv_cache: torch.Tensor, plan: CpuTreePlan, scale: float,
                         output: torch.Tensor) -> None:
    """Graph-masked attention of the plan's rows over vLLM's CPU cache, in float32: the first S
    slots of each request's pages (S = its longest request's length).

    query, output [T, Hq, D]; kv_cache [num_blocks, Hkv, block_size, 2 * D]: per (block, head)
    the keys, then the values, each packed as plan.packing says (kernels/paged_layout.py). Writes
    output's rows of the plan's tokens, nothing else.

    Two batched GEMMs per layer, query heads grouped by their KV head ([Hkv, g * Q] rows) rather
    than SDPA with GQA, which copies the keys and values per query head; keys and values are
    read in the orientation their packing stores innermost ("vec": K^T and V; "amx": K and V^T,
    its token or dim pairs moved as 32-bit units), each in the strided copy that converts it to
    float32, which the GEMMs take as it lies; the mask enters the first GEMM as its bias. At a
    tree's few rows a layer is a dozen small ops, so their number is what costs: 15-30% faster
    than SDPA, and a third faster than filling the mask into the scores.
    """
    num, num_pages = plan.pages.shape
    _, num_kv_heads, block_size, two_d = kv_cache.shape
    _, num_heads, head_size = query.shape
    group, num_rows, num_keys = num_heads // num_kv_heads, plan.token_index.shape[1], plan.hidden.shape[-1]
    batches = num * num_kv_heads
    # index_select, not kv_cache[pages]: advanced indexing of the cache costs 5x as much here.
    paged = kv_cache.index_select(0, plan.pages.view(-1)).view(num, num_pages, num_kv_heads, 2, block_size * head_size)
    keys, keys_by_token = _unpacked(paged[:, :, :, 0], plan.packing, "key", head_size, num_keys)
    values, values_by_token = _unpacked(paged[:, :, :, 1], plan.packing, "value", head_size, num_keys)
    if plan.key_valid is not None:
        # A slot past a shorter request's tokens may hold anything (NaN included): NaN + -inf
        # and 0 * NaN are NaN.
        by_token, by_dim = plan.key_valid, plan.key_valid.transpose(-1, -2)
        keys = torch.where(by_token if keys_by_token else by_dim, keys, 0.0)
        values = torch.where(by_token if values_by_token else by_dim, values, 0.0)
    keys = keys.reshape(batches, *keys.shape[2:])
    values = values.reshape(batches, *values.shape[2:])
    q = torch.empty((num, num_kv_heads, group, num_rows, head_size), dtype=torch.float32)
    q.copy_(query.index_select(0, plan.token_index.view(-1))
            .view(num, num_rows, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4))
    scores = torch.baddbmm(plan.bias(num_kv_heads, group), q.view(batches, group * num_rows, head_size),
                           keys.transpose(-1, -2) if keys_by_token else keys, alpha=scale)
    probs = torch.softmax(scores, dim=-1)
    attended = torch.bmm(probs, values if values_by_token else values.transpose(-1, -2))
    rows = attended.view(num, num_kv_heads, group, num_rows, head_size).permute(0, 3, 1, 2, 4).reshape(
        num * num_rows, num_heads, head_size)
    if plan.valid_rows is not None:
        rows = rows.index_select(0, plan.valid_rows)
    output.index_copy_(0, plan.tokens, rows.to(output.dtype))


def _unpacked(half: torch.Tensor, packing: CpuPacking, kind: str, head_size: int, num_keys: int
              ) -> tuple[torch.Tensor, bool]:
    """half [Bt, P, Hkv, block_size * D] (the keys or values of each request's pages) ->
    (float32 [Bt, Hkv, S, D], True) or ([Bt, Hkv, D, S], False), S = num_keys: whichever axis the
    packing stores innermost stays innermost, so that the copy reads runs, not single elements.
    An innermost pair of 16-bit elements ("amx") moves as one 32-bit unit."""
    num, _, num_kv_heads, _ = half.shape
    factors = packing.key if kind == "key" else packing.value
    by_token = factors[-1][0] == "d"
    element_dtype = half.dtype
    paired = factors[-1][1] == 2 and half.element_size() == 2
    if paired:
        half, factors = half.view(torch.int32), factors[:-1]
    digits = factor_view(half, factors)  # [Bt, P, Hkv, *s, *d]
    s_axes = list(range(3, 3 + sum(axis == "s" for axis, _ in factors)))
    d_axes = list(range(3 + len(s_axes), digits.dim()))
    source = digits.permute(*([0, 2, 1, *s_axes, *d_axes] if by_token else [0, 2, *d_axes, 1, *s_axes]))
    if paired:
        unpacked = torch.empty(source.shape, dtype=torch.int32).copy_(source).view(element_dtype).float()
    else:
        unpacked = torch.empty(source.shape, dtype=torch.float32).copy_(source)
    if by_token:
        return unpacked.view(num, num_kv_heads, -1, head_size)[:, :, :num_keys], True
    return unpacked.view(num, num_kv_heads, head_size, -1)[..., :num_keys], False
