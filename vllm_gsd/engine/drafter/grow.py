"""Growing each candidate's hypothesis graph level by level, and the tree the target verifies.

The graph (vllm_gsd.graph.GraphBuilder) starts at each candidate's root, its history the tokens
before it. Each level is ONE draft forward over the frontier rows of every request (a few, past
max_num_tokens: forward_metadata.level_forwards), and each frontier row gets the draft's
children (children.py). Growth stops at the depth the step was allowed (the catch-up counts as
its first forward), or before, at the first level whose children the draft is too unsure of to
pay for the forward (NodeBudgetPolicy.next_level_pays; exploring steps draft every level).

The graph is then unrolled into the verification tree. Lookup nodes (engine/lookup.py) are
offered past each request's deepest likely leaf; they compete with the draft's nodes for the
node budget, and with the adaptive budget for the verified rows, at their leaf's path
probability times the lookup's odds per node. The adaptive budget keeps each request's most
likely nodes, as many as maximize the batch's expected tokens per second.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from vllm_gsd.engine.drafter.adaptive import AdaptiveBudget
from vllm_gsd.engine.drafter.batch import DraftBatch
from vllm_gsd.engine.drafter.children import Children
from vllm_gsd.engine.drafter.choose import Candidate
from vllm_gsd.engine.lookup import append_extensions, find_node, kept_extensions, lookup_extensions, with_extensions
from vllm_gsd.engine.metrics import GsdStats
from vllm_gsd.graph import Frontier, GraphBuilder, GraphParams, VerificationTree


def start_graph(params: GraphParams, batch: DraftBatch, candidates: list[Candidate], history_len: int
                ) -> GraphBuilder:
    """The candidates' graphs, each its root and the history_len tokens before it (-1 before the
    first token)."""
    token_ids = batch.token_ids
    batch_rows = np.asarray([c.batch_row for c in candidates], dtype=np.int64)
    root_pos = np.asarray([c.root_pos for c in candidates], dtype=np.int64)
    roots = torch.from_numpy(token_ids[batch_rows, root_pos].astype(np.int64))
    history = torch.full((len(candidates), history_len), -1, dtype=torch.int64)
    for col in range(history_len):
        pos = root_pos - history_len + col
        ok = pos >= 0
        history[torch.from_numpy(ok), col] = torch.from_numpy(token_ids[batch_rows[ok], pos[ok]].astype(np.int64))
    return GraphBuilder(params, roots, history)


def grow_levels(builder: GraphBuilder, root_hidden: torch.Tensor, depth: int, num_plain: int,
                expand: Callable[[GraphBuilder, Frontier], torch.Tensor],
                children: Callable[[torch.Tensor, np.ndarray, np.ndarray, np.ndarray], Children],
                budget: AdaptiveBudget | None, stats: GsdStats, explore: bool = False,
                rate_to_beat: float | None = None) -> int:
    """Draft the graph from the roots' hidden states [R, H]: at most `depth` forwards, the
    catch-up the first; expand(builder, frontier) runs a level's forwards and returns the hidden
    states of the frontier's rows; children(hidden, request_index, depth, node_row) their
    children (node_row: each row's graph row, 0 the root's).
    Returns the forwards drafted (the catch-up included)."""
    policy = budget.policy if budget is not None else None
    num_requests = root_hidden.shape[0]
    frontier_hidden, level = root_hidden, 0
    while (frontier := builder.frontier()) is not None:
        if frontier_hidden is None:
            if level >= depth:
                break
            if policy is not None and not explore and not _next_level_pays(
                    builder, frontier, level, num_plain, budget, rate_to_beat):
                stats.levels_not_paying += depth - level
                break
            frontier_hidden = expand(builder, frontier)
            num_rows = int(frontier.request_index.numel())
            stats.draft_tokens_computed += num_rows
            stats.levels_drafted += 1
            if policy is not None:
                policy.observe_forward(level, num_rows, num_requests)
        if level == 0:
            rows_request, rows_depth = np.arange(num_requests), np.zeros(num_requests, np.int64)
            rows_node = rows_depth
        else:
            rows_request, rows_depth = frontier.request_index.numpy(), frontier.depth.numpy()
            rows_node = frontier.node_row.numpy()
        top = children(frontier_hidden, rows_request, rows_depth, rows_node)
        if policy is not None:
            policy.observe_children(level, top.probs.numpy())
        builder.expand(top.tokens, top.probs)
        frontier_hidden, level = None, level + 1
    return level


def _next_level_pays(builder: GraphBuilder, frontier: Frontier, level: int, num_plain: int, budget: AdaptiveBudget,
                     rate_to_beat: float | None) -> bool:
    graph = builder.graph(copy=False)
    return budget.policy.next_level_pays(
        level, graph.path_prob[:, 1:], graph.depth[:, 1:], graph.num_nodes, frontier.request_index.numpy(),
        frontier.path_prob.numpy(), num_plain, budget.record.draft_curve_seconds, rate_to_beat)


def verification_tree(builder: GraphBuilder, batch: DraftBatch, candidates: list[Candidate], node_budget: int,
                      lookup_nodes: int, lookup_odds: float, budget: AdaptiveBudget | None, num_plain: int,
                      depth: int, levels: int, stats: GsdStats, explore: bool = False) -> VerificationTree:
    """The tree to verify: the unrolled graph and its lookup nodes, cut to the adaptive budget's
    selection (without one, every node within the node budget). depth: the forwards the step was
    allowed; levels: those it drafted."""
    tree = builder.build_tree()
    extensions = lookup_extensions(tree, [batch.token_ids[c.batch_row, :c.root_pos + 1] for c in candidates],
                                   lookup_nodes)
    stats.nodes_offered += int(tree.num_nodes.sum()) + int(extensions.num.sum())
    path_prob, node_depth, num_nodes = with_extensions(tree, extensions, lookup_odds)
    selected_nodes = num_nodes
    if budget is not None:
        budget.policy.observe_levels(depth, levels)
        selection = budget.policy.select(path_prob, node_depth, num_nodes, num_plain,
                                         budget.record.draft_curve_seconds, explore=explore, drafted_depth=depth)
        budget.record.predicted_tokens, budget.record.predicted_seconds = selection.tokens, selection.seconds
        selected_nodes = selection.node_budget
    selected_nodes = np.minimum(selected_nodes, node_budget)
    kept = kept_extensions(path_prob, num_nodes - extensions.num, selected_nodes)
    if budget is None and not kept.any():
        return tree
    selected = builder.build_tree(node_budget=selected_nodes - kept)
    if not kept.any():
        return selected
    # The leaf in the selected tree (its rows are numbered anew).
    leaf = np.full(len(candidates), -1, dtype=np.int64)
    for b in np.flatnonzero(kept).tolist():
        leaf[b] = find_node(selected, b, extensions.leaf_path[b])
    return append_extensions(selected, leaf, extensions.tokens, kept)
