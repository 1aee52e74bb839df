"""Knobs of the hypothesis graph (plain dataclass; the engine validates user input with pydantic)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GraphParams:
    """How one step's hypothesis graph is drafted and cut down to a verification tree.

    node_budget: N, the most draft nodes the target verifies per request per step; the graph
        itself also holds at most N drafted nodes per request (plus the root).
    top_k: children proposed per expanded node (the draft's top-k), >= 1.
    max_depth: draft steps (levels expanded), >= 1.
    merge_ngram: r of the merge rule. -1 disables merging; 0 merges a child into any existing
        node with the same token; r >= 1 also requires the r tokens before that node (along its
        primary path, continuing into the history) to equal the r tokens ending at the parent.
    min_child_ratio: s; a child j is kept only if p_j >= s * p_top1 of the same parent.
    leaf_prob: a node whose draft probability (conditional on its parent) is below this is
        verified but never expanded.
    """

    node_budget: int
    top_k: int
    max_depth: int
    merge_ngram: int
    # 0 = no pruning. The users' defaults live in one place: engine/config.py's GsdConfig.
    min_child_ratio: float = 0.0
    leaf_prob: float = 0.0

    def __post_init__(self) -> None:
        checks = (
            (self.node_budget >= 1, f"node_budget must be >= 1, got {self.node_budget}"),
            (self.top_k >= 1, f"top_k must be >= 1, got {self.top_k}"),
            (self.max_depth >= 1, f"max_depth must be >= 1, got {self.max_depth}"),
            (self.merge_ngram >= -1, f"merge_ngram must be >= -1, got {self.merge_ngram}"),
            (0.0 <= self.min_child_ratio <= 1.0,
             f"min_child_ratio must be in [0, 1], got {self.min_child_ratio}"),
            (0.0 <= self.leaf_prob <= 1.0, f"leaf_prob must be in [0, 1], got {self.leaf_prob}"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def merging(self) -> bool:
        """Whether the merge rule is on."""
        return self.merge_ngram >= 0

    @property
    def num_words(self) -> int:
        """W = cdiv(N + 1, 32): int32 words of an ancestor bitmask row."""
        return (self.node_budget + 1 + 31) // 32
