"""The trees of one forward, built once before it and read by everything that runs in it.

Two objects, by who reads them:

* `TreeAttention`: what the attention layers need to apply the graph mask (docs/contracts.md,
  "Graph-masked attention"): which requests of the forward carry tree rows, each tree's base KV
  position and ancestor bitmasks, and the tree row of every query token. Built on the forward's
  device in one copy. It reaches the layers through vLLM's attention metadata: the forward's
  builder (vllm_v0_32/attention/graph_backend.py) takes it from the runner's `TreeSlot` while it
  builds the metadata, so every layer reads it from the metadata it is handed.
* `TreeBatch`: the target's verification step: the `TreeAttention` plus, by batch row, what the
  scorer and the KV compaction need (parent rows, depths, how many nodes, base positions). It
  travels to the scorer inside the spec-decode metadata the runner already hands to the
  rejection sampler (in vLLM 0.32, `TreeSpecDecodeMetadata`: vllm_v0_32/spec_decode.py).

A forward without trees (plain decoding, vLLM's dummy, profile and warm-up runs) carries none:
its metadata's `tree` is None and every layer runs vLLM's own kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_gsd.engine.node_processing import RequestOptions
from vllm_gsd.graph import ancestor_words_from_parents


@dataclass(frozen=True)
class TreeAttention:
    """Graph-mask inputs of one forward. Requests are numbered by their position in the
    forward's batch (the attention metadata's query_start_loc order).

    request_index: int64 [Bt] (host): requests with tree rows, ascending (a tree that is a chain
        is not one: its graph mask is the causal mask, which vLLM's kernel applies);
    query_start, query_len: int64 [Bt] (host): each tree request's query tokens in the forward
        (all of them, rows before its tree included: those are causal);
    tree_base: int32 [Bt] (host): KV position of each tree's row 0;
    ancestor_words: int32 [Bt, R, W] (device): bit c of row r = row c is r or an ancestor of r;
    query_tree_row: int32 [T] (device): tree row of every query token, -1 = causal;
    covers_all_rows: every query token of the forward is a tree row (a draft level), so no
        row needs vLLM's causal kernel.
    """

    request_index: torch.Tensor
    query_start: torch.Tensor
    query_len: torch.Tensor
    tree_base: torch.Tensor
    ancestor_words: torch.Tensor
    query_tree_row: torch.Tensor
    covers_all_rows: bool

    @classmethod
    def build(cls, request_index: np.ndarray, query_start: np.ndarray, query_len: np.ndarray,
              tree_base: np.ndarray, ancestor_words: torch.Tensor, query_tree_row: np.ndarray,
              device: torch.device) -> TreeAttention:
        def host(values, dtype):
            return torch.from_numpy(np.ascontiguousarray(values, dtype=dtype))

        return cls(
            request_index=host(request_index, np.int64),
            query_start=host(query_start, np.int64),
            query_len=host(query_len, np.int64),
            tree_base=host(tree_base, np.int32),
            ancestor_words=_to_device(ancestor_words.to(torch.int32), device),
            query_tree_row=_to_device(host(query_tree_row, np.int32), device),
            covers_all_rows=bool((query_tree_row >= 0).all()),
        )


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if torch.device(device).type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class TreeBatch:
    """The trees the target verifies this step, by batch row (B = requests in the step).

    parent_row, depth: int64 [B, Nmax] (host), -1 / 0 past num_nodes[b]; a request without
        draft tokens has num_nodes 0; draft tokens that match no proposed tree are a chain;
    num_nodes: int64 [B]; tree_base: int64 [B], KV position of the root (row 0);
    via_merge: bool [B, Nmax], node copied from a merged graph node (metrics only);
    noise_key: per request the key of its sampling noise (engine/sampling.py), None if greedy;
    attention: the same trees as the attention layers see them;
    options: per request what vLLM's sampler applies to its rows besides temperature, top-k and
        top-p (engine/node_processing.py), None if nothing;
    draft_token_ids: int64 [B, Nmax] (host), -1 past num_nodes[b]: the draft tokens the
        scheduler sent (the ones vLLM's metadata carries on the device), so the scorer need not
        read them back; None: the scorer reads vLLM's.
    """

    parent_row: torch.Tensor
    depth: torch.Tensor
    num_nodes: torch.Tensor
    tree_base: np.ndarray
    via_merge: torch.Tensor
    noise_key: list[int | None]
    attention: TreeAttention
    options: list[RequestOptions | None] = field(default_factory=list)
    draft_token_ids: torch.Tensor | None = None

    def options_of(self, b: int) -> RequestOptions | None:
        return self.options[b] if b < len(self.options) else None


def chain_trees(num_draft_tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """parent_row, depth int64 [B, Nmax] of chains of the given lengths (-1 / 0 padded): how
    drafts that no proposed tree explains are verified (a chain is also a tree)."""
    width = max(num_draft_tokens, default=0)
    rows = torch.arange(width, dtype=torch.int64).expand(len(num_draft_tokens), width)
    real = rows < torch.tensor(num_draft_tokens, dtype=torch.int64).unsqueeze(1)
    return torch.where(real, rows, -1), torch.where(real, rows + 1, 0)


def is_chain(parent_row: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """bool [B]: each request's tree is a chain (node i's parent is row i: the root or node i - 1),
    so that its rows sit at consecutive positions and see exactly the rows before them."""
    rows = torch.arange(parent_row.shape[1], dtype=parent_row.dtype)
    return ((parent_row == rows) | (rows >= num_nodes.unsqueeze(1))).all(dim=1)


def build_tree_batch(parent_row: torch.Tensor, depth: torch.Tensor, num_nodes: torch.Tensor,
                     tree_base: np.ndarray, via_merge: torch.Tensor, noise_key: list[int | None],
                     query_start_loc: np.ndarray, device: torch.device,
                     options: list[RequestOptions | None] | None = None,
                     draft_token_ids: torch.Tensor | None = None) -> TreeBatch:
    """The step's TreeBatch from per-row trees (see TreeBatch) and the forward's
    query_start_loc (int [B + 1], host): a request's tree rows are its last n + 1 tokens."""
    num_nodes_np = num_nodes.numpy()
    request_index = np.flatnonzero((num_nodes_np > 0) & ~is_chain(parent_row, num_nodes).numpy())
    query_start = query_start_loc[request_index]
    query_len = query_start_loc[request_index + 1] - query_start
    query_tree_row = np.full(int(query_start_loc[-1]), -1, dtype=np.int32)
    for b in request_index.tolist():
        n, end = int(num_nodes_np[b]), int(query_start_loc[b + 1])
        query_tree_row[end - n - 1: end] = np.arange(n + 1)
    index = torch.from_numpy(request_index)
    words = ancestor_words_from_parents(parent_row[index], num_nodes[index])
    attention = TreeAttention.build(request_index, query_start, query_len, tree_base[request_index],
                                    words, query_tree_row, device)
    return TreeBatch(parent_row, depth, num_nodes, tree_base, via_merge, noise_key, attention, options or [],
                     draft_token_ids)


class TreeSlot:
    """Where the runner puts the trees of the forward whose attention metadata is being built.

    The graph-attention builders of the target's and the draft's layers hold the runner's slot
    and copy `current` into the metadata they build; it is set only around one forward's
    metadata build, so no other forward (dummy, profile, warm-up runs) can see it.
    """

    def __init__(self) -> None:
        self.current: TreeAttention | None = None

    @contextmanager
    def holding(self, tree: TreeAttention | None) -> Iterator[None]:
        previous, self.current = self.current, tree
        try:
            yield
        finally:
            self.current = previous
