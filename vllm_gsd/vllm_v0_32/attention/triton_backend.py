"""TRITON_ATTN with the graph mask for tree rows, for CUDA (vllm_v0_32/attention/graph_backend.py).

The builder asks vLLM to order each batch decodes first (`reorder_batch_threshold`, vLLM's own
mechanism: requests of at most 1 + num_speculative_tokens scheduled tokens, every tree among
them, lead the batch; prefill chunks follow). So the tree requests and the decodes beside them
are a leading run of the batch's rows, and a forward splits in two (`plan_tree`, once per
forward; a layer only launches):

* the leading requests, up to the last tree request and any decode-shaped ones after it:
  `vllm_gsd.kernels.graph_attention` attends them, rows without a tree marked causal
  (query_tree_row = -1), straight from the layer's query into its output: per layer 1 launch,
  2 when the KV is split (the reduce), no gather, no scatter. The trade-off: the decode rows
  without a tree beside the trees are computed by our kernel, not vLLM's (exact against the
  causal reference in float32; bf16 within rounding, so not bit-identical to vLLM's kernel).
* the rest (prefill chunks): vLLM's kernel, on a view of its rows and its requests' slice of
  the metadata (one more launch a layer). A draft level or a decode-only step has no rest.
* no trees: vLLM's backend unchanged.

The graph kernel is decode-shaped (up to 128 / GQA-group query tokens per tile, each tile
scanning its request's KV up to the tile's last causal key, split-K tuned by the number of
tokens); vLLM's is built for long causal chunks: each gets the rows it is made for. A batch
that vLLM did not order (a prefill chunk among the trees) stays exact: the graph kernel attends
every row up to the last tree request, causal where there is no tree.

The plan (`TritonTreePlan`: metadata tensors on the forward's device, launch constants, grid,
split-K partial buffers shared by the layers, via `prepare_graph_attention`) is built once per
forward. A gsd engine on CUDA selects this backend for the target and the draft and runs
attention outside CUDA graphs (piecewise mode), since the mask changes every step
(vllm_v0_32/config_patches.py). Launch counts: docs/results/launches.md.

Tested on CPU tensors under the Triton interpreter (tests/engine/test_gpu_path.py); the project's
GPU machine has no vLLM, so this glue has not run inside vLLM on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
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

    launch: GraphAttentionLaunch  # graph_attention of the leading rows, planned
    rest: tuple[int, TritonAttentionMetadata] | None  # (first row, its metadata) of vLLM's rows; None: none
    kind: str  # "draft level", "decode step" (the graph kernel alone) or "split" (vLLM's kernel for the rest)

    @property
    def covers_all_rows(self) -> bool:
        return self.rest is None


class GsdTritonAttentionMetadataBuilder(GraphMetadataBuilder, TritonAttentionMetadataBuilder):
    metadata_cls = GsdTritonAttentionMetadata

    def plan_tree(self, metadata: TritonAttentionMetadata, tree: TreeAttention, common) -> TritonTreePlan:
        device = metadata.seq_lens.device
        num_reqs = metadata.seq_lens.shape[0]
        request_index = tree.request_index
        longest_tree = int(tree.query_len.max())
        shape = dict(layout="gpu", max_seq_len=metadata.max_seq_len)
        if tree.covers_all_rows and request_index.numel() == num_reqs:  # a draft level
            launch = prepare_graph_attention(
                **shape, num_tokens=metadata.num_actual_tokens, block_table=metadata.block_table,
                query_start_loc=metadata.query_start_loc, seq_lens=metadata.seq_lens,
                tree_base=_to_device(tree.tree_base, device), query_tree_row=tree.query_tree_row,
                ancestor_words=tree.ancestor_words, max_query_len=metadata.max_query_len)
            return TritonTreePlan(launch, None, "draft level")
        # The graph kernel's requests: up to the last tree, then while they are decode-shaped.
        query_start_loc = common.query_start_loc_cpu.numpy()
        query_lens = np.diff(query_start_loc[:num_reqs + 1])
        lead = int(request_index[-1]) + 1
        longer = np.flatnonzero(query_lens[lead:] > max(self.decode_query_len, longest_tree))
        lead += int(longer[0]) if longer.size else num_reqs - lead
        lead_tokens = int(query_start_loc[lead])
        base = torch.zeros(lead, dtype=torch.int32)
        base[request_index] = tree.tree_base
        words = tree.ancestor_words.new_zeros((lead, *tree.ancestor_words.shape[1:]))
        words[_to_device(request_index, device)] = tree.ancestor_words
        launch = prepare_graph_attention(
            **shape, num_tokens=lead_tokens, block_table=metadata.block_table[:lead],
            query_start_loc=metadata.query_start_loc[:lead + 1], seq_lens=metadata.seq_lens[:lead],
            tree_base=_to_device(base, device), query_tree_row=tree.query_tree_row[:lead_tokens],
            ancestor_words=words, max_query_len=int(query_lens[:lead].max()))
        if lead == num_reqs:
            return TritonTreePlan(launch, None, "decode step")
        return TritonTreePlan(launch, (lead_tokens, _requests_after(metadata, lead, lead_tokens, query_lens)),
                              "split")


def _requests_after(metadata: TritonAttentionMetadata, first: int, first_token: int,
                    query_lens: np.ndarray) -> TritonAttentionMetadata:
    """vLLM's metadata of requests first.. alone, their rows numbered from first_token (the rows
    of a view of the layer's query and output from there). max_seq_len stays the batch's: an
    upper bound, as vLLM's own under async scheduling."""
    per_request = {name: getattr(metadata, name)[first:] for name in ("mm_prefix_range_tensor", "rswa_prefix_lens")
                   if getattr(metadata, name) is not None}
    return replace(metadata, num_actual_tokens=metadata.num_actual_tokens - first_token,
                   max_query_len=int(query_lens[first:].max()),
                   query_start_loc=metadata.query_start_loc[first:] - first_token,
                   seq_lens=metadata.seq_lens[first:], block_table=metadata.block_table[first:],
                   slot_mapping=metadata.slot_mapping[first_token:], mm_prefix_range=None, **per_request)


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

    def vllm_rows(self, plan: TritonTreePlan, metadata):
        return plan.rest

    def attend_tree(self, query, kv_cache, metadata, plan: TritonTreePlan, output) -> None:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        plan.launch.launch(query, key_cache, value_cache, output, self.scale)  # its leading rows


class GsdTritonAttentionBackend(TritonAttentionBackend):
    """TRITON_ATTN, plus the graph mask for tree rows (see module docstring)."""

    @staticmethod
    def get_impl_cls() -> type[GsdTritonAttentionImpl]:
        return GsdTritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[GsdTritonAttentionMetadataBuilder]:
        return GsdTritonAttentionMetadataBuilder
