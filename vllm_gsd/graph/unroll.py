"""Unroll the hypothesis DAG into the flattened verification tree.

Each root-to-node path of the DAG is one tree node: a node reached through a pseudo edge is
copied, with its subtree, under the new parent, because a token's KV depends on its whole prefix.
Request b's tree keeps its node_budget[b] best tree nodes by path probability (product of draft
probabilities along the path; ties: shallower first, then creation order, i.e. the order of the
draft top-k ranks along the path), a set closed under ancestors because a child's path
probability never exceeds its parent's. It is flattened breadth-first (depth, then path
probability descending, then creation order), so every prefix of the rows is a valid tree.

Tree nodes are the graph's own nodes (each along its primary path) plus the copies: a path
through a pseudo edge P -> M leaves the primary tree at P, so the copies are grown from the
pseudo edges, depth by depth through every out-edge, vectorized over every request. Copies are
few; the graph's nodes need no growing at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch

from .ancestors import ancestor_words_from_parents
from .builder import HypothesisGraph
from .ordering import order_by_group_then_value_desc, position_in_group, stable_order_small


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


class _Nodes(NamedTuple):
    """Generated tree nodes, one entry per node (flat arrays)."""

    request: np.ndarray  # int64
    node: np.ndarray  # int64, flat graph node (request * (N+1) + row) the tree node copies
    path_prob: np.ndarray  # float64 (roots: +inf, so that they lead every ordering)
    parent_id: np.ndarray  # int64, index of the parent tree node (roots: -1)
    via: np.ndarray  # bool, the path uses a pseudo edge
    rank: np.ndarray  # int64, top-k column of the edge into the node (roots: -1)
    depth: np.ndarray  # int64


def _roots(batch: int, num_rows: int) -> _Nodes:
    roots = np.arange(batch)
    return _Nodes(roots, roots * num_rows, np.full(batch, np.inf), np.full(batch, -1), np.zeros(batch, bool),
                  np.full(batch, -1), np.zeros(batch, np.int64))


def _concatenate(blocks: list[_Nodes]) -> _Nodes:
    return _Nodes(*(np.concatenate(column) for column in zip(*blocks)))


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

    A candidate less likely than a bound on request b's n-th best tree node (n =
    node_budget[b]) is dropped with its subtree: it cannot be in the top n, and its descendants
    are no more likely. The bound is the n-th best graph node (_primary_bound) and, once more
    than 2N nodes per request were generated (many copies), also the N-th best generated so
    far; either way the final top-n selection is exact.
    """
    batch, num_rows = graph.token_ids.shape
    budget = request_budget(node_budget, batch, num_rows - 1)
    bound = _primary_bound(graph, budget)
    nodes, ordered_below = _graph_nodes_then_copies(graph, bound)
    tree = _flatten(graph, nodes, budget, ordered_below)
    if tree is None:  # a path-probability tie involves a copy: only creation order breaks it
        tree = _flatten(graph, _in_creation_order(graph, bound), budget, None)
    return tree


def _primary_bound(graph: HypothesisGraph, budget: np.ndarray) -> np.ndarray:
    """float64 [B]: a path prob every tree node of request b's top budget[b] reaches. The graph's
    own nodes are tree nodes (their primary paths), so if it has at least budget[b] of them, the
    budget[b]-th best of them is such a bound; else -inf (and +inf when the budget is 0)."""
    batch = graph.path_prob.shape[0]
    if (budget >= graph.num_nodes).all():  # the bound is the least likely node of a graph this big
        least = np.where(graph.parent_row >= 0, graph.path_prob, np.inf).min(axis=1)
        bound = np.where(budget == graph.num_nodes, least, -np.inf)
    else:
        drafted = np.where(graph.parent_row >= 0, graph.path_prob, -np.inf)
        bound = -np.sort(-drafted, axis=1)[np.arange(batch), np.maximum(budget - 1, 0)]
    return np.where(budget == 0, np.inf, bound)


