"""vLLM 0.32's spec-decode metadata carrying the step's trees (engine/tree_batch.py) to the
scorer: the runner hands this object to the rejection sampler already, so the trees ride there
(vllm_v0_32/runner/step_hooks.py wraps it, vllm_v0_32/scorer.py reads it)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from vllm_gsd.engine.tree_batch import TreeBatch


@dataclass
class TreeSpecDecodeMetadata(SpecDecodeMetadata):
    """vLLM's SpecDecodeMetadata, carrying the step's trees to the scorer."""

    tree: TreeBatch | None = None

    @classmethod
    def wrap(cls, metadata: SpecDecodeMetadata, tree: TreeBatch) -> TreeSpecDecodeMetadata:
        return cls(
            draft_token_ids=metadata.draft_token_ids,
            num_draft_tokens=metadata.num_draft_tokens,
            cu_num_draft_tokens=metadata.cu_num_draft_tokens,
            cu_num_sampled_tokens=metadata.cu_num_sampled_tokens,
            target_logits_indices=metadata.target_logits_indices,
            bonus_logits_indices=metadata.bonus_logits_indices,
            logits_indices=metadata.logits_indices,
            tree=tree,
        )
