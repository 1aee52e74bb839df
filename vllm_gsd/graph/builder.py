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

One level (`expand`) is the paper's draft step:
1. proposals: each frontier node's top-k children, pruned (sibling ratio, bad or repeated ids);
2. merge rule: a child token t of parent P becomes a pseudo edge P -> M when a drafted node M has
   the same (r+1)-gram (its token t and the r tokens before it along its primary path, continuing
   into the history), depth not compared, and the edge cannot close a cycle (_match_existing).
   M is not expanded again for P: that is the draft work saved;
3. children of one level with the same n-gram collapse into one new node (the most likely one)
   and pseudo edges to it (_same_level_leaders);
4. budget: the level's new nodes compete for the request's remaining budget (N minus the nodes
   already drafted) by path probability, ties in creation order. Nodes of earlier levels are
   never evicted (their rows and draft KV are fixed), so the graph is the most likely nodes level
   by level; the verification tree (unroll.py) then takes the exact top-N of the unrolled DAG;
5. the new nodes that are not leaves form the next frontier.

All bookkeeping is numpy on the CPU, vectorized over every frontier row of every request, with
1-D gathers and scatters: nodes are addressed by flat ids (request * (N + 1) + row), candidates
by f * k + j (frontier row f, top-k column j). State only later levels read (merge rule) is not
written at the last level, and the draft ancestor words are brought up to date when read.
Python loops are over levels, top-k columns, bitset words, the rare chains of same-level
merges (reachability closure) and the rarer rounds of hash collisions between different n-grams
(step 3). Inputs may live on any device; outputs are CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch

from .ancestors import own_bit_words_numpy
from .ordering import best_in_group, best_of_runs, runs_of_equal
from .params import GraphParams

if TYPE_CHECKING:
    from .unroll import VerificationTree

_NO_ROW = np.iinfo(np.int64).max
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing multiplier
_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Frontier:
    """The nodes to run through the draft model at this level (CPU tensors, sorted by request, row).

    request_index: int64 [F], node_row: int64 [F] (graph row within its request; 0 = root),
    depth: int64 [F] (primary depth = rotary offset from draft_base), token_ids: int64 [F].
    """

    request_index: torch.Tensor
    node_row: torch.Tensor
    depth: torch.Tensor
    token_ids: torch.Tensor


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


@dataclass
class _Front:
    """The nodes to expand next, sorted by (request, row), with what their children need.
    Its arrays are fresh and never written afterwards (frontier() hands them out as they are)."""

    request: np.ndarray  # int64 [F]
    row: np.ndarray  # int64 [F], graph row within the request
    node: np.ndarray  # int64 [F], flat node id request * (N+1) + row
    token: np.ndarray  # int64 [F]
    path_prob: np.ndarray  # float64 [F]

    def select(self, keep: np.ndarray) -> _Front:
        return _Front(self.request[keep], self.row[keep], self.node[keep], self.token[keep], self.path_prob[keep])


@dataclass
class _Proposals:
    """One level's proposed children. Candidate c = f * k + j is column j of frontier row f."""

    request: np.ndarray  # int64 [F], the frontier rows' requests
    parent: np.ndarray  # int64 [F], the frontier rows (graph rows)
    parent_node: np.ndarray  # int64 [F], their flat node ids
    width: int  # k
    cand_request: np.ndarray  # int64 [F * k], each candidate's request
    token: np.ndarray  # int64 [F * k]
    prob: np.ndarray  # float64 [F * k], draft prob at the parent
    path_prob: np.ndarray  # float64 [F * k]
    valid: np.ndarray  # bool [F * k], survives the pruning
    expandable: np.ndarray | None  # bool [F * k], not a leaf (None: all are)
    key: np.ndarray | None = None  # int64 [F * k], n-gram key (merging only)
    slot: np.ndarray | None = None  # int64 [F * k], hash-set slot of the key (merging only)

    def frontier_index(self, candidate: np.ndarray) -> np.ndarray:
        if self.width & (self.width - 1) == 0:  # a shift: numpy's int64 division is not vectorized
            return candidate >> (self.width.bit_length() - 1)
        return candidate // self.width

    def rank(self, candidate: np.ndarray, frontier_index: np.ndarray) -> np.ndarray:
        """The top-k column of each candidate (its frontier_index given)."""
        if self.width & (self.width - 1) == 0:
            return candidate & (self.width - 1)
        return candidate - frontier_index * self.width


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's values as a numpy array (no copy for a CPU tensor numpy can hold)."""
    try:
        return tensor.numpy()
    except (TypeError, RuntimeError):  # another device, bfloat16, or it requires grad
        return tensor.detach().to("cpu", torch.float64 if tensor.is_floating_point() else torch.int64).numpy()