def _graph_nodes_then_copies(graph: HypothesisGraph, bound: np.ndarray) -> tuple[_Nodes, int]:
    """The roots, every graph node (along its primary path), then the copies; and the number of
    nodes before the copies, whose order within a request is creation order. A copy's path
    leaves the primary tree through a pseudo edge P -> M, which hangs M under P's own tree
    node; those seeds grow through every out-edge."""
    batch, num_rows = graph.token_ids.shape
    if (graph.num_nodes == num_rows - 1).all():
        # Every row is a node: ids are the flat graph nodes themselves (root first in each request).
        blocks, id_of_node = [_every_row(graph)], None
    else:
        node = (graph.parent_row >= 0).reshape(-1).nonzero()[0]  # by request, then row = creation order
        request = node // num_rows
        id_of_node = np.empty(batch * num_rows, dtype=np.int64)
        id_of_node[np.arange(batch) * num_rows] = np.arange(batch)
        id_of_node[node] = batch + np.arange(node.size)
        primary = _Nodes(request, node, graph.path_prob.reshape(-1)[node],
                         id_of_node[request * num_rows + graph.parent_row.reshape(-1)[node]],
                         np.zeros(node.size, bool), graph.child_rank.reshape(-1)[node], graph.depth.reshape(-1)[node])
        blocks = [_roots(batch, num_rows), primary]
    ordered_below = sum(block.node.size for block in blocks)
    src = graph.pseudo_request * num_rows + graph.pseudo_src
    seed_pp = graph.path_prob.reshape(-1)[src] * graph.pseudo_prob
    seed = (seed_pp >= bound[graph.pseudo_request]).nonzero()[0]
    if seed.size:
        src = src[seed]
        blocks.append(_Nodes(graph.pseudo_request[seed], graph.pseudo_request[seed] * num_rows + graph.pseudo_dst[seed],
                             seed_pp[seed], src if id_of_node is None else id_of_node[src], np.ones(seed.size, bool),
                             graph.pseudo_rank[seed],
                             graph.depth.reshape(-1)[src] + 1))
        _grow(blocks, graph, bound, ordered_below + np.arange(seed.size), blocks[-1])
    return _concatenate(blocks), ordered_below


def _every_row(graph: HypothesisGraph) -> _Nodes:
    """The tree nodes of a graph whose rows are all nodes (num_nodes = N everywhere), id = flat
    node b * (N+1) + row: the graph's own arrays, no gathers."""
    batch, num_rows = graph.token_ids.shape
    request, node, not_via = _every_row_ids(batch, num_rows)
    path_prob = graph.path_prob.reshape(-1).copy()
    path_prob[::num_rows] = np.inf  # roots lead every ordering
    parent_id = graph.parent_row + node.reshape(batch, num_rows)[:, :1]  # the root's -1 is overwritten
    parent_id[:, 0] = -1
    return _Nodes(request, node, path_prob, parent_id.reshape(-1), not_via, graph.child_rank.reshape(-1),
                  graph.depth.reshape(-1))


