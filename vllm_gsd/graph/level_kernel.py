"""One level of hypothesis-graph drafting, compiled: steps 1-5 of graph/builder.py's docstring.

Contract::

    num_next, num_pseudo = expand_level(rule, front, tokens, probs, nodes, edges, counts,
                                        draft_words, merge, next_front, pseudo)

For every request of the frontier `front` (grouped by request, rows ascending), given the draft's
top-k of each frontier row (tokens, probs [F, w]), the level's new nodes are written into the
builder's arrays in place (nodes, edges, counts, draft_words, merge), the next frontier into
next_front[:num_next], and the level's pseudo edges into pseudo[:num_pseudo]: the merges into
drafted nodes, then the edges of same-level duplicates to their leaders, each in creation order.
The caller allocates every output ([F * w] each): arrays returned would each cost a microsecond
to hand to Python.

It runs compiled (numba, as vLLM's n-gram proposer does): its work is a few loads and compares
per candidate, which as numpy calls would cost about a microsecond each. Each step runs over
every request in turn; a request's steps touch only its own rows. The merge rule's n-gram table
and reachability sets are merge_index.py's. Every array is flat by node id b * (N + 1) + row
unless said otherwise.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from .merge_index import (add_reach_edge, child_hash, find_drafted, first_slot, insert_drafted, or_into, reaches,
                          same_tokens)
from .ordering import keep_best


class LevelRule(NamedTuple):
    """The graph's knobs (GraphParams) and the level being drafted."""

    node_budget: int  # N: the most drafted nodes per request
    top_k: int
    merge_ngram: int  # r; < 0: merging off
    min_child_ratio: float
    leaf_prob: float
    level: int  # the new nodes' depth (1: the roots' children)
    last_level: bool  # the new nodes are leaves
    hash_multiplier: np.uint64  # of the n-gram hash (Fibonacci hashing)


class Front(NamedTuple):
    """Frontier rows [F], grouped by request, rows ascending."""

    request: np.ndarray  # int64
    row: np.ndarray  # int64: graph row within its request (0: the root)
    token: np.ndarray  # int64
    path_prob: np.ndarray  # float64: the draft's probability of the path to the node


class NodeArrays(NamedTuple):
    """The graph's nodes [B * (N + 1)] (-1 / 0 where a row holds none)."""

    token: np.ndarray  # int64
    parent: np.ndarray  # int64: primary parent row
    depth: np.ndarray  # int64: primary depth
    edge_prob: np.ndarray  # float64: the draft's probability of the node given its parent
    path_prob: np.ndarray  # float64
    child_rank: np.ndarray  # int64: its top-k column under its parent


class EdgeArrays(NamedTuple):
    """Every edge (primary and pseudo) by source node and top-k rank: index node * top_k + rank."""

    out_node: np.ndarray  # int64 [B * (N + 1) * top_k]: the edge's destination node (-1: none)
    out_prob: np.ndarray  # float64 [B * (N + 1) * top_k]
    out_pseudo: np.ndarray  # bool [B * (N + 1) * top_k]
    has_children: np.ndarray  # bool [B * (N + 1)]


class RequestCounts(NamedTuple):
    """Per request, int64 [B]."""

    num_nodes: np.ndarray  # drafted nodes (the root excluded)
    num_merges: np.ndarray  # pseudo edges
    expansions_saved: np.ndarray  # pseudo edges whose source would have been expanded


class MergeState(NamedTuple):
    """The merge rule's state (placeholders of one element when merging is off).

    gram [B*(N+1), r+1]: the r+1 tokens ending at the node along its primary path, continuing
    into the history (-1 before it); a child of P proposing t has the n-gram (gram[P, 1:], t).
    drafted_table [B, T]: per request an open-addressing table of the drafted nodes' n-grams,
    each slot the first row of a chain (0 = empty); next_same [B*(N+1)] the next row of its chain.
    reach [B*(N+1), ceil(N/64)] uint64: bit m-1 of reach[x] is set iff drafted node m reaches
    x in the DAG (primary + pseudo edges), m == x included; the root is left out (it reaches
    every node and no edge enters it).
    level_first, level_stamp [T']: scratch table of one request's new n-grams at one level.
    """

    gram: np.ndarray
    drafted_table: np.ndarray
    next_same: np.ndarray
    reach: np.ndarray
    level_first: np.ndarray
    level_stamp: np.ndarray


