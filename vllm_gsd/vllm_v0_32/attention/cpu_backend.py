"""CPU_ATTN with the graph mask for tree rows (vllm_v0_32/attention/graph_backend.py's design).

vLLM's CPU backend subclassed: the builder plans the tree requests' attention once per forward
and the impl runs it, both with engine/cpu_attention.py's plain-torch pieces (`plan_cpu_tree`,
`paged_tree_attention`), reading the paged cache in the packing of the ISA vLLM picked for its
C++ kernel (kernels/paged_layout.py); on CPUs whose packing this package has not checked (ARM,
POWER, s390x, RISC-V) the builder pins the portable "vec"/"vec16".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from vllm_gsd.engine.cpu_attention import CpuTreePlan, paged_tree_attention, plan_cpu_tree
from vllm_gsd.engine.tree_batch import TreeAttention
from vllm_gsd.kernels.paged_layout import CPU_SUPPORTED_ISAS, cpu_packing
from vllm_gsd.vllm_v0_32.attention.graph_backend import GraphAttentionImpl, GraphMetadataBuilder


@dataclass
class GsdCpuAttentionMetadata(CPUAttentionMetadata):
    tree: Any = None  # CpuTreePlan of this forward's tree requests, or None


class GsdCpuAttentionMetadataBuilder(GraphMetadataBuilder, CPUAttentionMetadataBuilder):
    metadata_cls = GsdCpuAttentionMetadata

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.head_size = kv_cache_spec.head_size
        if self.isa not in CPU_SUPPORTED_ISAS:
            # The graph-masked path reads the cache: only in a packing checked against vLLM's.
            self.pin_portable_packing()
        self.packing = cpu_packing(self.isa, self.block_size, self.head_size)

    def pin_portable_packing(self) -> None:
        """Make these layers' kernel (and so their cache) "vec"/"vec16", whatever vLLM picked:
        before any request writes the cache. For layers whose attention runs mostly
        graph-masked, where "amx" tiles cost 40-60% more to read than "vec" blocks."""
        self.isa = "vec" if self.block_size % 32 == 0 else "vec16"
        self._set_isa_to_layers(self.layer_names)
        self.packing = cpu_packing(self.isa, self.block_size, self.head_size)

    def plan_tree(self, metadata: CPUAttentionMetadata, tree: TreeAttention, common) -> CpuTreePlan:
        request_index = tree.request_index
        return plan_cpu_tree(metadata.block_table[request_index], metadata.seq_lens[request_index].tolist(),
                             tree.query_start.tolist(), tree.query_len.tolist(), tree.tree_base.tolist(),
                             tree.query_tree_row, tree.ancestor_words, self.block_size, tree.covers_all_rows,
                             self.packing)


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
        paged_tree_attention(query.view(query.shape[0], self.num_heads, self.head_size), kv_cache, plan,
                             self.scale, output.view(output.shape[0], self.num_heads, self.head_size))


class GsdCpuAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN, plus the graph mask for tree rows (see module docstring)."""

    @staticmethod
    def get_impl_cls() -> type[GsdCpuAttentionImpl]:
        return GsdCpuAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[GsdCpuAttentionMetadataBuilder]:
        return GsdCpuAttentionMetadataBuilder
