"""The one design of GSD's attention backends: vLLM's backend, plus the graph mask for tree rows.

A platform backend (cpu_backend.py over CPU_ATTN, triton_backend.py over TRITON_ATTN) is vLLM's
own backend with two mixins in front:

* `GraphMetadataBuilder`: builds vLLM's metadata, then, when the runner's `TreeSlot` holds the
  trees of the forward being prepared (engine/tree_batch.py), adds the platform's plan for them
  (`plan_tree`: which rows, which KV, the mask, on the forward's device). Built once per forward;
  every layer of the group reads the same plan. Without trees the plan is None.
* `GraphAttentionImpl`: at construction, refuses the model features the graph mask does not
  implement (`graph_mask_blockers`, per platform); per forward, a layer without a plan is
  exactly vLLM's; with one, vLLM's kernel runs for the rows `vllm_rows` names and `attend_tree`
  writes the tree requests' rows: on the CPU vLLM's kernel runs for every row and the tree rows
  are overwritten, unless the plan covers every row (`covers_all_rows`: the draft's levels);
  on CUDA the graph kernel attends the leading decode-shaped requests, trees among them, and
  vLLM's kernel only the prefill chunks after them (triton_backend.py).

So a batch without trees is numerically vLLM's, and each platform writes only `plan_tree` and
`attend_tree`; a layer does no planning, only `attend_tree`'s launches. Encoder and cross
attention never carry trees.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import AttentionType

from vllm_gsd.engine.tree_batch import TreeAttention, TreeSlot


@dataclass
class GraphMetadataFields:
    """The field every GSD metadata class adds to its vLLM class: the plan of this forward's
    trees (platform-specific), or None."""

    tree: Any = None


class GraphMetadataBuilder:
    """Mixed in before a vLLM metadata builder (see module docstring).

    metadata_cls: the platform's metadata dataclass (vLLM's, plus GraphMetadataFields).
    tree_slot: the runner's slot, given by the runner hook once the builders exist; a builder
    without one (never handed a slot) builds plain metadata.
    """

    metadata_cls: ClassVar[type]
    tree_slot: TreeSlot | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # vLLM orders each batch decode-shaped requests first, every tree among them, prefill
        # chunks after (its own reorder, as for FlashInfer): on CUDA the graph kernel then takes
        # a leading run of rows (triton_backend.py); on the CPU, whose kernel is order-agnostic,
        # the engine serves the batch order the CUDA path sees.
        self.reorder_batch_threshold = self.decode_query_len

    @property
    def decode_query_len(self) -> int:
        """Longest query vLLM counts as a decode (1 + num_speculative_tokens; 1 without spec)."""
        spec = getattr(self.vllm_config, "speculative_config", None)
        return 1 + (getattr(spec, "num_speculative_tokens", None) or 0)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        tree = self.tree_slot.current if self.tree_slot is not None else None
        values = {f.name: getattr(metadata, f.name) for f in fields(metadata)}
        return self.metadata_cls(**values, tree=None if tree is None else
                                 self.plan_tree(metadata, tree, common_attn_metadata))

    def plan_tree(self, metadata, tree: TreeAttention, common):
        """The platform's plan of `tree` on the forward of vLLM's `metadata` (built from
        `common`, vLLM's CommonAttentionMetadata, whose host copies it may read)."""
        raise NotImplementedError


class GraphAttentionImpl:
    """Mixed in before a vLLM attention impl (see module docstring)."""

    platform: ClassVar[str]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.attn_type == AttentionType.DECODER:
            blockers = self.graph_mask_blockers()
            if blockers:
                raise NotImplementedError(
                    f"speculative method 'gsd' does not support models with {', '.join(blockers)} "
                    f"on {self.platform}: the graph mask of tree rows does not implement them"
                )

    def graph_mask_blockers(self) -> list[str]:
        """Names of this layer's features that the graph mask does not implement."""
        raise NotImplementedError

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        plan = None if attn_metadata is None or self.attn_type != AttentionType.DECODER else attn_metadata.tree
        if plan is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("speculative method 'gsd': fused output quantization is not supported")
        rest = self.vllm_rows(plan, attn_metadata)
        if rest is not None:
            first, rest_metadata = rest
            # Views of the rest's rows (key and value: None in a layer that shares another's KV).
            rows = [t if t is None or not first else t[first:] for t in (query, key, value, output)]
            super().forward(layer, *rows[:3], kv_cache, rest_metadata, rows[3])
        self.attend_tree(query, kv_cache, attn_metadata, plan, output)
        return output

    def vllm_rows(self, plan, metadata) -> tuple[int, object] | None:
        """(first row, metadata) of the rows vLLM's kernel attends on this forward, or None:
        by default all of them (`attend_tree` then overwrites the tree rows), unless the plan
        covers every row."""
        return None if plan.covers_all_rows else (0, metadata)

    def attend_tree(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata, plan,
                    output: torch.Tensor) -> None:
        """Write `output` at the tree requests' rows with graph-masked attention (and at the
        other rows the plan gives the graph kernel, causal)."""
        raise NotImplementedError


def install_tree_slot(attn_groups, slot: TreeSlot) -> int:
    """Hand `slot` to every graph-attention builder of `attn_groups` (runner or draft groups,
    nested lists allowed); returns how many builders got it."""
    count = 0
    for group in attn_groups:
        if isinstance(group, list):
            count += install_tree_slot(group, slot)
            continue
        for builder in group.metadata_builders:
            if isinstance(builder, GraphMetadataBuilder):
                builder.tree_slot = slot
                count += 1
    return count