class PseudoEdges(NamedTuple):
    """Pseudo edges [P]: request b's node src_row -> dst_row, the draft's top-k column `rank` of src."""

    request: np.ndarray  # int64
    src_row: np.ndarray  # int64
    dst_row: np.ndarray  # int64
    prob: np.ndarray  # float64
    rank: np.ndarray  # int64


class _Candidates(NamedTuple):
    """Scratch per proposed child, c = f * width + j for column j of frontier row f."""

    valid: np.ndarray  # bool: survives pruning
    expandable: np.ndarray  # bool: not a leaf
    path_prob: np.ndarray  # float64
    ngram_hash: np.ndarray  # uint64 (merging only)
    target: np.ndarray  # int64: the drafted row it merges into (0: none)
    leader: np.ndarray  # int64: the same-level candidate it collapses into (itself: none)
    new_row: np.ndarray  # int64: its row as a new node (0: none)
    leaders: np.ndarray  # int64: step 4's list of one request's leaders


def expand_level(rule: LevelRule, front: Front, tokens: np.ndarray, probs: np.ndarray, nodes: NodeArrays,
                 edges: EdgeArrays, counts: RequestCounts, draft_words: np.ndarray, merge: MergeState,
                 next_front: Front, pseudo: PseudoEdges) -> tuple[int, int]:
    """One level for every request of the front (see the module docstring). Returns
    (num_next, num_pseudo)."""
    # Numba types a plain tuple argument in C but a named one in Python, a few microseconds a
    # call: the named tuples cross as plain ones and are named again inside.
    return _expand_level(tuple(rule), tuple(front), tokens, probs, tuple(nodes), tuple(edges), tuple(counts),
                         draft_words, tuple(merge), tuple(next_front), tuple(pseudo))


@njit(cache=True, nogil=True, error_model="numpy")
def _expand_level(rule, front, tokens, probs, nodes, edges, counts, draft_words, merge, next_front, pseudo):
    """expand_level, its named tuples as plain ones. Each step runs over every request before
    the next step starts (a request's steps touch only its own rows; one call a step, not one a
    request, keeps the calls' many arguments off the per-request path)."""
    rule, front, nodes, edges = LevelRule(*rule), Front(*front), NodeArrays(*nodes), EdgeArrays(*edges)
    counts, merge = RequestCounts(*counts), MergeState(*merge)
    next_front, pseudo = Front(*next_front), PseudoEdges(*pseudo)
    n = tokens.size
    cand = _Candidates(np.zeros(n, np.bool_), np.zeros(n, np.bool_), np.empty(n), np.empty(n, np.uint64),
                       np.zeros(n, np.int64), np.empty(n, np.int64), np.zeros(n, np.int64), np.empty(n, np.int64))
    starts = _request_starts(front.request)
    _propose(rule, front, tokens, probs, merge.gram, cand)
    if rule.merge_ngram >= 0:
        _merge_targets(rule, starts, front, tokens, nodes.path_prob, counts, merge, cand)
        _same_level_leaders(rule, starts, front, tokens, counts, merge, cand)
    _add_new_nodes(rule, starts, front, tokens, probs, nodes, edges, counts, draft_words, merge, cand)
    num_pseudo = _add_pseudo_edges(rule, starts, front, probs, edges, counts, merge.reach, cand, pseudo)
    num_next = _add_next_front(rule, starts, front, tokens, counts, cand, next_front)
    return num_next, num_pseudo


@njit(cache=True, nogil=True, error_model="numpy")
def _request_starts(front_request):
    """int64 [R + 1]: the frontier rows of the front's r-th request are starts[r]..starts[r+1]-1."""
    starts = np.empty(front_request.size + 1, np.int64)
    num_requests = 0
    for f in range(front_request.size):
        if f == 0 or front_request[f] != front_request[f - 1]:
            starts[num_requests] = f
            num_requests += 1
    starts[num_requests] = front_request.size
    return starts[:num_requests + 1]


