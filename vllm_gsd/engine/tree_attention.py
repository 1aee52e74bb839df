"""The graph mask of the forward pass now running, shared by every attention layer it calls.

vLLM's attention backends receive per-batch metadata built from `CommonAttentionMetadata`, which
knows nothing of trees. The forward that carries tree rows (the target's verification, or one of
the draft's expansion levels) is wrapped in `graph_mask(TreeMask(...))`; the attention backend
(engine/cpu_attention.py) reads `current_graph_mask()` and applies it to the requests that have
tree rows. Forwards run one at a time in a worker, so a process-wide slot is enough.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class TreeMask:
    """Graph-mask inputs of one forward, in the conventions of docs/contracts.md.

    Requests are indexed by their position in the forward's batch (the attention metadata's
    query_start_loc order). Only requests listed in `request_index` carry tree rows.
    """

    request_index: torch.Tensor  # int64 [Bt]: batch position of each request with tree rows
    tree_base: torch.Tensor  # int32 [Bt]: KV position of tree row 0
    ancestor_words: torch.Tensor  # int32 [Bt, R, W]
    query_tree_row: torch.Tensor  # int32 [T]: tree row of every query token of the forward, -1 = causal

    def full_batch(self, num_reqs: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """tree_base int32 [num_reqs] and ancestor_words int32 [num_reqs, R, W] for the whole
        batch (zeros for requests without tree rows; their rows are all causal)."""
        tree_base = torch.zeros(num_reqs, dtype=torch.int32)
        tree_base[self.request_index] = self.tree_base.cpu()
        words = torch.zeros((num_reqs, *self.ancestor_words.shape[1:]), dtype=torch.int32)
        words[self.request_index] = self.ancestor_words.cpu()
        return tree_base.to(device), words.to(device)


_current: TreeMask | None = None


def current_graph_mask() -> TreeMask | None:
    return _current


def set_graph_mask(mask: TreeMask | None) -> None:
    global _current
    _current = mask


@contextmanager
def graph_mask(mask: TreeMask | None) -> Iterator[None]:
    previous = _current
    set_graph_mask(mask)
    try:
        yield
    finally:
        set_graph_mask(previous)