@lru_cache(maxsize=64)
def _every_row_ids(batch: int, num_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(request, flat node, False) of every row b * num_rows + r, cached read-only."""
    node = np.arange(batch * num_rows)
    arrays = (node // num_rows, node, np.zeros(node.size, bool))
    for array in arrays:
        array.flags.writeable = False
    return arrays


def _in_creation_order(graph: HypothesisGraph, bound: np.ndarray) -> _Nodes:
    """The same tree nodes (but for graph nodes the bound prunes), generated depth by depth from
    the roots so that ids follow creation order (depth, request, parent, edge rank)."""
    batch, num_rows = graph.token_ids.shape
    blocks = [_roots(batch, num_rows)]
    _grow(blocks, graph, bound, np.arange(batch), blocks[0]._replace(path_prob=np.ones(batch)))
    return _concatenate(blocks)


def _grow(blocks: list[_Nodes], graph: HypothesisGraph, bound: np.ndarray, front_id: np.ndarray,
          front: _Nodes) -> None:
    """Append to `blocks` every descendant of the `front` tree nodes (ids front_id) through the
    graph's out-edge table, one edge deeper per round, in creation order. A child less likely
    than its request's bound is dropped with its subtree, and past 2N nodes per request also one
    below the N-th best so far."""
    batch = bound.size
    width = graph.has_children.size // batch - 1
    blow_up = batch * (2 * width + 1)
    num_ranks = graph.out_node.size // graph.has_children.size
    next_id = sum(block.node.size for block in blocks)
    while front.node.size:
        # Every out-edge slot of the front (most fronts are mostly leaves: cheaper than a filter).
        slots = ((front.node * num_ranks)[:, None] + np.arange(num_ranks)).reshape(-1)
        child = (graph.out_node[slots] >= 0).nonzero()[0]
        if child.size == 0:
            break
        slot, from_front = slots[child], child // num_ranks
        request = front.request[from_front]
        path_prob = front.path_prob[from_front] * graph.out_prob[slot]
        keep = path_prob >= bound[request]
        if next_id + child.size > blow_up:
            keep &= path_prob >= _nth_best_so_far(blocks, request, path_prob, batch, width)[request]
        if not keep.all():
            keep = keep.nonzero()[0]
            child, slot, from_front, request, path_prob = child[keep], slot[keep], from_front[keep], request[keep], \
                path_prob[keep]
        front = _Nodes(request, graph.out_node[slot], path_prob, front_id[from_front],
                       front.via[from_front] | graph.out_pseudo[slot], child - from_front * num_ranks,
                       front.depth[from_front] + 1)
        blocks.append(front)
        front_id = next_id + np.arange(child.size)
        next_id += child.size


def _nth_best_so_far(blocks, request, path_prob, batch: int, width: int) -> np.ndarray:
    """float64 [B]: the width-th best path prob among the nodes generated so far (roots excluded)
    and these candidates, per request (-inf where fewer)."""
    all_request = np.concatenate([block[0] for block in blocks[1:]] + [request])
    all_pp = np.concatenate([block[2] for block in blocks[1:]] + [path_prob])
    order = stable_order_small(all_request)
    column = position_in_group(all_request[order], batch)
    dense = np.full((batch, int(column.max()) + 1 if column.size else 1), -np.inf)
    dense[all_request[order], column] = all_pp[order]
    if dense.shape[1] < width:
        return np.full(batch, -np.inf)
    return np.partition(dense, dense.shape[1] - width, axis=1)[:, dense.shape[1] - width]


def _flatten(graph: HypothesisGraph, nodes: _Nodes, budget: np.ndarray,
             ordered_below: int | None) -> VerificationTree | None:
    """Keep each request's root and budget[b] best generated nodes (path prob descending, then
    id: shallower first, then creation order) and lay them out breadth-first (depth, then path
    prob descending, then id). None when a tie would have to be broken by ids from
    `ordered_below` on (not in creation order). When no request has more nodes than it keeps,
    one sort by (request, depth, path prob descending, id) does both."""
    batch, num_rows = graph.token_ids.shape
    width = num_rows - 1
    request = nodes.request
    count = np.bincount(request, minlength=batch)  # generated nodes per request, root included
    max_depth = int(nodes.depth.max())
    if (count <= budget + 1).all():  # every node is kept: sort breadth-first at once
        order = order_by_group_then_value_desc(request * (max_depth + 1) + nodes.depth, nodes.path_prob,
                                               ordered_below)
        if order is None:
            return None
    else:
        # Best first within each request (the root, path prob +inf, leads); keep positions
        # start[b] .. start[b] + budget[b] of request b.
        order = order_by_group_then_value_desc(request, nodes.path_prob, ordered_below)
        if order is None:
            return None
        order_request = request[order]
        keep = (np.arange(order.size) <= (count.cumsum() - count + budget)[order_request]).nonzero()[0]
        order, order_request = order[keep], order_request[keep]
        count = np.minimum(count, budget + 1)
        # Breadth-first: a stable sort by (request, depth) keeps that order within each group.
        order = order[stable_order_small(order_request * (max_depth + 1) + nodes.depth[order])]
    order_request = request[order]
    row = np.arange(order.size) - (count.cumsum() - count)[order_request]  # the root is row 0
    row_of_id = np.full(request.size, -1, dtype=np.int64)
    row_of_id[order] = row
    is_node = (row > 0).nonzero()[0]
    order, row, tree_request = order[is_node], row[is_node], order_request[is_node]
    parent = row_of_id[nodes.parent_id[order]]
    assert (parent >= 0).all(), "top-n selection must be closed under ancestors"
    full = order.size == batch * width  # every request has N nodes: rows are already in place
    out = None if full else tree_request * width + row - 1

    def place(values: np.ndarray, fill) -> torch.Tensor:
        if full:
            return torch.from_numpy(values.reshape(batch, width))
        array = np.full(batch * width, fill, dtype=values.dtype)
        array[out] = values
        return torch.from_numpy(array.reshape(batch, width))

    graph_node = nodes.node[order]
    return VerificationTree(
        draft_token_ids=place(graph.token_ids.reshape(-1)[graph_node], -1),
        parent_row=place(parent, -1),
        depth=place(nodes.depth[order], 0),
        num_nodes=torch.from_numpy((count - 1).astype(np.int64)),
        ancestor_words=None,
        path_prob=place(nodes.path_prob[order], 0.0),
        via_merge=place(nodes.via[order], False),
        graph_row=place(graph_node - tree_request * num_rows, -1),
        child_rank=place(nodes.rank[order], -1),
        num_graph_nodes=torch.from_numpy(graph.num_nodes.copy()),
        num_merges=torch.from_numpy(graph.num_merges.copy()),
        expansions_saved=torch.from_numpy(graph.expansions_saved.copy()),
    )