@njit(cache=True, nogil=True, error_model="numpy")
def _propose(rule, front, tokens, probs, gram, cand):
    """Step 1: each frontier row's top-k children, pruned by the sibling ratio, bad ids and
    repeated ids; their path probs, and their n-grams' hashes."""
    num_frontier, width = tokens.shape
    merging = rule.merge_ngram >= 0
    for f in range(num_frontier):
        parent_node = front.request[f] * (rule.node_budget + 1) + front.row[f]
        for j in range(width):
            c = f * width + j
            t, p = tokens[f, j], probs[f, j]
            ok = p > 0 and t >= 0 and (rule.min_child_ratio <= 0 or p >= rule.min_child_ratio * probs[f, 0])
            for earlier in range(j):
                ok = ok and tokens[f, earlier] != t  # the first of repeated ids wins
            cand.valid[c] = ok
            cand.expandable[c] = not rule.last_level and (rule.leaf_prob <= 0 or p >= rule.leaf_prob)
            cand.path_prob[c] = front.path_prob[f] * p
            cand.target[c] = cand.new_row[c] = 0
            cand.leader[c] = c
            if merging and ok:
                cand.ngram_hash[c] = child_hash(gram, parent_node, t, rule.hash_multiplier)


@njit(cache=True, nogil=True, error_model="numpy")
def _add_new_nodes(rule, starts, front, tokens, probs, nodes, edges, counts, draft_words, merge, cand):
    """Step 4: per request, the leaders (valid, no merge target, first of their n-gram) that fit
    its remaining budget, best path prob first, ties in creation order, become nodes, rows in
    creation order."""
    width = tokens.shape[1]
    gram, reach = merge.gram, merge.reach
    for r in range(starts.size - 1):
        first, end = starts[r], starts[r + 1]
        b = front.request[first]
        base, drafted = b * (rule.node_budget + 1), counts.num_nodes[b]
        num_leaders = 0
        for c in range(first * width, end * width):
            if cand.valid[c] and cand.target[c] == 0 and cand.leader[c] == c:
                cand.leaders[num_leaders] = c
                num_leaders += 1
        kept = cand.leaders[:num_leaders]
        if num_leaders > rule.node_budget - drafted:
            kept = keep_best(kept, cand.path_prob, rule.node_budget - drafted)
        # Only a request that goes on drafting (it has room and a new node that is not a leaf)
        # needs their merge state.
        goes_on = rule.merge_ngram >= 0 and drafted + kept.size < rule.node_budget
        if goes_on:
            goes_on = False
            for c in kept:
                goes_on = goes_on or cand.expandable[c]
        for i in range(kept.size):
            c = kept[i]
            f, j = c // width, c % width
            row = drafted + 1 + i
            node, parent_node = base + row, base + front.row[f]
            cand.new_row[c] = row
            nodes.token[node], nodes.parent[node], nodes.depth[node] = tokens[f, j], front.row[f], rule.level
            nodes.child_rank[node], nodes.edge_prob[node], nodes.path_prob[node] = j, probs[f, j], cand.path_prob[c]
            edge = parent_node * rule.top_k + j
            edges.out_node[edge], edges.out_prob[edge] = node, probs[f, j]
            edges.has_children[parent_node] = True
            for w in range(draft_words.shape[1]):
                draft_words[node, w] |= draft_words[parent_node, w]
            if goes_on:  # what later levels' merge rule reads
                gram[node, :rule.merge_ngram] = gram[parent_node, 1:]
                gram[node, rule.merge_ngram] = tokens[f, j]
                for w in range(reach.shape[1]):
                    reach[node, w] = reach[parent_node, w]
                reach[node, (row - 1) >> 6] |= np.uint64(1) << np.uint64((row - 1) & 63)
                insert_drafted(b, base, row, cand.ngram_hash[c], gram, merge.drafted_table, merge.next_same)
        counts.num_nodes[b] = drafted + kept.size


