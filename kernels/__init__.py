"""Triton kernels of vllm-gsd, each beside the plain-torch reference it is tested against.

Imported as ``vllm_gsd.kernels`` (package-dir mapping in pyproject.toml). Nothing here imports
vLLM: the GPU check machine has none, and the engine's CPU backend uses the ``*_ref``
functions (plain torch) as its implementation.
"""

from .ancestor_masks import ancestor_words_from_parents
from .graph_attention import graph_attention, graph_attention_ref, visibility_mask
from .kv_compaction import compact_kv, compact_kv_ref
from .paged_layout import (
    CPU_SUPPORTED_ISAS,
    LAYOUTS,
    canonical_kv,
    cpu_kv_cache_shape,
    gpu_kv_cache_shape,
    split_kv_cache,
)
from .tree_acceptance import walk_tree

__all__ = [
    "ancestor_words_from_parents",
    "graph_attention",
    "graph_attention_ref",
    "visibility_mask",
    "compact_kv",
    "compact_kv_ref",
    "walk_tree",
    "LAYOUTS",
    "CPU_SUPPORTED_ISAS",
    "canonical_kv",
    "split_kv_cache",
    "cpu_kv_cache_shape",
    "gpu_kv_cache_shape",
]
