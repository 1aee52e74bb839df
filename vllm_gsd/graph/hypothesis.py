"""The hypothesis graph as data: what the builder (builder.py) makes and unrolling (unroll.py) reads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class HypothesisGraph:
    """A snapshot of the graph (numpy arrays), for unrolling and for tests.

    Rows are graph node rows [B, N + 1]; row 0 is the root; rows past num_nodes[b] are padding
    (token -1, parent -1). Pseudo edges are flat arrays of length E.
    """

    token_ids: np.ndarray  # int64 [B, N+1]
    parent_row: np.ndarray  # int64 [B, N+1], primary parent; -1 for the root and padding
    depth: np.ndarray  # int64 [B, N+1], primary depth
    edge_prob: np.ndarray  # float64 [B, N+1], draft prob of the primary edge (root: 1)
    path_prob: np.ndarray  # float64 [B, N+1], product of edge_prob along the primary path
    child_rank: np.ndarray  # int64 [B, N+1], top-k column the node came from (root: -1)
    num_nodes: np.ndarray  # int64 [B], drafted nodes (root excluded)
    pseudo_request: np.ndarray  # int64 [E]
    pseudo_src: np.ndarray  # int64 [E], the parent P that proposed the token
    pseudo_dst: np.ndarray  # int64 [E], the existing node M it merged into
    pseudo_prob: np.ndarray  # float64 [E], draft prob of the token at P
    pseudo_rank: np.ndarray  # int64 [E], top-k column of the token at P
    num_merges: np.ndarray  # int64 [B]
    expansions_saved: np.ndarray  # int64 [B]
    # Every edge (primary and pseudo) by source: entry (b * (N+1) + row) * top_k + rank is the
    # edge the draft proposed at that rank from that node.
    out_node: np.ndarray  # int64 [B * (N+1) * top_k], flat destination node b * (N+1) + row, -1 = none
    out_prob: np.ndarray  # float64 [B * (N+1) * top_k], draft prob of the edge
    out_pseudo: np.ndarray  # bool [B * (N+1) * top_k], a pseudo edge
    has_children: np.ndarray  # bool [B * (N+1)], the node has an out-edge