@njit(cache=True, nogil=True, error_model="numpy")
def _add_pseudo_edges(rule, starts, front, probs, edges, counts, reach, cand, pseudo):
    """The level's pseudo edges, request by request: merges into drafted nodes, then the edges
    of duplicates into their kept leaders, each in creation order. Returns how many."""
    # Merges fill `pseudo` from the front, duplicates from the back (moved behind the merges at
    # the end).
    width = probs.shape[1]
    last = probs.size - 1
    num_merges = num_duplicates = 0
    for r in range(starts.size - 1):
        first, end = starts[r], starts[r + 1]
        b = front.request[first]
        base = b * (rule.node_budget + 1)
        for f in range(first, end):
            src_node = base + front.row[f]
            for j in range(width):
                c = f * width + j
                if cand.valid[c] and cand.target[c]:
                    dst, at = cand.target[c], num_merges
                    num_merges += 1
                elif cand.valid[c] and cand.target[c] == 0 and cand.leader[c] != c and cand.new_row[cand.leader[c]]:
                    dst, at = cand.new_row[cand.leader[c]], last - num_duplicates
                    num_duplicates += 1
                    or_into(reach, base + dst, src_node)  # a new node: nothing below it yet
                else:
                    continue
                pseudo.request[at], pseudo.src_row[at], pseudo.dst_row[at] = b, front.row[f], dst
                pseudo.rank[at], pseudo.prob[at] = j, probs[f, j]
                edge = src_node * rule.top_k + j
                edges.out_node[edge], edges.out_prob[edge], edges.out_pseudo[edge] = base + dst, probs[f, j], True
                edges.has_children[src_node] = True
                counts.num_merges[b] += 1
                if cand.expandable[c]:
                    counts.expansions_saved[b] += 1
    start = last + 1 - num_duplicates
    for column in (pseudo.request, pseudo.src_row, pseudo.dst_row, pseudo.rank):
        _reverse_and_move(column, start, last, num_merges)
    _reverse_and_move(pseudo.prob, start, last, num_merges)
    return num_merges + num_duplicates


