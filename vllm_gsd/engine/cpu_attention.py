"""CPU_ATTN with the graph mask for tree rows (engine/graph_attention_backend.py's design).

vLLM 0.32's C++ CPU kernel knows causal and non-causal masks only. Tree rows are attended with
torch SDPA under the exact mask of docs/contracts.md (`vllm_gsd.kernels.graph_attention.
visibility_mask`, the mask the Triton kernel is tested against), reading the paged cache: one
batched call per layer over the tree requests, padded to the longest. What every layer of a
forward shares (mask, KV pages to read, rows) is planned once, when the metadata is built.

The cache is read in the packing of the C++ kernel's "vec"/"vec16" ISAs; on CPUs with AMX
tiles vLLM would pick a tiled "amx" packing for bf16, so the builder pins the portable ISA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from vllm_gsd.engine.graph_attention_backend import GraphAttentionImpl, GraphMetadataBuilder
from vllm_gsd.engine.tree_batch import TreeAttention
from vllm_gsd.kernels.graph_attention import visibility_mask
from vllm_gsd.kernels.paged_layout import CPU_SUPPORTED_ISAS


@dataclass
class GsdCpuAttentionMetadata(CPUAttentionMetadata):
    tree: Any = None  # CpuTreePlan of this forward's tree requests, or None


@dataclass(frozen=True)
class CpuTreePlan:
    """The tree requests' attention, shared by every layer of one forward.

    Bt tree requests, each padded to Q query rows and P pages (S = P * block_size keys).
    """

    token_index: torch.Tensor  # int64 [Bt, Q]: forward token of each padded query row
    row_valid: torch.Tensor  # bool [Bt, Q]
    pages: torch.Tensor  # int64 [Bt, P]: cache blocks of each request, in order
    mask: torch.Tensor  # bool [Bt, 1, Q, S]
    covers_all_rows: bool


class GsdCpuAttentionMetadataBuilder(GraphMetadataBuilder, CPUAttentionMetadataBuilder):
    metadata_cls = GsdCpuAttentionMetadata

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if self.isa not in CPU_SUPPORTED_ISAS:
            # The graph-masked path reads the cache; it knows the vec/vec16 packing only.
            self.isa = "vec" if self.block_size % 32 == 0 else "vec16"
            self._set_isa_to_layers(layer_names)

    def plan_tree(self, metadata: CPUAttentionMetadata, tree: TreeAttention) -> CpuTreePlan:
        block_size = self.block_size
        request_index = tree.request_index
        seq_lens = metadata.seq_lens[request_index].tolist()
        starts, lengths = tree.query_start.tolist(), tree.query_len.tolist()
        tree_base = tree.tree_base.tolist()
        num, max_q = len(starts), max(lengths)
        max_pages = -(-max(seq_lens) // block_size)
        token_index = torch.zeros((num, max_q), dtype=torch.int64)
        row_valid = torch.zeros((num, max_q), dtype=torch.bool)
        mask = torch.zeros((num, 1, max_q, max_pages * block_size), dtype=torch.bool)
        mask[..., 0] = True  # padding rows attend to one key, so SDPA stays finite; dropped later
        pages = metadata.block_table[request_index, :max_pages].long()
        for b, (q0, q_len, seq_len) in enumerate(zip(starts, lengths, seq_lens)):
            token_index[b, :q_len] = torch.arange(q0, q0 + q_len)
            row_valid[b, :q_len] = True
            mask[b, 0, :q_len, :seq_len] = visibility_mask(
                tree.query_tree_row[q0:q0 + q_len].long(), seq_len, tree_base[b], tree.ancestor_words[b])
            mask[b, 0, :q_len, seq_len:] = False
        return CpuTreePlan(token_index, row_valid, pages, mask, tree.covers_all_rows)


class GsdCpuAttentionImpl(GraphAttentionImpl, CPUAttentionBackendImpl):
    platform = "CPU"

    def graph_mask_blockers(self) -> list[str]:
        return [name for name, active in (
            ("sliding-window attention", self.sliding_window != -1),
            ("ALiBi", self.alibi_slopes is not None),
            ("logit soft-capping", bool(self.logits_soft_cap)),
            ("attention sinks", self.sinks is not None),
            ("a quantized KV cache", self.is_fp8_kv_cache),
        ) if active]

    def attend_tree(self, query, kv_cache, metadata, plan: CpuTreePlan, output) -> None:
        # kv_cache [num_blocks, Hkv, block_size, 2 * D]: per (block, head) the keys stored
        # dim-major ([D, block_size]), then the values token-major (kernels/paged_layout.py).
        num_blocks, num_kv_heads, block_size, two_d = kv_cache.shape
        head_size = two_d // 2
        num, num_pages = plan.pages.shape
        # index_select, not kv_cache[pages]: advanced indexing of the cache costs 5x as much here.
        paged = kv_cache.index_select(0, plan.pages.view(-1)).view(num, num_pages, num_kv_heads, 2,
                                                                   block_size * head_size)
        keys = paged[:, :, :, 0].view(num, num_pages, num_kv_heads, head_size, block_size)
        keys = keys.permute(0, 2, 1, 4, 3).reshape(num, num_kv_heads, num_pages * block_size, head_size)
        values = paged[:, :, :, 1].view(num, num_pages, num_kv_heads, block_size, head_size)
        values = values.permute(0, 2, 1, 3, 4).reshape(num, num_kv_heads, num_pages * block_size, head_size)
        q = query.view(query.shape[0], self.num_heads, self.head_size)[plan.token_index]
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2).float(), keys.float(), values.float(), attn_mask=plan.mask,
            scale=self.scale, enable_gqa=self.num_heads != num_kv_heads)
        rows = attended.transpose(1, 2)[plan.row_valid]  # [T_tree, Hq, D]
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        out[plan.token_index[plan.row_valid]] = rows.to(output.dtype)


class GsdCpuAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN, plus the graph mask for tree rows (see module docstring)."""

    @staticmethod
    def get_impl_cls() -> type[GsdCpuAttentionImpl]:
        return GsdCpuAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[GsdCpuAttentionMetadataBuilder]:
        return GsdCpuAttentionMetadataBuilder
