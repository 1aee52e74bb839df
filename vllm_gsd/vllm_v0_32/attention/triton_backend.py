"""TRITON_ATTN with the graph mask for tree rows, for CUDA (vllm_v0_32/attention/graph_backend.py).

vLLM's Triton kernel attends every row; the tree requests' rows are then attended again by
`vllm_gsd.kernels.graph_attention` (Triton, split-K) as a sub-batch of their own, reading vLLM's
paged cache in place, and written over vLLM's result. So a batch without trees, and every
request without a tree, is numerically vLLM's. A forward whose rows are all tree rows (the
draft's levels) skips vLLM's kernel. The sub-batch (tokens, query starts, sequence lengths,
block tables, tree rows) is planned once per forward on the device, when the metadata is built;
layers only read it. A gsd engine on CUDA selects this backend for the target and the draft and
runs attention outside CUDA graphs (piecewise mode), since the mask changes every step
(vllm_v0_32/config_patches.py).

Tested on CPU tensors under the Triton interpreter (tests/engine/test_gpu_path.py); the project's
GPU machine has no vLLM, so this glue has not run inside vLLM on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from vllm.utils.torch_utils import is_quantized_kv_cache

from vllm_gsd.vllm_v0_32.attention.graph_backend import GraphAttentionImpl, GraphMetadataBuilder
from vllm_gsd.engine.tree_batch import TreeAttention, _to_device
from vllm_gsd.kernels.graph_attention import graph_attention


@dataclass
class GsdTritonAttentionMetadata(TritonAttentionMetadata):
    tree: Any = None  # TritonTreePlan of this forward's tree requests, or None


@dataclass(frozen=True)
class TritonTreePlan:
    """The tree requests as a sub-batch of their own (device tensors; Bt requests, T_tree tokens)."""

    token_index: torch.Tensor | None  # int64 [T_tree]: forward token of each row; None = all, in order
    query_start_loc: torch.Tensor  # int32 [Bt + 1]
    seq_lens: torch.Tensor  # int32 [Bt]
    block_table: torch.Tensor  # int32 [Bt, max_blocks]
    tree_base: torch.Tensor  # int32 [Bt]
    query_tree_row: torch.Tensor  # int32 [T_tree]
    ancestor_words: torch.Tensor  # int32 [Bt, R, W]
    max_seq_len: int  # upper bounds, for the kernel's launch grid
    max_query_len: int
    covers_all_rows: bool


class GsdTritonAttentionMetadataBuilder(GraphMetadataBuilder, TritonAttentionMetadataBuilder):
    metadata_cls = GsdTritonAttentionMetadata

    def plan_tree(self, metadata: TritonAttentionMetadata, tree: TreeAttention) -> TritonTreePlan:
        device = metadata.seq_lens.device
        num_reqs = metadata.seq_lens.shape[0]
        request_index = tree.request_index
        whole_batch = tree.covers_all_rows and request_index.numel() == num_reqs
        query_start_loc = torch.zeros(request_index.numel() + 1, dtype=torch.int32)
        torch.cumsum(tree.query_len, 0, out=query_start_loc[1:])
        token_index = None if whole_batch else _to_device(tree.token_index(), device)
        index = _to_device(request_index, device)
        return TritonTreePlan(
            token_index=token_index,
            query_start_loc=_to_device(query_start_loc, device),
            seq_lens=metadata.seq_lens[index],
            block_table=metadata.block_table[index],
            tree_base=_to_device(tree.tree_base, device),
            query_tree_row=tree.query_tree_row if token_index is None else tree.query_tree_row[token_index],
            ancestor_words=tree.ancestor_words,
            max_seq_len=metadata.max_seq_len,
            max_query_len=int(tree.query_len.max()),
            covers_all_rows=tree.covers_all_rows,
        )


class GsdTritonAttentionImpl(GraphAttentionImpl, TritonAttentionImpl):
    platform = "CUDA"

    def graph_mask_blockers(self) -> list[str]:
        return [name for name, active in (
            ("sliding-window attention", self.sliding_window != (-1, -1)),
            ("ALiBi", self.alibi_slopes is not None),
            ("logit soft-capping", bool(self.logits_soft_cap)),
            ("attention sinks", self.sinks is not None),
            ("a quantized KV cache", is_quantized_kv_cache(self.kv_cache_dtype)),
            ("chunked local attention", self.chunk_lookback != -1),
        ) if active]

    def attend_tree(self, query, kv_cache, metadata, plan: TritonTreePlan, output) -> None:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        num_tokens = metadata.num_actual_tokens
        out = output[:num_tokens].view(num_tokens, self.num_heads, self.head_size)
        rows = query[:num_tokens] if plan.token_index is None else query[plan.token_index]
        attended = graph_attention(
            rows, key_cache, value_cache, plan.block_table, plan.query_start_loc, plan.seq_lens,
            plan.tree_base, plan.query_tree_row, plan.ancestor_words, self.scale,
            out=out if plan.token_index is None else None, layout="gpu",
            max_seq_len=plan.max_seq_len, max_query_len=plan.max_query_len,
        )
        if plan.token_index is not None:
            out[plan.token_index] = attended


class GsdTritonAttentionBackend(TritonAttentionBackend):
    """TRITON_ATTN, plus the graph mask for tree rows (see module docstring)."""

    @staticmethod
    def get_impl_cls() -> type[GsdTritonAttentionImpl]:
        return GsdTritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[GsdTritonAttentionMetadataBuilder]:
        return GsdTritonAttentionMetadataBuilder