@njit(cache=True, nogil=True, error_model="numpy")
def _reverse_and_move(column, start, last, to):
    """column[to:to + n] = column[start:last + 1] reversed, n = last + 1 - start, to <= start
    (each moves to a lower index, in ascending order: none is overwritten before it moves)."""
    n = last + 1 - start
    for i in range(n // 2):
        column[start + i], column[last - i] = column[last - i], column[start + i]
    for i in range(n):
        column[to + i] = column[start + i]


@njit(cache=True, nogil=True, error_model="numpy")
def _add_next_front(rule, starts, front, tokens, counts, cand, next_front):
    """Step 5: the new nodes that are not leaves form the next frontier, unless their request's
    graph is full (else every such node has its merge state). Returns how many."""
    width = tokens.shape[1]
    num_next = 0
    for r in range(starts.size - 1):
        first, end = starts[r], starts[r + 1]
        b = front.request[first]
        if counts.num_nodes[b] >= rule.node_budget:
            continue
        for c in range(first * width, end * width):  # kept nodes in creation order: rows ascending
            if cand.new_row[c] and cand.expandable[c]:
                next_front.request[num_next], next_front.row[num_next] = b, cand.new_row[c]
                next_front.token[num_next] = tokens[c // width, c % width]
                next_front.path_prob[num_next] = cand.path_prob[c]
                num_next += 1
    return num_next


@njit(cache=True, nogil=True, error_model="numpy")
def _merge_targets(rule, starts, front, tokens, path_prob, counts, merge, cand):
    """Step 2, for each request with drafted nodes: cand.target[c] = the drafted row candidate c
    merges into, or 0, and each such pseudo edge recorded in merge.reach.

    A target M has the candidate's n-gram, does not reach the parent P (else P -> M closes a
    cycle), and passes the same-level ordering rule: no frontier row P' < P that has a
    cycle-free pair of its own is reachable from M. Any cycle of this level's pseudo edges
    P1 -> M1 ~> P2 -> M2 ~> ... ~> P1 would need rows P1 < P2 < ... < P1, so none exists.
    Among allowed targets the one with the highest path prob (then the lowest row) wins.
    """
    width = tokens.shape[1]
    reach, next_same = merge.reach, merge.next_same
    head = np.zeros(tokens.size, np.int64)  # first row of the candidate's chain
    sources = np.empty(tokens.shape[0], np.int64)  # a request's frontier rows with a cycle-free pair, ascending
    for r in range(starts.size - 1):
        first, end = starts[r], starts[r + 1]
        b = front.request[first]
        base, drafted = b * (rule.node_budget + 1), counts.num_nodes[b]
        if drafted == 0:
            continue
        num_sources = 0
        for f in range(first, end):
            parent_node = base + front.row[f]
            has_pair = False
            for j in range(width):
                c = f * width + j
                if not cand.valid[c]:
                    continue
                m = find_drafted(b, base, parent_node, tokens[f, j], cand.ngram_hash[c], merge.gram,
                                  merge.drafted_table)
                head[c] = m
                while m and not has_pair:
                    has_pair = not reaches(reach, parent_node, m)
                    m = next_same[base + m]
            if has_pair:
                sources[num_sources] = front.row[f]
                num_sources += 1
        if num_sources == 0:
            continue
        for f in range(first, end):
            parent_row = front.row[f]
            parent_node = base + parent_row
            for j in range(width):
                c = f * width + j
                m = head[c]
                best = 0
                while m:
                    allowed = not reaches(reach, parent_node, m)
                    for s in range(num_sources):
                        if not allowed or sources[s] >= parent_row:
                            break
                        allowed = not reaches(reach, base + sources[s], m)
                    if allowed and (best == 0 or path_prob[base + m] > path_prob[base + best]
                                    or (path_prob[base + m] == path_prob[base + best] and m < best)):
                        best = m
                    m = next_same[base + m]
                cand.target[c] = best
        for f in range(first, end):  # edges into drafted nodes may change the frontier's ancestors
            for j in range(width):
                if cand.target[f * width + j]:
                    add_reach_edge(reach, base, drafted, base + front.row[f], cand.target[f * width + j])


@njit(cache=True, nogil=True, error_model="numpy")
def _same_level_leaders(rule, starts, front, tokens, counts, merge, cand):
    """Step 3, for each request: cand.leader[c] = the candidate that c collapses into among the
    request's new-node candidates (valid, no merge target) with its n-gram: the highest path
    prob, then the first created. merge.level_first / level_stamp: a table of the first candidate
    of each n-gram, its slots valid for one (level, request) stamp only (so it is never cleared)."""
    width = tokens.shape[1]
    level_first, level_stamp, leader = merge.level_first, merge.level_stamp, cand.leader
    mask = level_first.size - 1
    for r in range(starts.size - 1):
        first, end = starts[r], starts[r + 1]
        b = front.request[first]
        base = b * (rule.node_budget + 1)
        stamp = (rule.level - 1) * counts.num_nodes.size + b + 1
        for f in range(first, end):
            parent_node = base + front.row[f]
            for j in range(width):
                c = f * width + j
                if not cand.valid[c] or cand.target[c]:
                    continue
                t = tokens[f, j]
                slot = first_slot(cand.ngram_hash[c], mask)
                while level_stamp[slot] == stamp:
                    e = level_first[slot]
                    if tokens[e // width, e % width] == t and \
                            same_tokens(merge.gram, parent_node, base + front.row[e // width], 1):
                        break
                    slot = (slot + 1) & mask
                if level_stamp[slot] != stamp:  # the first of its n-gram
                    level_stamp[slot], level_first[slot] = stamp, c
                    continue
                e = level_first[slot]
                if cand.path_prob[c] > cand.path_prob[leader[e]]:
                    leader[e] = c
                leader[c] = -1 - e  # (resolved below: the group's final leader)
        for c in range(first * width, end * width):
            if leader[c] < 0:
                leader[c] = leader[-1 - leader[c]]
