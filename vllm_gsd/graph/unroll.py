"""Unroll the hypothesis DAG into the flattened verification tree.

Each root-to-node path of the DAG is one tree node: a node reached through a pseudo edge is
copied, with its subtree, under the new parent, because a token's KV depends on its whole prefix.
Request b's tree keeps its node_budget[b] best tree nodes by path probability (product of draft
probabilities along the path; ties: shallower first, then creation order, i.e. the order of the
draft top-k ranks along the path), a set closed under ancestors because a child's path
probability never exceeds its parent's. It is flattened breadth-first (depth, then path
probability descending, then creation order), so every prefix of the rows is a valid tree.

The paths are generated from the graph's out-edge table (every primary and pseudo edge by
source and rank), breadth-first, so that generation order is creation order. This is one
compiled pass per request (numba, as vLLM's n-gram proposer does): the work per tree node is a
handful of loads and stores, which as numpy calls would cost a microsecond each, and a step
unrolls some 4000 nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from .ancestors import ancestor_words_from_parents
from .hypothesis import HypothesisGraph
from .ordering import keep_best, kth_largest, order_by_value_within_groups


@dataclass
class VerificationTree:
    """The flattened trees of a batch (contracts.md layout, CPU tensors).

    draft_token_ids int64 [B, N] (-1 padded), parent_row int64 [B, N] (-1 padded),
    depth int64 [B, N] (0 padded), num_nodes int64 [B], ancestor_words int32 [B, N + 1, W]
    (None when constructed: computed from parent_row on first read; the engine masks
    attention from the parent rows itself); path_prob float64 [B, N] (0 padded); via_merge bool
    [B, N] (the node is a pseudo child or inside a copied subtree); graph_row int64 [B, N] (the
    graph node it copies, -1 padded); child_rank int64 [B, N] (draft top-k column of the edge
    into the node, -1 padded); num_graph_nodes, num_merges, expansions_saved int64 [B] (graph
    statistics).
    """

    draft_token_ids: torch.Tensor
    parent_row: torch.Tensor
    depth: torch.Tensor
    num_nodes: torch.Tensor
    ancestor_words: torch.Tensor | None
    path_prob: torch.Tensor
    via_merge: torch.Tensor
    graph_row: torch.Tensor
    child_rank: torch.Tensor
    num_graph_nodes: torch.Tensor
    num_merges: torch.Tensor
    expansions_saved: torch.Tensor


def _read_ancestor_words(tree: VerificationTree) -> torch.Tensor:
    words = tree.__dict__["_ancestor_words"]
    if words is None:
        words = tree.__dict__["_ancestor_words"] = ancestor_words_from_parents(tree.parent_row, tree.num_nodes)
    return words


def _write_ancestor_words(tree: VerificationTree, words: torch.Tensor | None) -> None:
    tree.__dict__["_ancestor_words"] = words


# After the dataclass is made, so that __init__ and dataclasses.replace go through it.
VerificationTree.ancestor_words = property(_read_ancestor_words, _write_ancestor_words)


def request_budget(node_budget, batch: int, width: int) -> np.ndarray:
    """int64 [B] tree nodes to keep per request from None (= width), an int, or [B] values in
    0..width (a numpy array, a torch tensor or a sequence)."""
    if node_budget is None:
        return np.full(batch, width, dtype=np.int64)
    if isinstance(node_budget, torch.Tensor):
        node_budget = node_budget.detach().cpu().numpy()
    budget = np.asarray(node_budget)
    if budget.dtype.kind not in "iu" or budget.ndim > 1 or (budget.ndim == 1 and budget.shape[0] != batch):
        raise ValueError(f"node_budget must be an int or an integer array of shape [{batch}], got "
                         f"{budget.dtype} {budget.shape}")
    if budget.size and (budget.min() < 0 or budget.max() > width):
        raise ValueError(f"node_budget values must be in 0..{width}, got {budget.min()}..{budget.max()}")
    return np.broadcast_to(budget.astype(np.int64), (batch,))


def unroll_graph(graph: HypothesisGraph, node_budget=None) -> VerificationTree:
    """Unroll `graph` into each request's verification tree of its node_budget[b] best nodes.

    node_budget: None (= N, the graph's node budget), an int, or int64 [B]; values in 0..N.
    The tree tensors are [B, N] wide whatever the budget.
    """
    batch, num_rows = graph.token_ids.shape
    budget = np.ascontiguousarray(request_budget(node_budget, batch, num_rows - 1))
    rows = np.empty((5, batch, num_rows - 1), dtype=np.int64)  # token, parent row, depth, graph row, child rank
    path_prob = np.empty((batch, num_rows - 1), dtype=np.float64)
    via = np.empty((batch, num_rows - 1), dtype=bool)
    num_nodes = np.empty(batch, dtype=np.int64)
    _unroll_requests(graph.token_ids, graph.path_prob, graph.num_nodes, graph.has_children, graph.out_node,
                     graph.out_prob, graph.out_pseudo, budget, rows, path_prob, via, num_nodes)
    token, parent, depth, graph_row, rank = rows
    return VerificationTree(
        draft_token_ids=torch.from_numpy(token), parent_row=torch.from_numpy(parent), depth=torch.from_numpy(depth),
        num_nodes=torch.from_numpy(num_nodes), ancestor_words=None, path_prob=torch.from_numpy(path_prob),
        via_merge=torch.from_numpy(via), graph_row=torch.from_numpy(graph_row), child_rank=torch.from_numpy(rank),
        num_graph_nodes=torch.from_numpy(graph.num_nodes.copy()),
        num_merges=torch.from_numpy(graph.num_merges.copy()),
        expansions_saved=torch.from_numpy(graph.expansions_saved.copy()),
    )


@njit(cache=True, nogil=True, error_model="numpy")
def _unroll_requests(token_ids, path_prob, num_nodes, has_children, out_node, out_prob, out_pseudo, budget,
                     tree_rows, tree_path_prob, tree_via, tree_num_nodes):
    """The trees of unroll_graph, one request at a time, written into tree_rows [5, B, N]
    (token, parent row, depth, graph row, child rank), tree_path_prob, tree_via [B, N] and
    tree_num_nodes [B], padding included; returns how often a bound was raised by the best
    paths so far (a count, for tests).

    The bound starts as the budget-th best graph node (each graph node is a path, along its
    primary edges; _generate_paths prunes below it). Rows are ordered by (depth, path prob
    descending, index); when there are more paths than the budget, the budget's best (path prob
    descending, then index) are taken first.
    """
    batch, num_rows = token_ids.shape
    width = num_rows - 1
    num_ranks = out_node.size // (batch * num_rows)
    tree_token, tree_parent, tree_depth, tree_graph_row, tree_rank = tree_rows
    tree_token[:], tree_parent[:], tree_depth[:], tree_graph_row[:], tree_rank[:] = -1, -1, 0, -1, -1
    tree_path_prob[:], tree_via[:], tree_num_nodes[:] = 0.0, False, 0
    raised = 0
    capacity = 4 * num_rows
    paths = np.empty((6, capacity), np.int64)  # graph row, parent path, depth, rank, via, tree row
    paths_pp = np.empty(capacity, np.float64)
    for b in range(batch):
        keep = budget[b]
        drafted = num_nodes[b]
        if keep == 0:
            continue
        if keep < drafted:
            bound = kth_largest(path_prob[b, 1:drafted + 1].copy(), keep)
        elif keep == drafted:  # (the usual case: the least likely node, without a selection)
            bound = path_prob[b, 1:drafted + 1].min()
        else:
            bound = -np.inf
        while True:
            count, raised_here = _generate_paths(has_children, out_node, out_prob, out_pseudo, b * num_rows,
                                                 num_ranks, bound, keep, 2 * width + 1, paths, paths_pp)
            if count >= 0:
                break
            capacity *= 2  # and again from the root: growing inside the walk would slow every step of it
            paths = np.empty((6, capacity), np.int64)
            paths_pp = np.empty(capacity, np.float64)
        raised += raised_here
        row, parent, depth, rank, via, tree_row = paths
        rows = np.arange(1, count)  # generated breadth-first: by depth, then creation order
        if count - 1 > keep:  # the best first (ties: created first), in creation order again
            rows = keep_best(rows, paths_pp, keep)
        rows = order_by_value_within_groups(rows, depth, paths_pp)
        kept = rows.size
        if kept == 0:
            continue
        tree_row[0] = 0
        for column in range(kept):
            tree_row[rows[column]] = column + 1
        for column in range(kept):
            path = rows[column]
            tree_token[b, column] = token_ids[b, row[path]]
            tree_parent[b, column] = tree_row[parent[path]]
            tree_depth[b, column] = depth[path]
            tree_path_prob[b, column] = paths_pp[path]
            tree_via[b, column] = via[path] != 0
            tree_graph_row[b, column] = row[path]
            tree_rank[b, column] = rank[path]
        tree_num_nodes[b] = kept
    return raised


@njit(cache=True, nogil=True, error_model="numpy")
def _generate_paths(has_children, out_node, out_prob, out_pseudo, node_base, num_ranks, bound, keep, first_check,
                    paths, paths_pp):
    """Every root-to-node path of one request as likely as `bound`, breadth-first from the root
    through the out-edge table (parents in generation order, each one's edges by rank), so a
    path's index is its creation order. Written into paths [6, capacity] (graph row, parent
    path, depth, rank, via merge) and paths_pp [capacity]; returns (count, bound raises), or
    count -1 when the arrays are full.

    A path less likely than the bound is dropped with its subtree (its descendants are no more
    likely). Whenever the count doubles past first_check, the bound rises to the keep-th best
    path so far: many copies (many merges into large subtrees) stay cheap, and the top-keep
    paths are still all generated.
    """
    row, parent, depth, rank, via = paths[0], paths[1], paths[2], paths[3], paths[4]
    capacity = paths_pp.size
    row[0], parent[0], depth[0], rank[0], via[0], paths_pp[0] = 0, -1, 0, -1, 0, 1.0
    count, next_check, raised = 1, first_check, 0
    i = 0
    while i < count:
        parent_pp = paths_pp[i]
        if parent_pp >= bound and has_children[node_base + row[i]]:  # (else a leaf, or below a raised bound)
            edge = (node_base + row[i]) * num_ranks
            for j in range(num_ranks):
                child = out_node[edge + j]
                if child < 0:
                    continue
                child_pp = parent_pp * out_prob[edge + j]
                if child_pp < bound:
                    continue
                if count == capacity:
                    return -1, raised
                row[count] = child - node_base
                parent[count] = i
                depth[count] = depth[i] + 1
                rank[count] = j
                via[count] = 1 if via[i] != 0 or out_pseudo[edge + j] else 0
                paths_pp[count] = child_pp
                count += 1
            if count > next_check:
                best_so_far = kth_largest(paths_pp[1:count].copy(), keep)
                if best_so_far > bound:
                    bound = best_so_far
                    raised += 1
                next_check = 2 * count
        i += 1
    return count, raised

