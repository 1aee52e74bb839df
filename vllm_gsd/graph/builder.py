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
1. proposals: each frontier node's top-k children, pruned (sibling ratio, bad or repeated ids);
2. merge rule: a child token t of parent P becomes a pseudo edge P -> M when a drafted node M has
   the same (r+1)-gram (its token t and the r tokens before it along its primary path, continuing
   into the history), depth not compared, and the edge cannot close a cycle (_merge_targets).
   M is not expanded again for P: that is the draft work saved;
3. children of one level with the same n-gram collapse into one new node (the most likely one)
   and pseudo edges to it (_same_level_leaders);
4. budget: the level's new nodes compete for the request's remaining budget (N minus the nodes
   already drafted) by path probability, ties in creation order. Nodes of earlier levels are
   never evicted (their rows and draft KV are fixed), so the graph is the most likely nodes level
   by level; the verification tree (unroll.py) then takes the exact top-N of the unrolled DAG;
5. the new nodes that are not leaves form the next frontier.

The level runs compiled (numba, as vLLM's n-gram proposer does), one request after another: its
work is a few loads and compares per candidate, which as numpy calls cost about a microsecond
each, and a step of 64 requests handles some 2000 candidates per level. Drafted n-grams are
found through a hash table per request (confirmed exactly, so collisions cost only time), and
"M reaches x" is one bit of x's reachability set, kept transitively closed as edges are added.
Inputs may live on any device; outputs are CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from .ancestors import own_bit_words_numpy
from .hypothesis import HypothesisGraph
from .ordering import keep_best
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
        self._counts = np.zeros((3, batch), dtype=np.int64)  # drafted nodes, merges, expansions saved
        # Every edge (primary and pseudo) by source node and top-k rank.
        self._out_node = np.full(batch * num_rows * top_k, -1, dtype=np.int64)
        self._out_prob = np.zeros(batch * num_rows * top_k, dtype=np.float64)
        self._out_pseudo = np.zeros(batch * num_rows * top_k, dtype=bool)
        self._has_children = np.zeros(batch * num_rows, dtype=bool)
        # Primary-tree ancestor words [B * (N+1), W]; padding rows keep only their own bit.
        self._draft_words = np.tile(own_bit_words_numpy(num_rows), (batch, 1))
        self._merge_state = self._init_merge_state(roots, history_token_ids)

        # What every level's kernel call takes (flat views, built once).
        self._kernel_graph = (self._token.reshape(-1), self._parent.reshape(-1), self._depth.reshape(-1),
                              self._edge_prob.reshape(-1), self._path_prob.reshape(-1), self._child_rank.reshape(-1),
                              self._counts)
        self._kernel_edges = (self._out_node, self._out_prob, self._out_pseudo, self._has_children)
        self._pseudo: list[tuple[np.ndarray, ...]] = []
        self._levels_expanded = 0
        request = np.arange(batch, dtype=np.int64)
        self._front = (request, np.zeros(batch, dtype=np.int64), roots.copy(), np.ones(batch))

    def _init_merge_state(self, roots: np.ndarray, history_token_ids: torch.Tensor) -> tuple[np.ndarray, ...]:
        """The merge rule's state (placeholders when merging is off), by flat node id
        b * (N+1) + row:

        gram [B*(N+1), r+1]: the r+1 tokens ending at the node along its primary path, continuing
        into the history (-1 before it); a child of P proposing t has the n-gram (gram[P, 1:], t).
        drafted [B, T]: per request an open-addressing table of the drafted nodes' n-grams, each
        slot the first row of a chain (0 = empty), next_same [B*(N+1)] the next row of its chain.
        reach [B*(N+1), ceil(N/64)] uint64: bit m-1 of reach[x] is set iff drafted node m reaches
        x in the DAG (primary + pseudo edges), m == x included; the root is left out (it reaches
        every node and no edge enters it).
        level_first, level_stamp [T']: scratch table of one request's new n-grams at one level.
        """
        batch, num_rows, params = self._batch, self._num_rows, self.params
        if not params.merging:
            int_placeholder = np.zeros((1, 1), dtype=np.int64)
            return (int_placeholder, int_placeholder, np.zeros(1, dtype=np.int64), np.zeros((1, 1), dtype=np.uint64),
                    np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64))
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
        return gram, drafted, next_same, reach, np.zeros(level_slots, dtype=np.int64), np.zeros(level_slots,
                                                                                                  dtype=np.int64)

    # ---------------------------------------------------------------- engine-facing API

    def frontier(self) -> Frontier | None:
        """The rows to draft next, or None when drafting is over."""
        request, row, token, path_prob = self._front
        if request.size == 0 or self._levels_expanded >= self.params.max_depth:
            return None
        return Frontier(  # no copies: a front's arrays are never written once it is made
            request_index=torch.from_numpy(request),
            node_row=torch.from_numpy(row),
            depth=torch.from_numpy(np.full(request.size, self._levels_expanded, dtype=np.int64)),
            token_ids=torch.from_numpy(token),
            path_prob=torch.from_numpy(path_prob),
        )

    @property
    def draft_ancestor_words(self) -> torch.Tensor:
        """int32 [B, N + 1, W]: primary-tree ancestor bitmask over graph rows (a copy: the
        builder keeps writing its own array, and the engine may still be copying this one)."""
        return torch.from_numpy(self._draft_words.reshape(self._batch, self._num_rows, -1).copy())

    @property
    def num_graph_nodes(self) -> torch.Tensor:
        """int64 [B]: drafted graph nodes per request (root excluded)."""
        return torch.from_numpy(self._counts[0].copy())

    def expand(self, topk_token_ids: torch.Tensor, topk_probs: torch.Tensor) -> None:
        """Add the children proposed for the current frontier.

        topk_token_ids: int64 [F, k], topk_probs: float [F, k], the draft's top-k per frontier
        row in descending probability; only the first params.top_k columns are used.
        Children are pruned (min_child_ratio), merged into an existing node when the merge rule
        allows (a pseudo edge, no new node), and the remaining new nodes compete for the
        request's node budget by path probability.
        """
        params = self.params
        request, row, _, path_prob = self._front
        if request.size == 0:
            raise RuntimeError("expand() called with an empty frontier")
        tokens = _numpy(topk_token_ids)[:, : params.top_k]
        probs = _numpy(topk_probs)[:, : params.top_k]
        if tokens.shape[0] != request.size or probs.shape != tokens.shape:
            raise ValueError(f"expected [{request.size}, k] top-k tensors, got {tuple(tokens.shape)} "
                             f"and {tuple(probs.shape)}")
        self._levels_expanded += 1
        rule = (params.node_budget, params.top_k, params.merge_ngram, float(params.min_child_ratio),
                float(params.leaf_prob), self._levels_expanded, self._levels_expanded >= params.max_depth,
                np.uint64(_GOLDEN))
        out = np.empty((7, tokens.size), dtype=np.int64)
        out_prob = np.empty((2, tokens.size), dtype=np.float64)
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        probs = np.ascontiguousarray(probs, dtype=np.float64)
        num_next, num_pseudo = _expand_level(rule, request, row, path_prob, tokens, probs, self._kernel_graph,
                                             self._kernel_edges, self._draft_words, self._merge_state, out, out_prob)
        self._front = (out[0, :num_next], out[1, :num_next], out[2, :num_next], out_prob[0, :num_next])
        if num_pseudo:
            self._pseudo.append((out[3, :num_pseudo], out[4, :num_pseudo], out[5, :num_pseudo],
                                 out_prob[1, :num_pseudo], out[6, :num_pseudo]))

    def graph(self, copy: bool = True) -> HypothesisGraph:
        """The graph built so far: a copy, or (copy=False) views of the builder's arrays, valid
        until the next expand(), for a reader that only looks."""
        if self._pseudo:
            pseudo = [np.concatenate(column) for column in zip(*self._pseudo)]
        else:
            pseudo = [_EMPTY] * 3 + [np.zeros(0, np.float64), _EMPTY]
        num_nodes, num_merges, expansions_saved = self._counts
        graph = HypothesisGraph(
            token_ids=self._token, parent_row=self._parent, depth=self._depth, edge_prob=self._edge_prob,
            path_prob=self._path_prob, child_rank=self._child_rank, num_nodes=num_nodes,
            pseudo_request=pseudo[0], pseudo_src=pseudo[1], pseudo_dst=pseudo[2],
            pseudo_prob=pseudo[3], pseudo_rank=pseudo[4],
            num_merges=num_merges, expansions_saved=expansions_saved,
            out_node=self._out_node, out_prob=self._out_prob, out_pseudo=self._out_pseudo,
            has_children=self._has_children,
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


# -------------------------------------------------------------------- one level, compiled


@njit(cache=True, nogil=True, error_model="numpy")
def _expand_level(rule, front_request, front_row, front_path_prob, tokens, probs, graph, edges, draft_words,
                  merge_state, result, result_prob):
    """One level of drafting (steps 1-5 of the module docstring) for every request of the front.

    rule: (N, top_k, r, min_child_ratio, leaf_prob, level, last level, hash multiplier).
    front_*: [F] the frontier rows, grouped by request, rows ascending; tokens, probs [F, w].
    graph, edges, draft_words, merge_state: the builder's arrays (flat by node), written in place.
    Writes the next front into result[0:3] (request, row, token) and result_prob[0] (path prob), and
    this level's pseudo edges into result[3:7] (request, src row, dst row, rank) and result_prob[1]
    (prob): the merges into drafted nodes, then the edges of same-level duplicates to their
    leaders, each in creation order; result [7, F * w], result_prob [2, F * w]. Returns how many of
    each. (Arrays returned would each cost a microsecond to hand to Python.)
    """
    budget, top_k, merge_ngram, min_child_ratio, leaf_prob, level, last_level, multiplier = rule
    token, parent, depth, edge_prob, path_prob, child_rank, counts = graph
    out_node, out_prob, out_pseudo, has_children = edges
    gram, drafted_table, next_same, reach, level_first, level_stamp = merge_state
    merging = merge_ngram >= 0
    num_frontier, width = tokens.shape
    num_rows = budget + 1
    # Scratch per candidate of one request, c = (f - first) * width + j for column j of frontier
    # row f (a request has at most N frontier rows; small arrays stay in the cache).
    most = budget * width
    valid = np.zeros(most, np.bool_)
    expandable = np.zeros(most, np.bool_)
    cand_pp = np.empty(most)
    cand_hash = np.empty(most, np.uint64)  # of its n-gram (merging only)
    target = np.zeros(most, np.int64)  # the drafted row it merges into (0: none)
    leader = np.empty(most, np.int64)  # the same-level candidate it collapses into (itself: none)
    new_row = np.zeros(most, np.int64)  # its row as a new node (0: none)
    leaders = np.empty(most, np.int64)
    # A candidate is a merge, a duplicate or neither: merges fill the pseudo columns from the
    # front, duplicates from the back (moved behind the merges at the end).
    last = num_frontier * width - 1
    num_next = num_merges = num_follows = 0
    first = 0
    while first < num_frontier:  # one request: frontier rows first..end-1
        b = front_request[first]
        end = first + 1
        while end < num_frontier and front_request[end] == b:
            end += 1
        base = b * num_rows  # flat id of the request's root
        drafted = counts[0, b]
        count = (end - first) * width
        # 1. proposals
        for f in range(first, end):
            for j in range(width):
                c = (f - first) * width + j
                t, p = tokens[f, j], probs[f, j]
                ok = p > 0 and t >= 0 and (min_child_ratio <= 0 or p >= min_child_ratio * probs[f, 0])
                for earlier in range(j):
                    ok = ok and tokens[f, earlier] != t  # the first of repeated ids wins
                valid[c] = ok
                expandable[c] = not last_level and (leaf_prob <= 0 or p >= leaf_prob)
                cand_pp[c] = front_path_prob[f] * p
                target[c] = new_row[c] = 0
                leader[c] = c
                if merging and ok:
                    cand_hash[c] = _child_hash(gram, base + front_row[f], t, multiplier)
        if merging and drafted > 0:  # 2.
            _merge_targets(b, first, end, width, base, tokens, front_row, valid, cand_hash, target, path_prob,
                           gram, drafted_table, next_same, reach)
            for f in range(first, end):  # edges into drafted nodes may change the frontier's ancestors
                for j in range(width):
                    if target[(f - first) * width + j]:
                        _add_reach_edge(reach, base, drafted, base + front_row[f], target[(f - first) * width + j])
        if merging:  # 3.
            _same_level_leaders((level - 1) * counts.shape[1] + b + 1, first, end, width, base, tokens, front_row,
                                cand_hash, valid, target, cand_pp, leader, gram, level_first, level_stamp)
        # 4. the leaders that fit the remaining budget, best path prob first, ties in creation order
        num_leaders = 0
        for c in range(count):
            if valid[c] and target[c] == 0 and leader[c] == c:
                leaders[num_leaders] = c
                num_leaders += 1
        kept = leaders[:num_leaders]
        if num_leaders > budget - drafted:
            kept = keep_best(kept, cand_pp, budget - drafted)
        # The new nodes, rows in creation order. Only a request that goes on drafting (it has room
        # and a new node that is not a leaf) needs their merge state.
        goes_on = merging and drafted + kept.size < budget
        if goes_on:
            goes_on = False
            for c in kept:
                goes_on = goes_on or expandable[c]
        for i in range(kept.size):
            c = kept[i]
            f = first + c // width
            j = c - (f - first) * width
            row = drafted + 1 + i
            node, parent_node = base + row, base + front_row[f]
            new_row[c] = row
            token[node], parent[node], depth[node], child_rank[node] = tokens[f, j], front_row[f], level, j
            edge_prob[node], path_prob[node] = probs[f, j], cand_pp[c]
            edge = parent_node * top_k + j
            out_node[edge], out_prob[edge] = node, probs[f, j]
            has_children[parent_node] = True
            for w in range(draft_words.shape[1]):
                draft_words[node, w] |= draft_words[parent_node, w]
            if goes_on:  # what later levels' merge rule reads
                gram[node, :merge_ngram] = gram[parent_node, 1:]
                gram[node, merge_ngram] = tokens[f, j]
                for w in range(reach.shape[1]):
                    reach[node, w] = reach[parent_node, w]
                reach[node, (row - 1) >> 6] |= np.uint64(1) << np.uint64((row - 1) & 63)
                _insert_drafted(b, base, row, cand_hash[c], gram, drafted_table, next_same)
        counts[0, b] = drafted + kept.size
        # Pseudo edges: merges into drafted nodes, then duplicates into their kept leaders.
        for f in range(first, end):
            src_node = base + front_row[f]
            for j in range(width):
                c = (f - first) * width + j
                if valid[c] and target[c]:
                    dst, at = target[c], num_merges
                    num_merges += 1
                elif valid[c] and target[c] == 0 and leader[c] != c and new_row[leader[c]]:
                    dst, at = new_row[leader[c]], last - num_follows
                    num_follows += 1
                    _or_into(reach, base + dst, src_node)  # a new node: nothing below it yet
                else:
                    continue
                result[3, at], result[4, at], result[5, at], result[6, at] = b, front_row[f], dst, j
                result_prob[1, at] = probs[f, j]
                edge = src_node * top_k + j
                out_node[edge], out_prob[edge], out_pseudo[edge] = base + dst, probs[f, j], True
                has_children[src_node] = True
                counts[1, b] += 1
                if expandable[c]:
                    counts[2, b] += 1
        # 5. the next frontier: the new nodes that are not leaves, unless the graph is full
        if counts[0, b] < budget:  # (then every expandable new node has its merge state)
            for c in kept:
                if expandable[c]:
                    f = first + c // width
                    result[0, num_next], result[1, num_next] = b, new_row[c]
                    result[2, num_next], result_prob[0, num_next] = tokens[f, c - (f - first) * width], cand_pp[c]
                    num_next += 1
        first = end
    # The duplicates' edges behind the merges, in creation order: reverse them, then move them
    # down (each to a lower column, in ascending order: none is overwritten before it moves).
    start = last + 1 - num_follows
    for i in range(num_follows // 2):
        for k in range(3, 7):
            result[k, start + i], result[k, last - i] = result[k, last - i], result[k, start + i]
        result_prob[1, start + i], result_prob[1, last - i] = result_prob[1, last - i], result_prob[1, start + i]
    for i in range(num_follows):
        for k in range(3, 7):
            result[k, num_merges + i] = result[k, start + i]
        result_prob[1, num_merges + i] = result_prob[1, start + i]
    return num_next, num_merges + num_follows


@njit(cache=True, nogil=True, error_model="numpy")
def _reaches(reach, node, m):
    """Whether drafted row m reaches flat node `node`."""
    return (reach[node, (m - 1) >> 6] >> np.uint64((m - 1) & 63)) & np.uint64(1) != 0


@njit(cache=True, nogil=True, error_model="numpy")
def _slot(h, mask):
    """The first slot of hash h in a table of mask + 1 slots: its high bits (Fibonacci hashing)."""
    return np.int64(h >> np.uint64(40)) & mask


@njit(cache=True, nogil=True, error_model="numpy")
def _child_hash(gram, parent_node, t, multiplier):
    """Hash of the n-gram (gram[parent_node, 1:], t) of a proposed child."""
    h = np.uint64(0)
    for i in range(1, gram.shape[1]):
        h = (h ^ np.uint64(gram[parent_node, i] + 1)) * multiplier
    return (h ^ np.uint64(t + 1)) * multiplier


@njit(cache=True, nogil=True, error_model="numpy")
def _is_childs_gram(gram, node, parent_node, t):
    """Whether node's n-gram is (gram[parent_node, 1:], t)."""
    last = gram.shape[1] - 1
    for i in range(last):
        if gram[node, i] != gram[parent_node, i + 1]:
            return False
    return gram[node, last] == t


@njit(cache=True, nogil=True, error_model="numpy")
def _find_drafted(b, base, parent_node, t, h, gram, drafted_table):
    """The first row of request b's chain of drafted nodes with the n-gram (gram[parent_node,
    1:], t) of hash h, 0 if none."""
    mask = drafted_table.shape[1] - 1
    slot = _slot(h, mask)
    while drafted_table[b, slot]:
        if _is_childs_gram(gram, base + drafted_table[b, slot], parent_node, t):
            return drafted_table[b, slot]
        slot = (slot + 1) & mask
    return 0


@njit(cache=True, nogil=True, error_model="numpy")
def _insert_drafted(b, base, row, h, gram, drafted_table, next_same):
    """Add drafted row `row` of request b, whose n-gram hashes to h (its candidate's hash), to
    its n-gram's chain (at the front)."""
    node = base + row
    mask = drafted_table.shape[1] - 1
    slot = _slot(h, mask)
    while drafted_table[b, slot]:
        head = drafted_table[b, slot]
        if _same_tokens(gram, base + head, node, 0):
            next_same[node] = head
            drafted_table[b, slot] = row
            return
        slot = (slot + 1) & mask
    next_same[node] = 0
    drafted_table[b, slot] = row


@njit(cache=True, nogil=True, error_model="numpy")
def _merge_targets(b, first, end, width, base, tokens, front_row, valid, cand_hash, target, path_prob, gram,
                   drafted_table, next_same, reach):
    """Step 2 for request b (frontier rows first..end-1): target[c] = the drafted row candidate
    c merges into, or 0.

    A target M has the candidate's n-gram, does not reach the parent P (else P -> M closes a
    cycle), and passes the same-level ordering rule: no frontier row P' < P that has a
    cycle-free pair of its own is reachable from M. Any cycle of this level's pseudo edges
    P1 -> M1 ~> P2 -> M2 ~> ... ~> P1 would need rows P1 < P2 < ... < P1, so none exists.
    Among allowed targets the one with the highest path prob (then the lowest row) wins.
    """
    head = np.zeros((end - first) * width, np.int64)  # first row of the candidate's chain
    sources = np.empty(end - first, np.int64)  # frontier rows with a cycle-free pair, ascending
    num_sources = 0
    for f in range(first, end):
        parent_node = base + front_row[f]
        has_pair = False
        for j in range(width):
            c = (f - first) * width + j
            if not valid[c]:
                continue
            m = _find_drafted(b, base, parent_node, tokens[f, j], cand_hash[c], gram, drafted_table)
            head[c] = m
            while m and not has_pair:
                has_pair = not _reaches(reach, parent_node, m)
                m = next_same[base + m]
        if has_pair:
            sources[num_sources] = front_row[f]
            num_sources += 1
    if num_sources == 0:
        return
    for f in range(first, end):
        parent_row = front_row[f]
        parent_node = base + parent_row
        for j in range(width):
            c = (f - first) * width + j
            m = head[c]
            best = 0
            while m:
                allowed = not _reaches(reach, parent_node, m)
                for s in range(num_sources):
                    if not allowed or sources[s] >= parent_row:
                        break
                    allowed = not _reaches(reach, base + sources[s], m)
                if allowed and (best == 0 or path_prob[base + m] > path_prob[base + best]
                                or (path_prob[base + m] == path_prob[base + best] and m < best)):
                    best = m
                m = next_same[base + m]
            target[c] = best


@njit(cache=True, nogil=True, error_model="numpy")
def _add_reach_edge(reach, base, drafted, src_node, dst):
    """Record the pseudo edge src -> drafted row dst: every node reachable from dst (rows
    1..drafted whose set holds dst) gains every node that reaches src. (The ordering rule
    keeps src out of them, so src's set does not change meanwhile.)"""
    for x in range(1, drafted + 1):
        if _reaches(reach, base + x, dst):
            _or_into(reach, base + x, src_node)


@njit(cache=True, nogil=True, error_model="numpy")
def _same_level_leaders(stamp, first, end, width, base, tokens, front_row, cand_hash, valid, target, cand_pp,
                        leader, gram, level_first, level_stamp):
    """Step 3 for one request (frontier rows first..end-1): leader[c] = the candidate that c
    collapses into among the new-node candidates (valid, no merge target) with its n-gram: the
    highest path prob, then the first created. level_first/level_stamp: a table of the first
    candidate of each n-gram, its slots valid for this `stamp` only (so it is never cleared)."""
    mask = level_first.size - 1
    for f in range(first, end):
        parent_node = base + front_row[f]
        for j in range(width):
            c = (f - first) * width + j
            if not valid[c] or target[c]:
                continue
            t = tokens[f, j]
            slot = _slot(cand_hash[c], mask)
            while level_stamp[slot] == stamp:
                e = level_first[slot]
                e_front = first + e // width
                if tokens[e_front, e - (e_front - first) * width] == t and \
                        _same_tokens(gram, parent_node, base + front_row[e_front], 1):
                    break
                slot = (slot + 1) & mask
            if level_stamp[slot] != stamp:  # the first of its n-gram
                level_stamp[slot], level_first[slot] = stamp, c
                continue
            e = level_first[slot]
            if cand_pp[c] > cand_pp[leader[e]]:
                leader[e] = c
            leader[c] = -1 - e  # (resolved below: the group's final leader)
    for c in range((end - first) * width):
        if leader[c] < 0:
            leader[c] = leader[-1 - leader[c]]


@njit(cache=True, nogil=True, error_model="numpy")
def _same_tokens(gram, node, other, first_column):
    """Whether gram[node, first_column:] == gram[other, first_column:]: from column 0, two nodes
    have one n-gram; from column 1, children of the two with one token would."""
    for i in range(first_column, gram.shape[1]):
        if gram[node, i] != gram[other, i]:
            return False
    return True


@njit(cache=True, nogil=True, error_model="numpy")
def _or_into(reach, node, other):
    """reach[node] |= reach[other] (one uint64 word at a time, no temporary)."""
    for w in range(reach.shape[1]):
        reach[node, w] |= reach[other, w]

