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

Budget: each level's new nodes compete for the request's remaining budget (N minus the nodes
already drafted) by path probability, ties in creation order. Nodes of earlier levels are never
evicted (their rows and draft KV are fixed), so the graph is the most likely nodes level by
level; the verification tree (unroll.py) then takes the exact top-N of the unrolled DAG.

Merges: a child token t of parent P becomes a pseudo edge P -> M when a drafted node M has the
same (r+1)-gram (its token t and the r tokens before it along its primary path, continuing into
the history), depth not compared, and the edge cannot close a cycle (see _match_existing).
Children of one level with the same n-gram collapse into one new node (the most likely one) and
pseudo edges to it. M is not expanded again for P: that is the draft work saved.

All bookkeeping is numpy on the CPU, vectorized over every frontier row of every request; the
Python loops are over levels, over the rare chains of same-level merges (reachability closure),
and a never-taken exact fallback for a 64-bit hash collision. Inputs may live on any device;
outputs are CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .ancestors import num_ancestor_words, own_bit_words_numpy
from .params import GraphParams

if TYPE_CHECKING:
    from .unroll import VerificationTree

_NO_ROW = np.iinfo(np.int64).max


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


def _ngram_key(gram: np.ndarray) -> np.ndarray:
    """int64 [...] key of int64 [..., L] n-grams; exact (a packing) when L <= 2, else a hash.

    Tokens are >= -1 and < 2^31, so token + 1 fits 32 bits and two tokens pack into one int64.
    """
    shifted = gram + 1
    if gram.shape[-1] == 1:
        return shifted[..., 0]
    if gram.shape[-1] == 2:
        return (shifted[..., 0] << 32) | shifted[..., 1]
    key = np.zeros(gram.shape[:-1], dtype=np.int64)
    with np.errstate(over="ignore"):
        for column in range(gram.shape[-1]):
            key = key * np.int64(1_000_003) + shifted[..., column]  # wraps mod 2^64 on purpose
    return key


def _small_ints(values: np.ndarray) -> np.ndarray:
    """The same integers as int16 when they fit, so numpy's stable sort uses radix sort."""
    if values.size and 0 <= values.min() and values.max() < 2**15:
        return values.astype(np.int16)
    return values


def order_by_request_desc(request: np.ndarray, value: np.ndarray, *finer: np.ndarray) -> np.ndarray:
    """Permutation sorting items by request ascending, then value descending, then each array of
    `finer` ascending (later = coarser), then original index. Stable argsorts, no lexsort."""
    order = np.arange(request.size)
    for key in finer:
        order = order[np.argsort(key[order], kind="stable")]
    order = order[np.argsort(-value[order], kind="stable")]
    return order[np.argsort(_small_ints(request[order]), kind="stable")]


def rank_within_request(request: np.ndarray, order: np.ndarray) -> np.ndarray:
    """rank[i] = position of item i in `order` counted from the first item of its request
    (`order` sorts items by request first)."""
    sorted_request = request[order]
    first = np.searchsorted(sorted_request, sorted_request, side="left")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size) - first
    return rank


