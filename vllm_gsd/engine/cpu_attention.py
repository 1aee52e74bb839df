"""vLLM's CPU attention backend (CPU_ATTN) with the graph mask for rows that carry a tree.

vLLM 0.32's C++ CPU kernel knows causal and non-causal masks only. This backend keeps it for
every row (prefills, plain decodes) and, in a forward that carries a `TreeMask`
(engine/tree_attention.py), recomputes the rows of the requests with tree rows through the torch
graph-masked paged attention of `vllm_gsd.kernels.graph_attention` (one SDPA call per such request
with the exact mask of docs/contracts.md). It is installed over CPU_ATTN through vLLM's backend
registry (engine/patches.py), only in workers of a gsd engine.

The torch path reads the cache in the layout of the C++ kernel's "vec"/"vec16" ISAs; on CPUs with
AMX tiles vLLM would pick a tiled "amx" packing for bf16, so the builder pins the portable ISA.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from vllm_gsd.engine.tree_attention import TreeMask, current_graph_mask
from vllm_gsd.kernels.graph_attention import graph_attention_ref
from vllm_gsd.kernels.paged_layout import CPU_SUPPORTED_ISAS


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


def _apply_graph_mask(
    impl: CPUAttentionBackendImpl,
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, 2 * D]
    metadata: CPUAttentionMetadata,
    output: torch.Tensor,  # [T, Hq, D] or [T, Hq * D]
    mask: TreeMask,
) -> None:
    """Overwrite the rows of the requests in `mask` with graph-masked attention."""
    query_start_loc = metadata.query_start_loc
    request_index = mask.request_index
    starts = query_start_loc[request_index].tolist()
    ends = query_start_loc[request_index + 1].tolist()
    token_index = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends)])
    lengths = torch.tensor([e - s for s, e in zip(starts, ends)], dtype=torch.int32)
    sub_query_start_loc = torch.zeros(len(starts) + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=sub_query_start_loc[1:])

    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
    out_rows = graph_attention_ref(
        query[token_index].view(len(token_index), impl.num_heads, impl.head_size),
        key_cache,
        value_cache,
        metadata.block_table[request_index],
        sub_query_start_loc,
        metadata.seq_lens[request_index],
        mask.tree_base,
        mask.query_tree_row[token_index],
        mask.ancestor_words,
        impl.scale,
        layout="cpu",
    )
    output.view(output.shape[0], impl.num_heads, impl.head_size)[token_index] = out_rows.to(output.dtype)


class GsdCpuAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN, plus the graph mask for tree rows (see module docstring)."""

    @staticmethod
    def get_impl_cls() -> type[GsdCpuAttentionImpl]:
        return GsdCpuAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[GsdCpuAttentionMetadataBuilder]:
        return GsdCpuAttentionMetadataBuilder