@lru_cache(maxsize=64)
def _reach_bits(budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bit m-1 of a reach set <-> drafted row m: (word [N], shift [N] uint64, own [words, N+1]
    uint64 with row m's bit), cached read-only."""
    bit = np.arange(budget)
    word, shift = bit >> 6, (bit & 63).astype(np.uint64)
    own = np.zeros(((budget + 63) // 64, budget + 1), dtype=np.uint64)
    own[word, bit + 1] = np.left_shift(np.uint64(1), shift)
    for array in (word, shift, own):
        array.flags.writeable = False
    return word, shift, own


@lru_cache(maxsize=64)
def _own_words_of_batch(batch: int, num_rows: int) -> np.ndarray:
    """int32 [batch * num_rows, W]: own_bit_words_numpy(num_rows) for each request (cached,
    read-only: copy to modify)."""
    words = np.tile(own_bit_words_numpy(num_rows), (batch, 1))
    words.flags.writeable = False
    return words


def _ngram_key(prefix: np.ndarray, last: np.ndarray) -> np.ndarray:
    """int64 key of the n-grams (prefix[..., :], last) (broadcast), never 0 for a token >= 0;
    exact (a packing) when n <= 2, else an (odd) hash. Tokens are >= -1 and < 2^31, so token + 1
    fits 32 bits and two tokens pack into one int64."""
    if prefix.shape[-1] == 0:
        return last + 1
    if prefix.shape[-1] == 1:
        return ((prefix[..., 0] + 1) << 32) | (last + 1)
    key = np.zeros(prefix.shape[:-1], dtype=np.int64)
    for column in range(prefix.shape[-1]):
        key = key * 1_000_003 + (prefix[..., column] + 1)  # array ops wrap mod 2^64 on purpose
    return (key * 1_000_003 + (last + 1)) | 1


def _edges_to_kept_leaders(fresh: np.ndarray, kept: np.ndarray, kept_row: np.ndarray, follower: np.ndarray,
                           leader: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(candidate ids, target rows) of the pseudo edges from same-level followers to their
    leaders, for the leaders that made the budget (kept, ascending indices into `fresh`, at
    rows kept_row); followers of a cut leader are dropped with it."""
    if kept.size == 0:
        return _EMPTY, _EMPTY
    at = np.minimum(np.searchsorted(kept, leader), kept.size - 1)
    leader_kept = (kept[at] == leader).nonzero()[0]
    return fresh[follower[leader_kept]], kept_row[at[leader_kept]]


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
        budget = params.node_budget
        num_rows = budget + 1
        self._batch, self._budget, self._num_rows = batch, budget, num_rows

        # Node arrays [B, N+1] (few allocations: they are rows of one block per dtype).
        self._token, self._parent, self._child_rank = np.full((3, batch, num_rows), -1, dtype=np.int64)
        self._token[:, 0] = roots
        self._depth = np.zeros((batch, num_rows), dtype=np.int64)
        self._edge_prob, self._path_prob = np.zeros((2, batch, num_rows), dtype=np.float64)
        self._edge_prob[:, 0] = self._path_prob[:, 0] = 1.0
        self._num_nodes, self._num_merges, self._expansions_saved = np.zeros((3, batch), dtype=np.int64)
        self._out_node = np.full(batch * num_rows * params.top_k, -1, dtype=np.int64)
        self._out_prob = np.zeros(batch * num_rows * params.top_k, dtype=np.float64)
        self._out_pseudo = np.zeros(batch * num_rows * params.top_k, dtype=bool)
        self._has_children = np.zeros(batch * num_rows, dtype=bool)
        # Primary-tree ancestor words, [B * (N+1), W]; padding rows keep only their own
        # bit (contracts.md). New nodes are queued and OR-ed in when the words are read.
        self._draft_words = _own_words_of_batch(batch, num_rows).copy()  # [B * (N+1), W]
        self._num_words = self._draft_words.shape[1]
        # The same memory, one opaque element per node: numpy moves whole rows fast this way.
        self._draft_word_rows = self._draft_words.view(np.dtype((np.void, 4 * self._num_words))).reshape(-1)
        self._pending_words: list[tuple[np.ndarray, np.ndarray]] = []
        if params.merging:
            self._init_merge_state(roots, history_token_ids)

        self._pseudo: list[tuple[np.ndarray, ...]] = []
        self._levels_expanded = 0
        request = np.arange(batch, dtype=np.int64)
        self._front = _Front(request, np.zeros(batch, dtype=np.int64), request * num_rows, self._token[:, 0].copy(),
                             np.ones(batch))

    def _init_merge_state(self, roots: np.ndarray, history_token_ids: torch.Tensor) -> None:
        """The merge rule's per-node state, addressed by flat node id:

        context [B*(N+1), r] (r >= 2 only): the r tokens ending at the node along its primary
        path, continuing into the history; for r <= 1 the node's own token is its context.
        key: the _ngram_key of the node's (r+1)-gram (the r tokens before it, then its token),
        never 0; 0 for the root and padding rows, which are never merge targets.
        seen [B * 2^bits]: a hash set per request of the keys of the drafted nodes, so only
        candidates that may merge are compared exactly (false positives <= N / 2^bits).
        reach [words, B*(N+1)] uint64: bit m-1 of reach[:, x] is set iff drafted node m reaches
        x in the DAG (primary + pseudo edges), m == x included; the root is left out (it reaches
        every node and no edge enters it).
        """
        batch, num_rows, merge_ngram = self._batch, self._num_rows, self.params.merge_ngram
        if merge_ngram >= 2:
            history = history_token_ids.detach().to("cpu", torch.int64).numpy().reshape(batch, -1)
            self._context = np.full((batch * num_rows, merge_ngram), -1, dtype=np.int64)
            take = min(merge_ngram - 1, history.shape[1])
            if take:
                self._context[::num_rows, merge_ngram - 1 - take:-1] = history[:, history.shape[1] - take:]
            self._context[::num_rows, -1] = roots
        self._key = np.zeros(batch * num_rows, dtype=np.int64)
        self._slot_bits = max(6, (16 * self._budget - 1).bit_length())
        self._seen = np.zeros(batch << self._slot_bits, dtype=bool)
        self._slot_owner = np.empty(batch << self._slot_bits, dtype=np.int64)  # scratch of step 3

        self._bit_word, self._bit_shift, self._own_reach = _reach_bits(self._budget)
        self._reach = np.zeros((self._own_reach.shape[0], batch * num_rows), dtype=np.uint64)

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
        )

    @property
    def draft_ancestor_words(self) -> torch.Tensor:
        """int32 [B, N + 1, W]: primary-tree ancestor bitmask over graph rows (a copy: the
        builder keeps writing its own array, and the engine may still be copying this one)."""
        rows = self._draft_word_rows
        for node, parent_node in self._pending_words:  # level order: parents are final
            rows[node] = (rows[node].view(np.int32) | rows[parent_node].view(np.int32)).view(rows.dtype)
        self._pending_words.clear()
        return torch.from_numpy(self._draft_words.reshape(self._batch, self._num_rows, self._num_words).copy())

    @property
    def num_graph_nodes(self) -> torch.Tensor:
        """int64 [B]: drafted graph nodes per request (root excluded)."""
        return torch.from_numpy(self._num_nodes.copy())

    def expand(self, topk_token_ids: torch.Tensor, topk_probs: torch.Tensor) -> None:
        """Add the children proposed for the current frontier.

        topk_token_ids: int64 [F, k], topk_probs: float [F, k], the draft's top-k per frontier
        row in descending probability; only the first params.top_k columns are used.
        Children are pruned (min_child_ratio), merged into an existing node when the merge rule
        allows (a pseudo edge, no new node), and the remaining new nodes compete for the
        request's node budget by path probability.
        """
        proposals = self._propose(topk_token_ids, topk_probs)  # 1.
        existing, existing_dst = _EMPTY, _EMPTY  # 2. merges into drafted nodes (candidates, rows)
        if self.params.merging and self._num_nodes.any():
            existing, existing_dst = self._match_existing(proposals)
        fresh = proposals.valid
        if existing.size:
            fresh = fresh.copy()
            fresh[existing] = False
        fresh = fresh.nonzero()[0]  # candidate ids, in creation order (grouped by request)
        fresh_pp = proposals.path_prob[fresh]
        followers = None  # 3. same-level duplicates: (follower, its leader), indices into `fresh`
        request = proposals.request  # only children of two frontier rows of one request can collide
        if self.params.merging and fresh.size > 1 and (request[1:] == request[:-1]).any():
            followers = self._same_level_leaders(proposals, fresh, fresh_pp)
        kept, count = self._fit_budget(proposals, fresh, fresh_pp, followers)  # 4.
        new = fresh[kept]
        added = self._add_nodes(proposals, new, count)
        follower, follower_dst = _EMPTY, _EMPTY
        if followers is not None:
            follower, follower_dst = _edges_to_kept_leaders(fresh, kept, added.row, *followers)
        self._front = self._next_front(proposals, new, added)  # 5.
        if self.params.merging and self._front.request.size:  # only later levels read it
            self._update_merge_state(proposals, existing, existing_dst, new, added, follower, follower_dst)
        self._add_pseudo_edges(proposals, np.concatenate([existing, follower]),
                               np.concatenate([existing_dst, follower_dst]))

    def _fit_budget(self, proposals: _Proposals, fresh: np.ndarray, fresh_pp: np.ndarray,
                    followers: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray, np.ndarray]:
        """Step 4: (kept, count): the leaders among `fresh` (indices into it, ascending) that
        fit their request's remaining budget, best path prob first (ties: creation order), and
        how many per request."""
        fresh_request = proposals.cand_request[fresh]
        kept = np.arange(fresh.size)
        if followers is not None:
            is_leader = np.ones(fresh.size, dtype=bool)
            is_leader[followers[0]] = False
            kept = is_leader.nonzero()[0]
            fresh_request, fresh_pp = fresh_request[kept], fresh_pp[kept]
        remaining = self._budget - self._num_nodes
        count = np.bincount(fresh_request, minlength=self._batch)
        if (count > remaining).any():
            kept = kept[best_in_group(fresh_request, fresh_pp, remaining, count)]
            count = np.minimum(count, remaining)
        return kept, count

    def _next_front(self, proposals: _Proposals, new: np.ndarray, added: _Front) -> _Front:
        """Step 5: the new nodes that are not leaves. A request whose graph is full stops
        drafting: its children could only be merges."""
        expandable = self._num_nodes[added.request] < self._budget
        if proposals.expandable is not None:
            expandable &= proposals.expandable[new]
        if expandable.all():
            return added
        return added.select(expandable.nonzero()[0] if expandable.any() else _EMPTY)

    def graph(self, copy: bool = True) -> HypothesisGraph:
        """The graph built so far: a copy, or (copy=False) views of the builder's arrays, valid
        until the next expand(), for a reader that only looks."""
        return self._snapshot(copy=copy)

    def build_tree(self, node_budget: torch.Tensor | np.ndarray | int | None = None) -> VerificationTree:
        """Unroll the graph into the flattened verification tree (see unroll.unroll_graph).

        node_budget: how many tree nodes request b keeps, int64 [B] or one int for all, each in
        0..N; None = N. The tree keeps its node_budget[b] best nodes by path probability.
        """
        from .unroll import unroll_graph

        return unroll_graph(self._snapshot(copy=False), node_budget)

    # ---------------------------------------------------------------- one level

    def _propose(self, topk_token_ids: torch.Tensor, topk_probs: torch.Tensor) -> _Proposals:
        """Step 1: the frontier's children as candidates, pruned (sibling ratio, bad ids,
        duplicate ids within a row: the first one wins)."""
        params = self.params
        front = self._front
        request, parent = front.request, front.row
        num_frontier = request.size
        if num_frontier == 0:
            raise RuntimeError("expand() called with an empty frontier")
        tokens = _numpy(topk_token_ids)[:, : params.top_k]
        probs = _numpy(topk_probs)[:, : params.top_k]
        if tokens.shape[0] != num_frontier or probs.shape != tokens.shape:
            raise ValueError(f"expected [{num_frontier}, k] top-k tensors, got {tuple(tokens.shape)} "
                             f"and {tuple(probs.shape)}")
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        probs = np.ascontiguousarray(probs, dtype=np.float64)
        width = tokens.shape[1]
        self._levels_expanded += 1

        valid = probs > 0
        if params.min_child_ratio > 0:
            valid &= probs >= params.min_child_ratio * probs[:, :1]
        if tokens.min() < 0:
            valid &= tokens >= 0
        if width > 1:  # the draft's top-k has distinct ids; bad input may repeat one
            repeated = tokens[:, 1] == tokens[:, 0]
            for later in range(2, width):
                for earlier in range(later):
                    repeated |= tokens[:, later] == tokens[:, earlier]
            if repeated.any():
                for later in range(1, width):
                    for earlier in range(later):
                        valid[:, later] &= tokens[:, later] != tokens[:, earlier]
        parent_node = front.node
        # Per-row values spread to the row's k candidates (repeat beats [F, 1] broadcasting).
        path_prob = front.path_prob.repeat(width)
        path_prob *= probs.reshape(-1)
        expandable = None
        if self._levels_expanded >= params.max_depth:
            expandable = np.zeros(probs.size, dtype=bool)
        elif params.leaf_prob > 0:
            expandable = (probs >= params.leaf_prob).reshape(-1)
        proposals = _Proposals(request, parent, parent_node, width, request.repeat(width), tokens.reshape(-1),
                               probs.reshape(-1), path_prob, valid.reshape(-1), expandable)
        if params.merging:
            if params.merge_ngram == 0:
                key = proposals.token + 1
            elif params.merge_ngram == 1:
                key = (((front.token + 1) << 32) + 1).repeat(width)  # + (token + 1): the low 32 bits
                key += proposals.token
            else:
                key = _ngram_key(self._context[parent_node, None, :], tokens).reshape(-1)
            proposals.key = key
            slot = key.view(np.uint64) * _GOLDEN
            slot >>= np.uint64(64 - self._slot_bits)
            slot = slot.view(np.int64)
            slot += proposals.cand_request << self._slot_bits
            proposals.slot = slot
        return proposals

    def _match_existing(self, proposals: _Proposals) -> tuple[np.ndarray, np.ndarray]:
        """Step 2: (candidate ids, target rows) of the candidates that merge into a drafted node.

        A target M has the candidate's n-gram (same token and same r preceding tokens), is a
        drafted node, does not reach the parent P (else P -> M closes a cycle), and passes the
        same-level ordering rule: every frontier node reachable from M that also has a merge
        candidate must have a larger row than P. Any cycle made of this level's pseudo edges
        P1 -> M1 ~> P2 -> M2 ~> ... ~> P1 would need rows P1 < P2 < ... < P1, so none exists.
        Among allowed targets the one with the highest path prob (then lowest row) wins.

        Only candidates whose key is in the request's hash set are compared, exactly, with the
        keys of all drafted nodes of their request.
        """
        num_rows, nodes = self._num_rows, self._batch * self._num_rows
        maybe = (proposals.valid & self._seen[proposals.slot]).nonzero()[0]
        if maybe.size == 0:
            return _EMPTY, _EMPTY
        maybe_pos = proposals.frontier_index(maybe)
        maybe_request = proposals.cand_request[maybe]
        # Keys of the root and padding rows are 0, which no candidate has.
        same = np.take(self._key.reshape(self._batch, num_rows), maybe_request, axis=0) == proposals.key[maybe][:, None]
        pair_cand, pair_m = np.divmod(same.reshape(-1).nonzero()[0], num_rows)  # by candidate, then row
        if self.params.merge_ngram >= 2:  # the key is a hash: confirm the n-grams
            cand_gram = np.concatenate([self._context[proposals.parent_node[maybe_pos[pair_cand]]],
                                        proposals.token[maybe[pair_cand], None]], axis=1)
            target = maybe_request[pair_cand] * num_rows + pair_m
            target_gram = np.concatenate([self._context[self._parent.reshape(-1)[target] + target - pair_m],
                                          self._token.reshape(-1)[target, None]], axis=1)
            exact = (target_gram == cand_gram).all(1)
            pair_cand, pair_m = pair_cand[exact], pair_m[exact]
        # M must not reach P.
        pair_pos = maybe_pos[pair_cand]
        pair_request = maybe_request[pair_cand]
        parent_node = proposals.parent_node[pair_pos]
        reach = self._reach.reshape(-1)
        bit = pair_m - 1
        word = reach[parent_node] if self._reach.shape[0] == 1 else reach[self._bit_word[bit] * nodes + parent_node]
        allowed = (word >> self._bit_shift[bit]) & np.uint64(1) == 0
        if not allowed.all():
            pair_cand, pair_m, pair_pos, pair_request, parent_node = (
                pair_cand[allowed], pair_m[allowed], pair_pos[allowed], pair_request[allowed], parent_node[allowed])
            if pair_cand.size == 0:
                return _EMPTY, _EMPTY
        # Ordering rule against same-level cycles: for each drafted node m, the lowest frontier
        # row, among the parents P with a pair left, that m reaches. (With one such parent per
        # request it allows everything: m does not reach its own P.)
        if ((pair_request[1:] == pair_request[:-1]) & (pair_pos[1:] != pair_pos[:-1])).any():
            # Pair i against every pair j of its request (pairs come grouped by request): is
            # P_j reachable from M_i, and what is the lowest such row.
            parent_row = proposals.parent[pair_pos]
            request_start, request_of = runs_of_equal(pair_request)
            request_count = np.bincount(request_of)
            count = request_count[request_of]
            start = count.cumsum() - count
            i = np.arange(pair_request.size).repeat(count)
            j = request_start[request_of].repeat(count) + (np.arange(i.size) - start.repeat(count))
            bit = pair_m[i] - 1
            word = reach[parent_node[j]] if self._reach.shape[0] == 1 else reach[self._bit_word[bit] * nodes + parent_node[j]]
            m_reaches_p = (word >> self._bit_shift[bit]) & np.uint64(1) == 1
            lowest_source_row = np.minimum.reduceat(np.where(m_reaches_p, parent_row[j], _NO_ROW), start)
            allowed = lowest_source_row > parent_row
            pair_cand, pair_m, pair_request = pair_cand[allowed], pair_m[allowed], pair_request[allowed]
            if pair_cand.size == 0:
                return _EMPTY, _EMPTY
        # Best target per candidate: highest path prob, then lowest row.
        if not (pair_cand[1:] == pair_cand[:-1]).any():
            return maybe[pair_cand], pair_m
        cand_start, cand_of = runs_of_equal(pair_cand)
        pair_pp = self._path_prob.reshape(-1)[pair_request * num_rows + pair_m]
        return maybe[pair_cand[cand_start]], best_of_runs(cand_start, cand_of, pair_pp, pair_m)

    def _same_level_leaders(self, proposals: _Proposals, fresh, path_prob):
        """Step 3: (followers, their leaders) among the new-node candidates `fresh` (indices into
        it, followers ascending), or None when no two share an n-gram: candidates of one
        request with the same n-gram collapse into the one with the highest path prob, then the
        first created.

        Candidates with one n-gram share a hash-set slot. Each candidate writes its index into
        its slot and reads the slot back: a slot written more than once returns one of its
        writers (the owner), so the candidates that read another index, and the owners they
        read, are the few that may collide. Those join their owner's group when their n-gram
        equals the owner's (exactly); the rest, true hash collisions, repeat with a new owner.
        """
        slot = proposals.slot[fresh]
        index = np.arange(fresh.size)
        owner_of_slot = self._slot_owner
        owner_of_slot[slot] = index
        owner = owner_of_slot[slot]
        collided = (owner != index).nonzero()[0]
        if collided.size == 0:
            return None
        shares = np.zeros(fresh.size, dtype=bool)
        shares[collided] = True
        shares[owner[collided]] = True
        members = shares.nonzero()[0]  # in creation order
        group = np.empty(fresh.size, dtype=np.int64)  # set for members: the owner they joined
        left, left_owner = members, owner[members]
        while True:
            same = self._same_ngram(proposals, fresh[left], fresh[left_owner])
            group[left[same]] = left_owner[same]
            left = left[~same]
            if left.size == 0:
                break
            owner_of_slot[slot[left]] = left
            left_owner = owner_of_slot[slot[left]]
        member_group = group[members]
        if (member_group == members).all():
            return None  # only hash collisions
        # Leader: the highest path prob of its group, then the first created.
        group_at = np.searchsorted(members, member_group)  # owners are members
        member_pp = path_prob[members]
        best_pp = np.full(members.size, -np.inf)
        np.maximum.at(best_pp, group_at, member_pp)
        is_best = member_pp == best_pp[group_at]
        leader = np.full(members.size, fresh.size, dtype=np.int64)
        np.minimum.at(leader, group_at[is_best], members[is_best])
        member_leader = leader[group_at]
        follows = (member_leader != members).nonzero()[0]
        return members[follows], member_leader[follows]

    def _same_ngram(self, proposals: _Proposals, candidate: np.ndarray, other: np.ndarray) -> np.ndarray:
        """bool: candidates of one request with equal (r+1)-grams (exact: the key is a packing
        for r <= 1, else the parents' contexts and the tokens are compared)."""
        if self.params.merge_ngram <= 1:
            return proposals.key[candidate] == proposals.key[other]
        parent_node = proposals.parent_node
        context, other_context = (self._context[parent_node[proposals.frontier_index(c)]] for c in (candidate, other))
        return (context == other_context).all(1) & (proposals.token[candidate] == proposals.token[other])

    def _update_merge_state(self, proposals: _Proposals, existing, existing_dst, new, added: _Front, follower,
                            follower_dst) -> None:
        """What later levels' merge rule reads: reachability (edges into existing nodes first,
        since they may change a frontier node's ancestors; then the new nodes inherit their
        parent's set; then edges into new nodes), keys, contexts and the hash sets."""
        num_rows, new_node = self._num_rows, added.node
        new_parent_node = proposals.parent_node[proposals.frontier_index(new)]
        self._add_reach_edges(proposals, existing, existing_dst)
        for word, own in zip(self._reach, self._own_reach):
            word[new_node] = word[new_parent_node] | own[added.row]
        if follower.size:
            src = proposals.parent_node[proposals.frontier_index(follower)]
            dst = proposals.cand_request[follower] * num_rows + follower_dst
            for word in self._reach:
                np.bitwise_or.at(word, dst, word[src])
        self._key[new_node] = proposals.key[new]
        self._seen[proposals.slot[new]] = True
        if self.params.merge_ngram >= 2:
            self._context[new_node, :-1] = self._context[new_parent_node, 1:]
            self._context[new_node, -1] = proposals.token[new]

    def _add_reach_edges(self, proposals: _Proposals, edge: np.ndarray, dst: np.ndarray) -> None:
        """Record pseudo edges (candidate ids `edge` into drafted rows `dst`) in the reachability
        sets, transitively: every node x reachable from dst (dst's bit is set in x's set) gains
        every node that reaches src.

        Edges of one level can chain (dst1 reaches src2), so repeat until no source's set grows
        (chains are short). Multiplying a uint64 word by a 0/1 mask selects it; an unbuffered OR
        (np.bitwise_or.at) merges the edges of one request.
        """
        if edge.size == 0:
            return
        pos = proposals.frontier_index(edge)
        request, src = proposals.cand_request[edge], proposals.parent[pos]
        reach = self._reach.reshape(self._reach.shape[0], self._batch, self._num_rows)  # [words, B, N+1]
        dst_word, dst_shift = self._bit_word[dst - 1], self._bit_shift[dst - 1][:, None]
        src_reach = reach[:, request, src]  # [words, E]: the nodes reaching src
        while True:
            below_dst = (reach[dst_word, request] >> dst_shift) & np.uint64(1)  # [E, N+1]
            for word, src_word in zip(reach, src_reach):
                np.bitwise_or.at(word, request, below_dst * src_word[:, None])
            # Converged once no source's set grew: a further pass could only add, to a node
            # below some dst, sets it already received through the source below that dst.
            new_src_reach = reach[:, request, src]
            if (new_src_reach == src_reach).all():
                return
            src_reach = new_src_reach

    def _add_nodes(self, proposals: _Proposals, new: np.ndarray, count: np.ndarray) -> _Front:
        """Store the new nodes (candidate ids `new`, ascending, `count` per request); their rows
        continue each request's numbering in creation order, and all of this level's nodes have
        depth = level. Returns them as a front."""
        pos = proposals.frontier_index(new)
        request = proposals.cand_request[new]
        row = (self._num_nodes + 1 - (count.cumsum() - count))[request] + np.arange(new.size)
        added = _Front(request, row, request * self._num_rows + row, proposals.token[new], proposals.path_prob[new])
        rank = proposals.rank(new, pos)
        prob = proposals.prob[new]
        node, parent_node = added.node, proposals.parent_node[pos]
        self._token.reshape(-1)[node] = added.token
        self._parent.reshape(-1)[node] = proposals.parent[pos]
        self._depth.reshape(-1)[node] = self._levels_expanded
        self._edge_prob.reshape(-1)[node] = prob
        self._path_prob.reshape(-1)[node] = added.path_prob
        self._child_rank.reshape(-1)[node] = rank
        self._num_nodes += count
        self._pending_words.append((node, parent_node))
        slot = parent_node * self.params.top_k + rank
        self._out_node[slot] = node
        self._out_prob[slot] = prob
        self._has_children[parent_node] = True
        return added

    def _add_pseudo_edges(self, proposals: _Proposals, edge: np.ndarray, dst: np.ndarray) -> None:
        """Record pseudo edges (candidate ids `edge` into rows `dst`) and the merge statistics."""
        if edge.size == 0:
            return
        pos = proposals.frontier_index(edge)
        request, rank, prob = proposals.cand_request[edge], proposals.rank(edge, pos), proposals.prob[edge]
        self._pseudo.append((request, proposals.parent[pos], dst, prob, rank))
        slot = proposals.parent_node[pos] * self.params.top_k + rank
        self._out_node[slot] = request * self._num_rows + dst
        self._out_prob[slot] = prob
        self._out_pseudo[slot] = True
        self._has_children[proposals.parent_node[pos]] = True
        self._num_merges += np.bincount(request, minlength=self._batch)
        saved = request if proposals.expandable is None else request[proposals.expandable[edge]]
        self._expansions_saved += np.bincount(saved, minlength=self._batch)

    # ---------------------------------------------------------------- snapshots

    def _snapshot(self, copy: bool) -> HypothesisGraph:
        if self._pseudo:
            pseudo = [np.concatenate(column) for column in zip(*self._pseudo)]
        else:
            pseudo = [_EMPTY] * 3 + [np.zeros(0, np.float64), _EMPTY]
        graph = HypothesisGraph(
            token_ids=self._token, parent_row=self._parent, depth=self._depth, edge_prob=self._edge_prob,
            path_prob=self._path_prob, child_rank=self._child_rank, num_nodes=self._num_nodes,
            pseudo_request=pseudo[0], pseudo_src=pseudo[1], pseudo_dst=pseudo[2],
            pseudo_prob=pseudo[3], pseudo_rank=pseudo[4],
            num_merges=self._num_merges, expansions_saved=self._expansions_saved,
            out_node=self._out_node, out_prob=self._out_prob, out_pseudo=self._out_pseudo,
            has_children=self._has_children,
        )
        if not copy:
            return graph
        return HypothesisGraph(**{name: value.copy() for name, value in vars(graph).items()})
