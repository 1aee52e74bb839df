"""TRITON_ATTN with the graph mask for tree rows, for CUDA (vllm_v0_32/attention/graph_backend.py).

Three plans, chosen once per forward by the metadata builder (`plan_tree`); a layer only launches:

* draft levels (every row a tree row) and decode steps (every request decode-shaped: its query
  no longer than 1 + num_speculative_tokens or than the forward's longest tree query, so no
  prefill chunk): `vllm_gsd.kernels.graph_attention` attends the whole batch, rows without a
  tree marked causal (query_tree_row = -1), straight from the layer's query into its output, and
  vLLM's kernel is skipped: per layer 1 launch, 2 when the KV is split (the reduce), no gather,
  no scatter. The trade-off: on such a step the rows without a tree are computed by our kernel,
  not vLLM's (exact against the causal reference in float32; bf16 within rounding, so not
  bit-identical to what vLLM's kernel would have given them).
* a step with a prefill chunk: vLLM's kernel attends every row (it is the one built for long
  causal chunks; the graph kernel is decode-shaped: up to 128 / GQA-group query tokens per tile,
  each tile scanning its request's KV up to the tile's last causal key, split-K tuned by the
  number of tokens), then the tree requests' rows are gathered, attended by the graph kernel as
  a sub-batch of their own and written over vLLM's result. Rows without a tree are vLLM's.
* no trees: vLLM's backend unchanged.

The plan (`TritonTreePlan`: metadata tensors on the forward's device, launch constants, grid,
split-K partial buffers shared by the layers, via `prepare_graph_attention`) is built once per
forward. A gsd engine on CUDA selects this backend for the target and the draft and runs
attention outside CUDA graphs (piecewise mode), since the mask changes every step
(vllm_v0_32/config_patches.py). Launch counts: docs/results/launches.md.

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
from vllm_gsd.kernels.graph_attention import GraphAttentionLaunch, prepare_graph_attention


@dataclass
class GsdTritonAttentionMetadata(TritonAttentionMetadata):
    tree: Any = None  # TritonTreePlan of this forward's tree requests, or None


@dataclass(frozen=True)
class TritonTreePlan:
    """The rows the graph kernel attends this forward, planned (device tensors, launch constants)."""

    launch: GraphAttentionLaunch  # graph_attention of the attended rows, planned
    token_index: torch.Tensor | None  # int64 [T_tree]: forward token of each attended row; None = every row
    covers_all_rows: bool  # the graph kernel attends every row: vLLM's kernel is skipped
    kind: str  # "draft level", "decode step" (whole batch) or "sub-batch" (with vLLM's kernel)


class GsdTritonAttentionMetadataBuilder(GraphMetadataBuilder, TritonAttentionMetadataBuilder):
    metadata_cls = GsdTritonAttentionMetadata

    @property
    def decode_query_len(self) -> int:
        """Longest query vLLM counts as a decode (1 + num_speculative_tokens; 1 without spec)."""
        spec = getattr(self.vllm_config, "speculative_config", None)
        return 1 + (getattr(spec, "num_speculative_tokens", None) or 0)

    def plan_tree(self, metadata: TritonAttentionMetadata, tree: TreeAttention) -> TritonTreePlan:
        device = metadata.seq_lens.device
        num_reqs = metadata.seq_lens.shape[0]
        request_index = tree.request_index
        longest_tree = int(tree.query_len.max())
        draft_level = tree.covers_all_rows and request_index.numel() == num_reqs
        decode_step = not draft_level and metadata.max_query_len <= max(self.decode_query_len, longest_tree)
        shape = dict(layout="gpu", max_seq_len=metadata.max_seq_len)
        if draft_level or decode_step:
            if draft_level:
                tree_base, words = _to_device(tree.tree_base, device), tree.ancestor_words
            else:  # every request of the batch, those without a tree all causal
                base = torch.zeros(num_reqs, dtype=torch.int32)
                base[request_index] = tree.tree_base
                tree_base = _to_device(base, device)
                words = tree.ancestor_words.new_zeros((num_reqs, *tree.ancestor_words.shape[1:]))
                words[_to_device(request_index, device)] = tree.ancestor_words
            launch = prepare_graph_attention(
                **shape, num_tokens=metadata.num_actual_tokens, block_table=metadata.block_table,
                query_start_loc=metadata.query_start_loc, seq_lens=metadata.seq_lens, tree_base=tree_base,
                query_tree_row=tree.query_tree_row, ancestor_words=words, max_query_len=metadata.max_query_len)
            return TritonTreePlan(launch, None, True, "draft level" if draft_level else "decode step")
        query_start_loc = torch.zeros(request_index.numel() + 1, dtype=torch.int32)
        torch.cumsum(tree.query_len, 0, out=query_start_loc[1:])
        token_index = _to_device(tree.token_index(), device)
        index = _to_device(request_index, device)
        launch = prepare_graph_attention(
            **shape, num_tokens=token_index.shape[0], block_table=metadata.block_table[index],
            query_start_loc=_to_device(query_start_loc, device), seq_lens=metadata.seq_lens[index],
            tree_base=_to_device(tree.tree_base, device), query_tree_row=tree.query_tree_row[token_index],
            ancestor_words=tree.ancestor_words, max_query_len=longest_tree)
        return TritonTreePlan(launch, token_index, False, "sub-batch")


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
        if plan.token_index is None:  # the whole batch, straight into vLLM's output
            plan.launch.launch(query, key_cache, value_cache, output, self.scale)
            return
        attended = plan.launch.launch(query[plan.token_index], key_cache, value_cache,
                                      query.new_empty((plan.token_index.shape[0], *query.shape[1:])), self.scale)
        output.view(-1, self.num_heads, self.head_size)[plan.token_index] = attended


class GsdTritonAttentionBackend(TritonAttentionBackend):
    """TRITON_ATTN, plus the graph mask for tree rows (see module docstring)."""

    @staticmethod
    def get_impl_cls() -> type[GsdTritonAttentionImpl]:
        return GsdTritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[GsdTritonAttentionMetadataBuilder]:
        return GsdTritonAttentionMetadataBuilder
