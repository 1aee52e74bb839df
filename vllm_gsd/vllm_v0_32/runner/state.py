"""What a gsd runner keeps besides vLLM's state, and which runners are gsd runners.

All per-runner GSD state is one `GsdRunnerState`, the runner's `gsd` attribute, set by
setup_hooks.wrap_runner_init; every hook of this package acts only on a gsd runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_gsd.engine.config import is_gsd
from vllm_gsd.engine.metrics import GsdMetrics
from vllm_gsd.engine.tree_batch import TreeAttention, TreeSlot
from vllm_gsd.kernels.paged_layout import CpuPacking


@dataclass
class GsdRunnerState:
    """What a gsd runner keeps besides vLLM's state."""

    metrics: GsdMetrics = field(default_factory=GsdMetrics)
    tree_slot: TreeSlot = field(default_factory=TreeSlot)
    # The target forward's trees, from _prepare_inputs until its attention metadata is built.
    pending_attention: TreeAttention | None = None
    # Every target layer's live KV cache (one per distinct tensor), listed at KV-cache setup.
    target_kv_caches: list[torch.Tensor] = field(default_factory=list)
    # On the CPU: how the ISA vLLM picked for those caches packs a block (kernels/paged_layout.py).
    target_cache_packing: CpuPacking | None = None


def is_gsd_runner(runner) -> bool:
    return is_gsd(runner.speculative_config) and hasattr(runner, "drafter")
