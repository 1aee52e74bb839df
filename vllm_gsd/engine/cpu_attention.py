"""vLLM's CPU attention backend (CPU_ATTN) with the graph mask for rows that carry a tree.

vLLM 0.32's C++ CPU kernel knows causal and non-causal masks only. This backend keeps it for
every row (prefills, plain decodes) and, in a forward that carries a `TreeMask`
(engine/tree_attention.py), recomputes the rows of the requests with tree rows with torch SDPA
under the exact mask of docs/contracts.md (`vllm_gsd.kernels.graph_attention.visibility_mask`,
the mask of the reference the Triton kernel is tested against), reading the paged cache in place. It is installed over CPU_ATTN through vLLM's backend
registry (engine/patches.py), only in workers of a gsd engine.

The torch path reads the cache in the layout of the C++ kernel's "vec"/"vec16" ISAs; on CPUs with
AMX tiles vLLM would pick a tiled "amx" packing for bf16, so the builder pins the portable ISA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from vllm_gsd.engine.tree_attention import TreeMask, current_graph_mask
from vllm_gsd.kernels.graph_attention import visibility_mask
from vllm_gsd.kernels.paged_layout import CPU_SUPPORTED_ISAS, canonical_kv


class GsdCpuAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if self.isa not in CPU_SUPPORTED_ISAS:
            # The graph-masked path reads the cache; it knows the vec/vec16 packing only.
            self.isa = "vec" if self.block_size % 32 == 0 else "vec16"
            self._set_isa_to_layers(layer_names)


class GsdCpuAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        unsupported = [
            name
            for name, active in (
                ("sliding-window attention", self.sliding_window != -1),
                ("ALiBi", self.alibi_slopes is not None),
                ("logit soft-capping", bool(self.logits_soft_cap)),
                ("attention sinks", self.sinks is not None),
                ("an fp8 KV cache", self.is_fp8_kv_cache),
            )
            if active
        ]
        if unsupported and self.attn_type == AttentionType.DECODER:
            raise NotImplementedError(
                f"speculative method 'gsd' does not support models with {', '.join(unsupported)} "
                "on CPU yet"
            )

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        mask = current_graph_mask()
        if mask is None or attn_metadata is None or self.attn_type != AttentionType.DECODER:
            return output
        _apply_graph_mask(self, query, kv_cache, attn_metadata, output, mask)
        return output


@dataclass
class _GraphMaskPlan:
    """What every layer of one forward shares: which rows, which KV positions, which mask.

    The tree requests' rows are attended in one batched SDPA call per layer, padded to the
    longest request; building the masks and KV indices once per forward (not per layer) keeps
    the host work of a deep model small.
    """

    metadata_id: int
    token_index: torch.Tensor  # int64 [Bt, Q]: forward token of each padded query row (0 = pad)
    row_valid: torch.Tensor  # bool [Bt, Q]
    kv_block: torch.Tensor  # int64 [Bt, S]: block of each padded KV position
    kv_offset: torch.Tensor  # int64 [Bt, S]
    mask: torch.Tensor  # bool [Bt, 1, Q, S]


def _plan(metadata: CPUAttentionMetadata, mask: TreeMask, block_size: int) -> _GraphMaskPlan:
    request_index = mask.request_index
    starts = metadata.query_start_loc[request_index].tolist()
    ends = metadata.query_start_loc[request_index + 1].tolist()
    seq_lens = metadata.seq_lens[request_index].tolist()
    tree_base = mask.tree_base.tolist()
    num = len(starts)
    max_q = max(e - s for s, e in zip(starts, ends))
    max_s = max(seq_lens)
    token_index = torch.zeros((num, max_q), dtype=torch.int64)
    row_valid = torch.zeros((num, max_q), dtype=torch.bool)
    kv_block = torch.zeros((num, max_s), dtype=torch.int64)
    kv_offset = torch.zeros((num, max_s), dtype=torch.int64)
    visible = torch.zeros((num, 1, max_q, max_s), dtype=torch.bool)
    visible[..., 0] = True  # padding rows attend to one key, so SDPA stays finite; dropped later
    block_table = metadata.block_table[request_index].long()
    for b, (q0, q1, seq_len) in enumerate(zip(starts, ends, seq_lens)):
        q_len = q1 - q0
        token_index[b, :q_len] = torch.arange(q0, q1)
        row_valid[b, :q_len] = True
        positions = torch.arange(seq_len)
        kv_block[b, :seq_len] = block_table[b, positions // block_size]
        kv_offset[b, :seq_len] = positions % block_size
        visible[b, 0, :q_len, :seq_len] = visibility_mask(
            mask.query_tree_row[q0:q1].long(), seq_len, tree_base[b], mask.ancestor_words[b])
    return _GraphMaskPlan(id(metadata), token_index, row_valid, kv_block, kv_offset, visible)


def _apply_graph_mask(
    impl: CPUAttentionBackendImpl,
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, 2 * D]
    metadata: CPUAttentionMetadata,
    output: torch.Tensor,  # [T, Hq, D] or [T, Hq * D]
    mask: TreeMask,
) -> None:
    """Overwrite the rows of the requests in `mask` with graph-masked attention."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    plan = getattr(mask, "_cpu_plan", None)
    if plan is None or plan.metadata_id != id(metadata):
        plan = _plan(metadata, mask, block_size)
        mask._cpu_plan = plan
    key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
    keys, values = canonical_kv(key_cache, value_cache, "cpu")  # [nb, bs, Hkv, D] views
    k = keys[plan.kv_block, plan.kv_offset].transpose(1, 2).float()  # [Bt, Hkv, S, D]
    v = values[plan.kv_block, plan.kv_offset].transpose(1, 2).float()
    q = query.view(query.shape[0], impl.num_heads, impl.head_size)[plan.token_index]
    q = q.transpose(1, 2).float()  # [Bt, Hq, Q, D]
    attended = F.scaled_dot_product_attention(
        q, k, v, attn_mask=plan.mask, scale=impl.scale, enable_gqa=impl.num_heads != num_kv_heads)
    rows = attended.transpose(1, 2)[plan.row_valid]  # [T_tree, Hq, D]
    out = output.view(output.shape[0], impl.num_heads, impl.head_size)
    out[plan.token_index[plan.row_valid]] = rows.to(output.dtype)


class GsdCpuAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN, plus the graph mask for tree rows (see module docstring)."""

    @staticmethod
    def get_impl_cls() -> type[GsdCpuAttentionImpl]:
        return GsdCpuAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[GsdCpuAttentionMetadataBuilder]:
        return GsdCpuAttentionMetadataBuilder
