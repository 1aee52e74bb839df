"""Unroll the hypothesis DAG into the flattened verification tree.

Each root-to-node path of the DAG is one tree node: a node reached through a pseudo edge is
copied, with its subtree, under the new parent, because a token's KV depends on its whole prefix.
The tree keeps the N best tree nodes by path probability (product of draft probabilities along
the path; ties: shallower first, then creation order), a set closed under ancestors because a
child's path probability never exceeds its parent's. It is flattened breadth-first (depth, then
path probability descending, then creation order), so every prefix of the rows is a valid tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .ancestors import own_bit_words_numpy
from .builder import HypothesisGraph


@dataclass
class VerificationTree:
    """The flattened trees of a batch (contracts.md layout, CPU tensors).

    draft_token_ids int64 [B, N] (-1 padded), parent_row int64 [B, N] (-1 padded),
    depth int64 [B, N] (0 padded), num_nodes int64 [B], ancestor_words int32 [B, N + 1, W];
    path_prob float64 [B, N] (0 padded); via_merge bool [B, N] (the node is a pseudo child or
    inside a copied subtree); graph_row int64 [B, N] (the graph node it copies, -1 padded);
    child_rank int64 [B, N] (draft top-k column of the edge into the node, -1 padded);
    num_graph_nodes, num_merges, expansions_saved int64 [B] (graph statistics).
    """

    draft_token_ids: torch.Tensor
    parent_row: torch.Tensor
    depth: torch.Tensor
    num_nodes: torch.Tensor
    ancestor_words: torch.Tensor
    path_prob: torch.Tensor
    via_merge: torch.Tensor
    graph_row: torch.Tensor
    child_rank: torch.Tensor
    num_graph_nodes: torch.Tensor
    num_merges: torch.Tensor
    expansions_saved: torch.Tensor


def _sorted_edges(graph: HypothesisGraph):
    """All DAG edges sorted by (request, source row, rank), with CSR offsets per (request, row)."""
    batch, num_rows = graph.token_ids.shape
    rows = np.arange(num_rows)
    is_node = (rows[None, :] >= 1) & (rows[None, :] <= graph.num_nodes[:, None])
    prim_request, prim_dst = np.nonzero(is_node)
    edge_request = np.concatenate([prim_request, graph.pseudo_request])
    edge_src = np.concatenate([graph.parent_row[prim_request, prim_dst], graph.pseudo_src])
    edge_dst = np.concatenate([prim_dst, graph.pseudo_dst])
    edge_prob = np.concatenate([graph.edge_prob[prim_request, prim_dst], graph.pseudo_prob])
    edge_rank = np.concatenate([graph.child_rank[prim_request, prim_dst], graph.pseudo_rank])
    edge_pseudo = np.concatenate([np.zeros(prim_dst.size, bool), np.ones(graph.pseudo_src.size, bool)])
    rank_span = int(edge_rank.max(initial=0)) + 1
    order = np.argsort((edge_request * num_rows + edge_src) * rank_span + edge_rank, kind="stable")
    source_key = edge_request[order] * num_rows + edge_src[order]
    out_degree = np.bincount(source_key, minlength=batch * num_rows)
    out_start = np.cumsum(out_degree) - out_degree
    return (edge_dst[order], edge_prob[order], edge_rank[order], edge_pseudo[order], out_degree, out_start)


def _within_request_index(request: np.ndarray) -> np.ndarray:
    """Index of each item among the items of its request; `request` must be non-decreasing."""
    return np.arange(request.size) - np.searchsorted(request, request, side="left")


def _ancestor_words_by_depth(parent_row: np.ndarray, depth: np.ndarray, num_nodes: np.ndarray) -> np.ndarray:
    """int32 [B, N + 1, W] ancestor words of breadth-first trees (numpy twin of
    ancestors.ancestor_words_from_parents, one pass per depth: parents are final before children)."""
    batch, budget = parent_row.shape
    words = np.broadcast_to(own_bit_words_numpy(budget + 1), (batch, budget + 1, (budget + 32) // 32)).copy()
    flat = words.reshape(batch * (budget + 1), -1)
    request, node = np.nonzero(np.arange(budget)[None, :] < num_nodes[:, None])
    row = request * (budget + 1) + node + 1
    parent = request * (budget + 1) + parent_row[request, node]
    node_depth = depth[request, node]
    for level in range(1, int(node_depth.max(initial=0)) + 1):
        at_level = node_depth == level
        flat[row[at_level]] |= flat[parent[at_level]]
    return words


def unroll_graph(graph: HypothesisGraph, node_budget: int) -> VerificationTree:
    """Unroll `graph` into the top-`node_budget` verification tree of each request.

    Tree nodes are generated level by level from the root through all out-edges (primary and
    pseudo). A candidate whose path probability is below the N-th best generated so far in its
    request (this level included) is dropped with its subtree: it cannot be in the top N, and
    its descendants are no more likely. So the final top-N is exact.
    """
    batch, num_rows = graph.token_ids.shape
    budget = node_budget
    edge_dst, edge_prob, edge_rank, edge_pseudo, out_degree, out_start = _sorted_edges(graph)

    # Generated tree nodes, indexed by a global id (creation order: by depth, then request,
    # then parent, then edge rank); roots are ids 0..B-1 and are not stored.
    ids_request, ids_graph, ids_parent, ids_pp, ids_depth, ids_via, ids_rank = [], [], [], [], [], [], []
    best_pp = np.full((batch, budget), -np.inf)  # per request, the N best path probs (unordered)
    front_id = np.arange(batch)
    front_request, front_graph = np.arange(batch), np.zeros(batch, np.int64)
    front_pp, front_via = np.ones(batch), np.zeros(batch, bool)
    next_id, depth = batch, 0
    while front_id.size:
        depth += 1
        source_key = front_request * num_rows + front_graph
        degree = out_degree[source_key]
        total = int(degree.sum())
        if total == 0:
            break
        from_front = np.repeat(np.arange(front_id.size), degree)
        edge = np.repeat(out_start[source_key] - (np.cumsum(degree) - degree), degree) + np.arange(total)
        cand_request = front_request[from_front]  # non-decreasing: the frontier is by request
        cand_pp = front_pp[from_front] * edge_prob[edge]
        index = _within_request_index(cand_request)
        level_pp = np.full((batch, int(index.max()) + 1), -np.inf)
        level_pp[cand_request, index] = cand_pp
        pool = np.concatenate([best_pp, level_pp], axis=1)
        best_pp = np.partition(pool, pool.shape[1] - budget, axis=1)[:, pool.shape[1] - budget:]
        keep = cand_pp >= best_pp.min(axis=1)[cand_request]
        if not keep.any():
            break
        kept_from, kept_edge, kept_pp = from_front[keep], edge[keep], cand_pp[keep]
        kept_request = cand_request[keep]
        kept_id = next_id + np.arange(kept_pp.size)
        next_id += kept_pp.size
        kept_via = front_via[kept_from] | edge_pseudo[kept_edge]
        ids_request.append(kept_request)
        ids_graph.append(edge_dst[kept_edge])
        ids_parent.append(front_id[kept_from])
        ids_pp.append(kept_pp)
        ids_depth.append(np.full(kept_pp.size, depth, np.int64))
        ids_via.append(kept_via)
        ids_rank.append(edge_rank[kept_edge])
        front_id, front_request, front_graph = kept_id, kept_request, edge_dst[kept_edge]
        front_pp, front_via = kept_pp, kept_via

    if ids_request:
        node_request, node_graph, node_parent, node_pp, node_depth, node_via, node_rank = (
            np.concatenate(column) for column in
            (ids_request, ids_graph, ids_parent, ids_pp, ids_depth, ids_via, ids_rank))
    else:
        node_request = node_graph = node_parent = node_depth = node_rank = np.zeros(0, np.int64)
        node_pp, node_via = np.zeros(0), np.zeros(0, bool)
    node_id = np.arange(batch, batch + node_request.size)

    # Final top-N per request: everything above the N-th best path prob, then the ties in id
    # order (= shallower first, then creation order).
    threshold = best_pp.min(axis=1)[node_request]
    chosen = node_pp > threshold
    tied = np.flatnonzero(node_pp == threshold)
    if tied.size:
        room = budget - np.bincount(node_request[chosen], minlength=batch)
        tied = tied[np.argsort(node_request[tied], kind="stable")]
        take = _within_request_index(node_request[tied]) < room[node_request[tied]]
        chosen[tied[take]] = True
    chosen = np.flatnonzero(chosen)
    # Breadth-first flattening: by request, depth, path prob descending, id.
    order = np.argsort(-node_pp[chosen], kind="stable")
    order = order[np.argsort(node_request[chosen][order] * (int(node_depth.max(initial=0)) + 1)
                             + node_depth[chosen][order], kind="stable")]
    order = chosen[order]
    request = node_request[order]
    position = _within_request_index(request)
    row_of_id = np.full(batch + node_request.size, -1, np.int64)
    row_of_id[:batch] = 0
    row_of_id[node_id[order]] = position + 1
    parent = row_of_id[node_parent[order]]
    assert (parent >= 0).all(), "top-N selection must be closed under ancestors"
    num_nodes = np.bincount(request, minlength=batch).astype(np.int64)
    draft_token_ids = np.full((batch, budget), -1, np.int64)
    parent_row = np.full((batch, budget), -1, np.int64)
    depth_out = np.zeros((batch, budget), np.int64)
    path_prob = np.zeros((batch, budget), np.float64)
    via_merge = np.zeros((batch, budget), bool)
    graph_row = np.full((batch, budget), -1, np.int64)
    child_rank = np.full((batch, budget), -1, np.int64)
    graph_of_node = node_graph[order]
    draft_token_ids[request, position] = graph.token_ids[request, graph_of_node]
    parent_row[request, position] = parent
    depth_out[request, position] = node_depth[order]
    path_prob[request, position] = node_pp[order]
    via_merge[request, position] = node_via[order]
    graph_row[request, position] = graph_of_node
    child_rank[request, position] = node_rank[order]

    return VerificationTree(
        draft_token_ids=torch.from_numpy(draft_token_ids),
        parent_row=torch.from_numpy(parent_row),
        depth=torch.from_numpy(depth_out),
        num_nodes=torch.from_numpy(num_nodes),
        ancestor_words=torch.from_numpy(_ancestor_words_by_depth(parent_row, depth_out, num_nodes)),
        path_prob=torch.from_numpy(path_prob),
        via_merge=torch.from_numpy(via_merge),
        graph_row=torch.from_numpy(graph_row),
        child_rank=torch.from_numpy(child_rank),
        num_graph_nodes=torch.from_numpy(graph.num_nodes.copy()),
        num_merges=torch.from_numpy(graph.num_merges.copy()),
        expansions_saved=torch.from_numpy(graph.expansions_saved.copy()),
    )
