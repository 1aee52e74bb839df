"""Level-by-level drafting of the hypothesis graph for a batch of requests, with the GSD merge rule.

The engine drives it:

    builder = GraphBuilder(params, root_token_ids, history_token_ids)
    while (frontier := builder.frontier()) is not None:
        topk_ids, topk_probs = draft_forward(frontier, builder.draft_ancestor_words)
        builder.expand(topk_ids, topk_probs)
    tree = builder.build_tree()

Graph node rows of a request are numbered in creation order (level by level, then by frontier
order, then by the draft's top-k rank); row 0 is the root. Every node has one *primary* parent
(the node that created it) and may be the target of *pseudo edges* from other nodes (merges).
The draft computes node g's KV along its primary path only, hence `draft_ancestor_words` is the
primary tree; the verification tree unrolls every DAG path (unroll.py).

One level (`expand`) is the paper's draft step, for each request:
1. proposals: each frontier node's top-k children, pruned (sibling ratio, bad or repeated ids)
   (_propose);
2. merge rule: a child token t of parent P becomes a pseudo edge P -> M when a drafted node M has
   the same (r+1)-gram (its token t and the r tokens before it along its primary path, continuing
   into the history), depth not compared, and the edge cannot close a cycle (_merge_targets).
   M is not expanded again for P: that is the draft work saved;
3. children of one level with the same n-gram collapse into one new node (the most likely one)
   and pseudo edges to it (_same_level_leaders);
4. budget: the level's new nodes compete for the request's remaining budget (N minus the nodes
   already drafted) by path probability, ties in creation order. Nodes of earlier levels are
   never evicted (their rows and draft KV are fixed), so the graph is the most likely nodes level
   by level; the verification tree (unroll.py) then takes the exact top-N of the unrolled DAG
   (_add_new_nodes);
5. the new nodes that are not leaves form the next frontier (_add_next_front).

The level runs compiled, one request after another, one helper per step (level_kernel.py).
Inputs may live on any device; outputs are CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .ancestors import own_bit_words_numpy
from .hypothesis import HypothesisGraph
from .level_kernel import (EdgeArrays, Front, LevelRule, MergeState, NodeArrays, PseudoEdges, RequestCounts,
                           expand_level)
from .params import GraphParams
from .unroll import VerificationTree, unroll_graph

# Multiplier of the n-gram hash (Fibonacci hashing); a module global so that a test can make
# every n-gram collide.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Frontier:
    """The nodes to run through the draft model at this level (CPU tensors, sorted by request, row).

    request_index: int64 [F], node_row: int64 [F] (graph row within its request; 0 = root),
    depth: int64 [F] (primary depth = rotary offset from draft_base), token_ids: int64 [F],
    path_prob: float64 [F] (the draft's probability of the path to the node).
    """

    request_index: torch.Tensor
    node_row: torch.Tensor
    depth: torch.Tensor
    token_ids: torch.Tensor
    path_prob: torch.Tensor


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's values as a numpy array (no copy for a CPU tensor numpy can hold)."""
    try:
        return tensor.numpy()
    except (TypeError, RuntimeError):  # another device, bfloat16, or it requires grad
        return tensor.detach().to("cpu", torch.float64 if tensor.is_floating_point() else torch.int64).numpy()


def _table_size(entries: int) -> int:
    """Slots of an open-addressing table for up to `entries` keys: a power of two, half full at most."""
    return max(16, 1 << (2 * entries - 1).bit_length())


class GraphBuilder:
    """Drafts a batch of hypothesis graphs level by level (see the module docstring)."""

    def __init__(self, params: GraphParams, root_token_ids: torch.Tensor,
                 history_token_ids: torch.Tensor) -> None:
        """root_token_ids: int64 [B], the last sampled token of each request (graph row 0).
        history_token_ids: int64 [B, H], the tokens just before the root, left-padded with -1;
        only its last merge_ngram columns are used (the r-gram of shallow nodes).
        """
        self.params = params
        roots = _numpy(root_token_ids).astype(np.int64, copy=False)
        batch = roots.shape[0]
        budget, top_k = params.node_budget, params.top_k
        num_rows = budget + 1
        self._batch, self._num_rows = batch, num_rows

        # Node arrays [B, N+1] (few allocations: they are rows of one block per dtype).
        self._token, self._parent, self._child_rank = np.full((3, batch, num_rows), -1, dtype=np.int64)
        self._token[:, 0] = roots
        self._depth = np.zeros((batch, num_rows), dtype=np.int64)
        self._edge_prob, self._path_prob = np.zeros((2, batch, num_rows), dtype=np.float64)
        self._edge_prob[:, 0] = self._path_prob[:, 0] = 1.0
        # Per request, rows of one block: drafted nodes, merges, expansions saved.
        self._counts = RequestCounts(*np.zeros((3, batch), dtype=np.int64))
        self._edges = EdgeArrays(
            out_node=np.full(batch * num_rows * top_k, -1, dtype=np.int64),
            out_prob=np.zeros(batch * num_rows * top_k, dtype=np.float64),
            out_pseudo=np.zeros(batch * num_rows * top_k, dtype=bool),
            has_children=np.zeros(batch * num_rows, dtype=bool),
        )
        # Primary-tree ancestor words [B * (N+1), W]; padding rows keep only their own bit.
        self._draft_words = np.tile(own_bit_words_numpy(num_rows), (batch, 1))
        self._merge_state = self._init_merge_state(roots, history_token_ids)
        # The kernel's view of the node arrays (flat, built once).
        self._nodes = NodeArrays(self._token.reshape(-1), self._parent.reshape(-1), self._depth.reshape(-1),
                                 self._edge_prob.reshape(-1), self._path_prob.reshape(-1),
                                 self._child_rank.reshape(-1))
        self._pseudo: list[PseudoEdges] = []
        self._levels_expanded = 0
        self._front = Front(np.arange(batch, dtype=np.int64), np.zeros(batch, dtype=np.int64), roots.copy(),
                            np.ones(batch))

    def _init_merge_state(self, roots: np.ndarray, history_token_ids: torch.Tensor) -> MergeState:
        """The merge rule's state (level_kernel.MergeState; placeholders when merging is off)."""
        batch, num_rows, params = self._batch, self._num_rows, self.params
        if not params.merging:
            int_placeholder = np.zeros((1, 1), dtype=np.int64)
            return MergeState(int_placeholder, int_placeholder, np.zeros(1, dtype=np.int64),
                              np.zeros((1, 1), dtype=np.uint64), np.zeros(1, dtype=np.int64),
                              np.zeros(1, dtype=np.int64))
        r = params.merge_ngram
        gram = np.full((batch * num_rows, r + 1), -1, dtype=np.int64)
        gram[::num_rows, r] = roots
        if r:
            history = history_token_ids.detach().to("cpu", torch.int64).numpy().reshape(batch, -1)
            take = min(r, history.shape[1])
            if take:
                gram[::num_rows, r - take:r] = history[:, history.shape[1] - take:]
        drafted = np.zeros((batch, _table_size(params.node_budget)), dtype=np.int64)
        next_same = np.zeros(batch * num_rows, dtype=np.int64)
        reach = np.zeros((batch * num_rows, (params.node_budget + 63) // 64), dtype=np.uint64)
        level_slots = _table_size(params.node_budget * params.top_k)
        return MergeState(gram, drafted, next_same, reach, np.zeros(level_slots, dtype=np.int64),
                          np.zeros(level_slots, dtype=np.int64))

    # ---------------------------------------------------------------- engine-facing API

    def frontier(self) -> Frontier | None:
        """The rows to draft next, or None when drafting is over."""
        front = self._front
        if front.request.size == 0 or self._levels_expanded >= self.params.max_depth:
            return None
        return Frontier(  # no copies: a front's arrays are never written once it is made
            request_index=torch.from_numpy(front.request),
            node_row=torch.from_numpy(front.row),
            depth=torch.from_numpy(np.full(front.request.size, self._levels_expanded, dtype=np.int64)),
            token_ids=torch.from_numpy(front.token),
            path_prob=torch.from_numpy(front.path_prob),
        )

    def paths_below_root(self, request_index: np.ndarray, node_row: np.ndarray) -> list[list[int]]:
        """Per (request, graph row): the tokens of the row's primary path below the root, the
        row's own last (the root's: [])."""
        paths = []
        for b, row in zip(request_index.tolist(), node_row.tolist()):
            path = []
            while row > 0:
                path.append(int(self._token[b, row]))
                row = int(self._parent[b, row])
            paths.append(path[::-1])
        return paths

    @property
    def draft_ancestor_words(self) -> torch.Tensor:
        """int32 [B, N + 1, W]: primary-tree ancestor bitmask over graph rows (a copy: the
        builder keeps writing its own array, and the engine may still be copying this one)."""
        return torch.from_numpy(self._draft_words.reshape(self._batch, self._num_rows, -1).copy())

    @property
    def num_graph_nodes(self) -> torch.Tensor:
        """int64 [B]: drafted graph nodes per request (root excluded)."""
        return torch.from_numpy(self._counts.num_nodes.copy())

    def expand(self, topk_token_ids: torch.Tensor, topk_probs: torch.Tensor) -> None:
        """Add the children proposed for the current frontier.

        topk_token_ids: int64 [F, k], topk_probs: float [F, k], the draft's top-k per frontier
        row in descending probability; only the first params.top_k columns are used.
        Children are pruned (min_child_ratio), merged into an existing node when the merge rule
        allows (a pseudo edge, no new node), and the remaining new nodes compete for the
        request's node budget by path probability.
        """
        params = self.params
        num_frontier = self._front.request.size
        if num_frontier == 0:
            raise RuntimeError("expand() called with an empty frontier")
        tokens = _numpy(topk_token_ids)[:, : params.top_k]
        probs = _numpy(topk_probs)[:, : params.top_k]
        if tokens.shape[0] != num_frontier or probs.shape != tokens.shape:
            raise ValueError(f"expected [{num_frontier}, k] top-k tensors, got {tuple(tokens.shape)} "
                             f"and {tuple(probs.shape)}")
        self._levels_expanded += 1
        rule = LevelRule(params.node_budget, params.top_k, params.merge_ngram, float(params.min_child_ratio),
                         float(params.leaf_prob), self._levels_expanded, self._levels_expanded >= params.max_depth,
                         np.uint64(_GOLDEN))
        # The outputs, rows of one block per dtype: the next front, then the pseudo edges.
        ids = np.empty((7, tokens.size), dtype=np.int64)
        prob = np.empty((2, tokens.size), dtype=np.float64)
        next_front = Front(ids[0], ids[1], ids[2], prob[0])
        pseudo = PseudoEdges(ids[3], ids[4], ids[5], prob[1], ids[6])
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        probs = np.ascontiguousarray(probs, dtype=np.float64)
        num_next, num_pseudo = expand_level(rule, self._front, tokens, probs, self._nodes, self._edges, self._counts,
                                            self._draft_words, self._merge_state, next_front, pseudo)
        self._front = Front(*[column[:num_next] for column in next_front])
        if num_pseudo:
            self._pseudo.append(PseudoEdges(*[column[:num_pseudo] for column in pseudo]))

    def graph(self, copy: bool = True) -> HypothesisGraph:
        """The graph built so far: a copy, or (copy=False) views of the builder's arrays, valid
        until the next expand(), for a reader that only looks."""
        if self._pseudo:
            pseudo = PseudoEdges(*(np.concatenate(column) for column in zip(*self._pseudo)))
        else:
            pseudo = PseudoEdges(_EMPTY, _EMPTY, _EMPTY, np.zeros(0, np.float64), _EMPTY)
        counts, edges = self._counts, self._edges
        graph = HypothesisGraph(
            token_ids=self._token, parent_row=self._parent, depth=self._depth, edge_prob=self._edge_prob,
            path_prob=self._path_prob, child_rank=self._child_rank, num_nodes=counts.num_nodes,
            pseudo_request=pseudo.request, pseudo_src=pseudo.src_row, pseudo_dst=pseudo.dst_row,
            pseudo_prob=pseudo.prob, pseudo_rank=pseudo.rank,
            num_merges=counts.num_merges, expansions_saved=counts.expansions_saved,
            out_node=edges.out_node, out_prob=edges.out_prob, out_pseudo=edges.out_pseudo,
            has_children=edges.has_children,
        )
        if not copy:
            return graph
        return HypothesisGraph(**{name: value.copy() for name, value in vars(graph).items()})

    def build_tree(self, node_budget: torch.Tensor | np.ndarray | int | None = None) -> VerificationTree:
        """Unroll the graph into the flattened verification tree (see unroll.unroll_graph).

        node_budget: how many tree nodes request b keeps, int64 [B] or one int for all, each in
        0..N; None = N. The tree keeps its node_budget[b] best nodes by path probability.
        """

        return unroll_graph(self.graph(copy=False), node_budget)
