"""Triton kernels of vllm-gsd, each beside the plain-torch reference it is tested against.

Imported as ``vllm_gsd.kernels`` (package-dir mapping in pyproject.toml). Nothing here imports
vLLM: the GPU check machine has none. A Triton kernel whose torch twin lives in vllm_gsd.graph
(where the engine takes it from) is named ``triton_*``; the ``*_ref`` functions are test
references only; ``compact_kv_cpu`` is the CPU engine's KV compaction.
"""

from .ancestor_masks import triton_ancestor_words_from_parents
from .graph_attention import graph_attention, graph_attention_ref, visibility_mask
from .kv_compaction import compact_kv, compact_kv_cpu, compact_kv_ref
from .paged_layout import (
    CPU_SUPPORTED_ISAS,
    LAYOUTS,
    canonical_kv,
    cpu_kv_cache_shape,
    gpu_kv_cache_shape,
    split_kv_cache,
)
from .tree_acceptance import triton_walk_tree

__all__ = [
    "triton_ancestor_words_from_parents",
    "graph_attention",
    "graph_attention_ref",
    "visibility_mask",
    "compact_kv",
    "compact_kv_cpu",
    "compact_kv_ref",
    "triton_walk_tree",
    "LAYOUTS",
    "CPU_SUPPORTED_ISAS",
    "canonical_kv",
    "split_kv_cache",
    "cpu_kv_cache_shape",
    "gpu_kv_cache_shape",
]