def _own_bits64(num_rows: int) -> np.ndarray:
    """uint64 [num_rows, cdiv(num_rows, 64)]: row r has only bit r set."""
    words = np.zeros((num_rows, (num_rows + 63) // 64), dtype=np.uint64)
    rows = np.arange(num_rows)
    words[rows, rows // 64] = np.left_shift(np.uint64(1), (rows % 64).astype(np.uint64))
    return words


def _unpack_bits64(words: np.ndarray, num_rows: int) -> np.ndarray:
    """bool [..., num_rows] from uint64 bitsets [..., W] (bit m of word m // 64)."""
    as_bytes = np.ascontiguousarray(words).view(np.uint8)
    return np.unpackbits(as_bytes, axis=-1, bitorder="little")[..., :num_rows].astype(bool)


class GraphBuilder:
    """Drafts a batch of hypothesis graphs level by level (see the module docstring)."""

    def __init__(self, params: GraphParams, root_token_ids: torch.Tensor,
                 history_token_ids: torch.Tensor) -> None:
        """root_token_ids: int64 [B], the last sampled token of each request (graph row 0).
        history_token_ids: int64 [B, H], the tokens just before the root, left-padded with -1;
        only its last merge_ngram columns are used (the r-gram of shallow nodes).
        """
        self.params = params
        roots = root_token_ids.detach().to("cpu", torch.int64).numpy()
        batch = roots.shape[0]
        budget = params.node_budget
        num_rows = budget + 1
        self._batch, self._budget, self._num_rows = batch, budget, num_rows

        self._token = np.full((batch, num_rows), -1, dtype=np.int64)
        self._token[:, 0] = roots
        self._parent = np.full((batch, num_rows), -1, dtype=np.int64)
        self._depth = np.zeros((batch, num_rows), dtype=np.int64)
        self._edge_prob = np.zeros((batch, num_rows), dtype=np.float64)
        self._edge_prob[:, 0] = 1.0
        self._path_prob = np.zeros((batch, num_rows), dtype=np.float64)
        self._path_prob[:, 0] = 1.0
        self._child_rank = np.full((batch, num_rows), -1, dtype=np.int64)
        self._num_nodes = np.zeros(batch, dtype=np.int64)
        self._num_merges = np.zeros(batch, dtype=np.int64)
        self._expansions_saved = np.zeros(batch, dtype=np.int64)
        # Primary-tree ancestor words: padding rows keep only their own bit (contracts.md).
        self._draft_words = np.broadcast_to(
            own_bit_words_numpy(num_rows), (batch, num_rows, num_ancestor_words(num_rows))).copy()
        # Bitset over rows (uint64 words): bit m of reach[b, x] is set iff node m reaches node x
        # in the DAG (primary + pseudo edges), or m == x.
        self._reach_words = (num_rows + 63) // 64
        self._own_reach = _own_bits64(num_rows)
        self._reach = np.broadcast_to(self._own_reach, (batch, num_rows, self._reach_words)).copy()

        merge_ngram = params.merge_ngram
        if merge_ngram >= 0:
            # gram[b, g] = the (r+1) tokens ending at node g along its primary path (into history).
            history = history_token_ids.detach().to("cpu", torch.int64).numpy().reshape(batch, -1)
            context = np.full((batch, merge_ngram), -1, dtype=np.int64)
            take = min(merge_ngram, history.shape[1])
            if take:
                context[:, merge_ngram - take:] = history[:, history.shape[1] - take:]
            self._gram = np.full((batch, num_rows, merge_ngram + 1), -1, dtype=np.int64)
            self._gram[:, 0, :merge_ngram] = context
            self._gram[:, 0, merge_ngram] = roots
            self._key = np.zeros((batch, num_rows), dtype=np.int64)
            self._key[:, 0] = _ngram_key(self._gram[:, 0])

        self._pseudo: list[tuple[np.ndarray, ...]] = []
        self._levels_expanded = 0
        self._frontier_request = np.arange(batch, dtype=np.int64)
        self._frontier_row = np.zeros(batch, dtype=np.int64)

    # ---------------------------------------------------------------- engine-facing API

    def frontier(self) -> Frontier | None:
        """The rows to draft next, or None when drafting is over."""
        if self._frontier_request.size == 0 or self._levels_expanded >= self.params.max_depth:
            return None
        request, row = self._frontier_request, self._frontier_row
        return Frontier(
            request_index=torch.from_numpy(request.copy()),
            node_row=torch.from_numpy(row.copy()),
            depth=torch.from_numpy(self._depth[request, row]),
            token_ids=torch.from_numpy(self._token[request, row]),
        )

    @property
    def draft_ancestor_words(self) -> torch.Tensor:
        """int32 [B, N + 1, W]: primary-tree ancestor bitmask over graph rows (a copy: the
        builder keeps writing its own array, and the engine may still be copying this one)."""
        return torch.from_numpy(self._draft_words.copy())

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
        params = self.params
        request, parent = self._frontier_request, self._frontier_row
        num_frontier = request.size
        if num_frontier == 0:
            raise RuntimeError("expand() called with an empty frontier")
        tokens = topk_token_ids.detach().to("cpu", torch.int64).numpy()[:, : params.top_k]
        probs = topk_probs.detach().to("cpu", torch.float64).numpy()[:, : params.top_k]
        if tokens.shape[0] != num_frontier or probs.shape != tokens.shape:
            raise ValueError(f"expected [{num_frontier}, k] top-k tensors, got {tuple(tokens.shape)} "
                             f"and {tuple(probs.shape)}")
        width = tokens.shape[1]
        self._levels_expanded += 1

        # --- pruning: sibling ratio, bad ids, duplicate ids within a row (first one wins).
        valid = (probs >= params.min_child_ratio * probs[:, :1]) & (probs > 0) & (tokens >= 0)
        if width > 1:
            sorted_tokens = np.sort(tokens, axis=1)
            if (sorted_tokens[:, 1:] == sorted_tokens[:, :-1]).any():  # rare: only then the k^2 check
                earlier_same = (tokens[:, :, None] == tokens[:, None, :]) & np.tri(width, k=-1, dtype=bool)
                valid &= ~earlier_same.any(-1)
        cand_pp = self._path_prob[request, parent][:, None] * probs  # [F, k]
        expandable_child = (probs >= params.leaf_prob) & (self._levels_expanded < params.max_depth)

        # --- merge rule.
        merge_existing = np.zeros((num_frontier, width), dtype=bool)
        merge_target = np.zeros((num_frontier, width), dtype=np.int64)
        if params.merging:
            cand_gram = np.concatenate(
                [np.broadcast_to(self._gram[request, parent][:, None, 1:], (num_frontier, width, params.merge_ngram)),
                 tokens[:, :, None]], axis=-1)  # [F, k, r+1]
            cand_key = _ngram_key(cand_gram)
            if self._num_nodes.any():
                merge_existing, merge_target = self._match_existing(request, parent, valid, cand_gram, cand_key)
        else:
            cand_gram = tokens[:, :, None]
            cand_key = tokens

        # --- new-node candidates: same-level duplicates (same request and n-gram) collapse into
        # a leader (highest path prob, then first in creation order); the others merge into it.
        flat_index = np.arange(num_frontier * width, dtype=np.int64).reshape(num_frontier, width)
        fresh = valid & ~merge_existing
        fresh_flat = flat_index[fresh]
        fresh_request = np.repeat(request, width).reshape(num_frontier, width)[fresh]
        fresh_pp = cand_pp[fresh]
        leader_of = fresh_flat.copy()  # flat index of each fresh candidate's leader
        if params.merging and fresh_flat.size > 1:
            leader_of = self._same_level_leaders(fresh_flat, fresh_request, fresh_pp, cand_key[fresh], cand_gram[fresh])
        is_leader = leader_of == fresh_flat

        # --- budget: leaders compete per request by path prob (ties: creation order).
        leader_flat = fresh_flat[is_leader]
        leader_request = fresh_request[is_leader]
        leader_pp = fresh_pp[is_leader]
        remaining = self._budget - self._num_nodes
        if (np.bincount(leader_request, minlength=self._batch) <= remaining).all():
            kept_leader = np.ones(leader_flat.size, dtype=bool)  # everyone fits
        else:
            rank = rank_within_request(leader_request, order_by_request_desc(leader_request, leader_pp))
            kept_leader = rank < remaining[leader_request]
        new_flat = leader_flat[kept_leader]  # ascending = creation order, grouped by request
        new_request = leader_request[kept_leader]

        # --- rows of the new nodes.
        per_request = np.bincount(new_request, minlength=self._batch)
        request_offset = np.cumsum(per_request) - per_request
        new_row = self._num_nodes[new_request] + 1 + (np.arange(new_flat.size) - request_offset[new_request])
        new_frontier_pos, new_rank = np.divmod(new_flat, width)
        new_parent = parent[new_frontier_pos]
        row_of_flat = np.full(num_frontier * width, -1, dtype=np.int64)
        row_of_flat[new_flat] = new_row

        # --- pseudo edges: into existing nodes, and into same-level leaders that were kept.
        follower = ~is_leader
        follower_flat = fresh_flat[follower]
        follower_dst = row_of_flat[leader_of[follower]]
        follower_flat, follower_dst = follower_flat[follower_dst >= 0], follower_dst[follower_dst >= 0]
        existing_flat = flat_index[merge_existing]
        existing_dst = merge_target[merge_existing]
        existing_pos, existing_rank = np.divmod(existing_flat, width)
        follower_pos, follower_rank = np.divmod(follower_flat, width)

        # Reachability: edges into existing nodes first (they may change a frontier node's
        # ancestors), then new nodes inherit their parent's set, then edges into new nodes.
        self._add_reach_edges(request[existing_pos], parent[existing_pos], existing_dst)
        self._write_new_nodes(new_request, new_row, new_parent, tokens[new_frontier_pos, new_rank],
                              probs[new_frontier_pos, new_rank], new_rank,
                              cand_gram[new_frontier_pos, new_rank] if params.merging else None,
                              cand_key[new_frontier_pos, new_rank] if params.merging else None)
        self._add_reach_edges_into_new(request[follower_pos], parent[follower_pos], follower_dst)

        edge_pos = np.concatenate([existing_pos, follower_pos])
        edge_rank = np.concatenate([existing_rank, follower_rank])
        edge_request = request[edge_pos]
        if edge_pos.size:
            self._pseudo.append((edge_request, parent[edge_pos], np.concatenate([existing_dst, follower_dst]),
                                 probs[edge_pos, edge_rank], edge_rank))
            self._num_merges += np.bincount(edge_request, minlength=self._batch)
            saved = expandable_child[edge_pos, edge_rank]
            self._expansions_saved += np.bincount(edge_request[saved], minlength=self._batch)

        # --- next frontier: new nodes that are not leaves.
        # A request whose graph is full stops drafting: its children could only be merges.
        next_mask = expandable_child[new_frontier_pos, new_rank] & (self._num_nodes[new_request] < self._budget)
        self._frontier_request = new_request[next_mask]
        self._frontier_row = new_row[next_mask]

    def graph(self) -> HypothesisGraph:
        """A copy of the graph built so far."""
        if self._pseudo:
            pseudo = [np.concatenate(column) for column in zip(*self._pseudo)]
        else:
            pseudo = [np.zeros(0, np.int64)] * 3 + [np.zeros(0, np.float64), np.zeros(0, np.int64)]
        return HypothesisGraph(
            token_ids=self._token.copy(), parent_row=self._parent.copy(), depth=self._depth.copy(),
            edge_prob=self._edge_prob.copy(), path_prob=self._path_prob.copy(),
            child_rank=self._child_rank.copy(), num_nodes=self._num_nodes.copy(),
            pseudo_request=pseudo[0], pseudo_src=pseudo[1], pseudo_dst=pseudo[2],
            pseudo_prob=pseudo[3], pseudo_rank=pseudo[4],
            num_merges=self._num_merges.copy(), expansions_saved=self._expansions_saved.copy(),
        )

    def build_tree(self) -> VerificationTree:
        """Unroll the graph into the flattened verification tree (see unroll.unroll_graph)."""
        from .unroll import unroll_graph

        return unroll_graph(self.graph(), self._budget)

    # ---------------------------------------------------------------- internals

    def _match_existing(self, request, parent, valid, cand_gram, cand_key):
        """For each candidate [F, k]: may it merge into an existing node, and which one.

        A target M has the candidate's n-gram (same token and same r preceding tokens), is a
        drafted node, does not reach the parent P (else P -> M closes a cycle), and passes the
        same-level ordering rule: every frontier node reachable from M that also has a merge
        candidate must have a larger row than P. Any cycle made of this level's pseudo edges
        P1 -> M1 ~> P2 -> M2 ~> ... ~> P1 would need rows P1 < P2 < ... < P1, so none exists.
        Among allowed targets the one with the highest path prob (then lowest row) wins.

        Sparse: candidates and drafted nodes are joined on a hash of (request, n-gram key) by
        binary search; every hash hit is then confirmed exactly.
        """
        num_frontier, width = valid.shape
        merge_existing = np.zeros((num_frontier, width), dtype=bool)
        merge_target = np.zeros((num_frontier, width), dtype=np.int64)
        rows = np.arange(self._num_rows)
        drafted = (rows[None, :] >= 1) & (rows[None, :] <= self._num_nodes[:, None])
        node_request, node_row = np.nonzero(drafted)
        cand_f, cand_j = np.nonzero(valid)
        if node_row.size == 0 or cand_f.size == 0:
            return merge_existing, merge_target
        cand_request = request[cand_f]
        with np.errstate(over="ignore"):
            node_hash = self._key[node_request, node_row] * np.int64(0x9E3779B1) + node_request
            cand_hash = cand_key[cand_f, cand_j] * np.int64(0x9E3779B1) + cand_request
        node_order = np.argsort(node_hash)
        sorted_hash = node_hash[node_order]
        low = np.searchsorted(sorted_hash, cand_hash, side="left")
        count = np.searchsorted(sorted_hash, cand_hash, side="right") - low
        if not count.any():
            return merge_existing, merge_target
        pair_cand = np.repeat(np.arange(cand_f.size), count)
        pair_node = node_order[np.repeat(low - (np.cumsum(count) - count), count) + np.arange(pair_cand.size)]
        pair_f, pair_j = cand_f[pair_cand], cand_j[pair_cand]
        pair_request, pair_m = node_request[pair_node], node_row[pair_node]
        exact = (pair_request == cand_request[pair_cand]) & \
            (self._gram[pair_request, pair_m] == cand_gram[pair_f, pair_j]).all(-1)
        pair_f, pair_j, pair_request, pair_m = pair_f[exact], pair_j[exact], pair_request[exact], pair_m[exact]
        pair_parent = parent[pair_f]
        # M must not reach P.
        reach_word = self._reach[pair_request, pair_parent, pair_m // 64]
        allowed = ((reach_word >> (pair_m % 64).astype(np.uint64)) & np.uint64(1)) == 0
        pair_f, pair_j, pair_request, pair_m, pair_parent = (
            pair_f[allowed], pair_j[allowed], pair_request[allowed], pair_m[allowed], pair_parent[allowed])
        if pair_f.size == 0:
            return merge_existing, merge_target
        # Ordering rule against same-level cycles.
        source = np.unique(pair_f)
        source_reach = _unpack_bits64(self._reach[request[source], parent[source]], self._num_rows)  # [S, R]
        reach_s, reach_m = np.nonzero(source_reach)
        min_source_row = np.full((self._batch, self._num_rows), _NO_ROW, dtype=np.int64)
        np.minimum.at(min_source_row, (request[source][reach_s], reach_m), parent[source][reach_s])
        allowed = min_source_row[pair_request, pair_m] > pair_parent
        pair_f, pair_j, pair_request, pair_m = pair_f[allowed], pair_j[allowed], pair_request[allowed], pair_m[allowed]
        # Best target per candidate: highest path prob, then lowest row.
        pair_cand = pair_f * width + pair_j
        order = np.lexsort((pair_m, -self._path_prob[pair_request, pair_m], pair_cand))
        best = order[np.r_[True, pair_cand[order][1:] != pair_cand[order][:-1]]]
        merge_existing[pair_f[best], pair_j[best]] = True
        merge_target[pair_f[best], pair_j[best]] = pair_m[best]
        return merge_existing, merge_target

    def _same_level_leaders(self, flat, request, path_prob, key, gram):
        """Leader (flat index) of each new-node candidate: candidates of one request with the same
        n-gram collapse into the one with the highest path prob (then the first created)."""
        with np.errstate(over="ignore"):
            group_hash = key * np.int64(0x9E3779B1) + request
        order = np.argsort(group_hash, kind="stable")
        sorted_hash = group_hash[order]
        new_group = np.r_[True, sorted_hash[1:] != sorted_hash[:-1]]
        if new_group.all():  # no duplicates this level
            return flat
        starts = np.flatnonzero(new_group)
        group_of = np.cumsum(new_group) - 1
        best_pp = np.maximum.reduceat(path_prob[order], starts)
        first_best = np.minimum.reduceat(np.where(path_prob[order] == best_pp[group_of], flat[order], _NO_ROW), starts)
        leader_of = np.empty_like(flat)
        leader_of[order] = first_best[group_of]
        # A hash collision would group different n-grams: confirm against the leader, and in
        # that (astronomically rare) case fall back to exact grouping.
        position = np.searchsorted(flat, leader_of)
        if not ((request[position] == request).all() and (gram[position] == gram).all()):
            leader_of = flat.copy()
            for index in range(flat.size):  # exact fallback, never taken in practice
                same = np.flatnonzero((request == request[index]) & (gram == gram[index]).all(-1))
                best = same[path_prob[same] == path_prob[same].max()]
                leader_of[index] = flat[best].min()
        return leader_of

    def _add_reach_edges(self, edge_request, src, dst) -> None:
        """Record pseudo edges src -> dst in the reachability matrix (transitively).

        Every node reachable from dst gains everything that reaches src. Edges of one batch can
        chain (dst1 reaches src2), so repeat until nothing changes (chains are short). Multiplying
        a uint64 word by a 0/1 mask selects it; OR-reduction per request merges the edges.
        """
        if edge_request.size == 0:
            return
        order = np.lexsort((dst, edge_request))
        edge_request, src, dst = edge_request[order], src[order], dst[order]
        starts = np.flatnonzero(np.r_[True, edge_request[1:] != edge_request[:-1]])
        touched = edge_request[starts]
        dst_word, dst_shift = dst // 64, (dst % 64).astype(np.uint64)
        src_reach = self._reach[edge_request, src]  # [E, W]: m reaching src
        while True:
            request_reach = self._reach[edge_request]  # [E, R, W]
            dst_words = np.take_along_axis(request_reach, dst_word[:, None, None], axis=2)[:, :, 0]
            below_dst = (dst_words >> dst_shift[:, None]) & np.uint64(1)  # [E, R]: x reachable from dst
            gained = np.bitwise_or.reduceat(below_dst[:, :, None] * src_reach[:, None, :], starts, axis=0)
            self._reach[touched] |= gained
            # Converged once no source's set grew: a further pass could only add, to a node
            # below some dst, sets it already received through the source below that dst.
            new_src_reach = self._reach[edge_request, src]
            if np.array_equal(new_src_reach, src_reach):
                return
            src_reach = new_src_reach

    def _write_new_nodes(self, new_request, new_row, new_parent, new_token, new_prob, new_rank,
                         new_gram, new_key) -> None:
        """Store the new nodes; flat (request * R + row) indices keep the numpy work per array to
        one gather or scatter."""
        if new_row.size == 0:
            return
        num_rows = self._num_rows
        node = new_request * num_rows + new_row
        parent = new_request * num_rows + new_parent
        self._token.reshape(-1)[node] = new_token
        self._parent.reshape(-1)[node] = new_parent
        self._depth.reshape(-1)[node] = self._depth.reshape(-1)[parent] + 1
        self._edge_prob.reshape(-1)[node] = new_prob
        self._path_prob.reshape(-1)[node] = self._path_prob.reshape(-1)[parent] * new_prob
        self._child_rank.reshape(-1)[node] = new_rank
        words = self._draft_words.reshape(self._batch * num_rows, -1)
        words[node] |= words[parent]
        if new_gram is not None:
            reach = self._reach.reshape(self._batch * num_rows, -1)
            reach[node] = reach[parent] | self._own_reach[new_row]
            self._gram.reshape(self._batch * num_rows, -1)[node] = new_gram
            self._key.reshape(-1)[node] = new_key
        self._num_nodes += np.bincount(new_request, minlength=self._batch)

    def _add_reach_edges_into_new(self, edge_request, src, dst) -> None:
        """Pseudo edges into this level's new nodes: those have no descendants yet, so only
        their own reach rows gain the sources' sets (no closure needed)."""
        if edge_request.size == 0:
            return
        reach = self._reach.reshape(self._batch * self._num_rows, -1)
        np.bitwise_or.at(reach, edge_request * self._num_rows + dst, reach[edge_request * self._num_rows + src])
