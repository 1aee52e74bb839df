"""Context lookup: verification nodes past the draft's deepest leaf, from the request's own tokens.

Code and answers repeat what is already in the context (a signature, a name, a quoted line).
Where the last few tokens of the context and the draft's most likely deepest path occurred
before, the tokens that followed them then are a guess for what follows now, and a guess that
costs no draft forward. `lookup_extensions` finds, for each request's tree, its deepest most
likely leaf and the tokens that followed the first earlier occurrence of the longest n-gram
(min_ngram..max_ngram tokens) ending there, through vLLM's own n-gram matcher (the one its
`ngram` proposer runs; it takes the first occurrence, the one with the most tokens after it);
`append_extensions` hangs them under the leaf as a chain of tree nodes.
The target verifies them like any node (acceptance is exact for any proposal), so a wrong guess
costs only its query rows, which the adaptive budget weighs against the draft's own nodes
(`LookupAccuracy` supplies the odds it weighs them with).

Extension nodes have no graph node: graph_row and child_rank are -1, via_merge is False.
The graph core (vllm_gsd.graph) imports no vLLM; this module builds on vLLM's matcher, so it
lives with the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens

from vllm_gsd.graph import VerificationTree

MIN_NGRAM, MAX_NGRAM = 2, 4


def lookup_continuation(context: np.ndarray, path: np.ndarray, max_tokens: int,
                        min_ngram: int = MIN_NGRAM, max_ngram: int = MAX_NGRAM) -> np.ndarray:
    """int64 [<= max_tokens]: the tokens that followed the first earlier occurrence of the
    longest n-gram (min_ngram..max_ngram tokens) that ends `context` + `path` (vLLM's n-gram
    matcher); empty if none.

    context: int64 [T], the request's tokens up to and including the tree's root; path: int64
    [d], the node tokens from the root's child down to the leaf being extended.
    """
    if max_tokens <= 0:
        return np.empty(0, dtype=np.int64)
    tokens = np.concatenate([np.asarray(context, dtype=np.int64), np.asarray(path, dtype=np.int64)])
    # max_model_len only bounds k against the sequence's length: no bound here.
    found = _find_longest_matched_ngram_and_propose_tokens(tokens, min_ngram, max_ngram,
                                                           tokens.shape[0] + max_tokens, max_tokens)
    return np.asarray(found, dtype=np.int64)


@dataclass(frozen=True)
class Extensions:
    """Per request of a batch: the node extended (index into the tree's node columns, -1: none),
    its path from the root (int64 [depth], empty where none), and the lookup tokens to hang
    under it (int64 [B, E], -1 padded; num int64 [B])."""

    leaf: np.ndarray
    leaf_path: list[np.ndarray]
    tokens: np.ndarray
    num: np.ndarray


def warm_up() -> None:
    """Compile vLLM's n-gram matcher (numba) before the first request needs it."""
    lookup_continuation(np.arange(8, dtype=np.int64) % 3, np.zeros(1, dtype=np.int64), 2)


def node_path(parent_row: np.ndarray, token_ids: np.ndarray, node: int) -> np.ndarray:
    """int64 [depth]: the tokens from the root's child down to node column `node` of one tree
    (parent_row: rows as in contracts.md, 0 = root, k = column k - 1)."""
    path = []
    row = node + 1
    while row > 0:
        path.append(int(token_ids[row - 1]))
        row = int(parent_row[row - 1])
    return np.asarray(path[::-1], dtype=np.int64)


def lookup_extensions(tree: VerificationTree, contexts: list[np.ndarray], max_tokens: int) -> Extensions:
    """For each request b: its tree's deepest most likely node (breadth-first rows put a depth's
    most likely node first), and up to max_tokens lookup tokens past it (`lookup_continuation`
    of contexts[b] and the node's path). A tree without nodes is not extended."""
    batch = tree.num_nodes.shape[0]
    leaf = np.full(batch, -1, dtype=np.int64)
    tokens = np.full((batch, max(max_tokens, 0)), -1, dtype=np.int64)
    num = np.zeros(batch, dtype=np.int64)
    leaf_path = [np.empty(0, dtype=np.int64)] * batch
    num_nodes = tree.num_nodes.numpy()
    depth, parent_row, token_ids = tree.depth.numpy(), tree.parent_row.numpy(), tree.draft_token_ids.numpy()
    for b in range(batch):
        n = int(num_nodes[b])
        if n == 0 or max_tokens <= 0:
            continue
        node = int(np.argmax(depth[b, :n]))  # the first column of the deepest depth
        path = node_path(parent_row[b], token_ids[b], node)
        found = lookup_continuation(contexts[b], path, max_tokens)
        if found.size:
            leaf[b], leaf_path[b], num[b] = node, path, found.size
            tokens[b, :found.size] = found
    return Extensions(leaf, leaf_path, tokens, num)


def find_node(tree: VerificationTree, b: int, path: np.ndarray) -> int:
    """The node column of request b's tree whose path from the root is `path`, or -1."""
    depth, parent_row = tree.depth[b].numpy(), tree.parent_row[b].numpy()
    token_ids = tree.draft_token_ids[b].numpy()
    n = int(tree.num_nodes[b])
    for node in np.flatnonzero(depth[:n] == len(path)).tolist():
        if np.array_equal(node_path(parent_row, token_ids, node), path):
            return node
    return -1


def append_extensions(tree: VerificationTree, leaf: np.ndarray, tokens: np.ndarray, num: np.ndarray,
                      path_prob: np.ndarray | None = None) -> VerificationTree:
    """The tree with num[b] nodes of tokens[b] chained under node column leaf[b] of each request
    (none where leaf is -1), as many as fit in the tree's width. They are deeper than every
    node (the leaf is a deepest node), so the rows stay breadth-first. path_prob: float64
    [B, E], the extension nodes' path_prob entries (default 0)."""
    width = tree.draft_token_ids.shape[1]
    num_nodes = tree.num_nodes.numpy()
    take = np.where(leaf >= 0, np.minimum(num, width - num_nodes), 0)
    if not take.any():
        return tree
    out = {name: getattr(tree, name).clone() for name in
           ("draft_token_ids", "parent_row", "depth", "num_nodes", "path_prob", "via_merge", "graph_row", "child_rank")}
    for b in np.flatnonzero(take > 0).tolist():
        first, e = int(num_nodes[b]), int(take[b])
        if int(tree.depth[b, leaf[b]]) != int(tree.depth[b, :first].max()):
            raise ValueError(f"request {b}: node {leaf[b]} is not a deepest node; its extension would "
                             "break the breadth-first order")
        columns = slice(first, first + e)
        out["draft_token_ids"][b, columns] = torch.from_numpy(tokens[b, :e])
        # Node column c is row c + 1: the first hangs under the leaf, each next under the last.
        out["parent_row"][b, columns] = torch.arange(first, first + e)
        out["parent_row"][b, first] = int(leaf[b]) + 1
        out["depth"][b, columns] = int(tree.depth[b, leaf[b]]) + torch.arange(1, e + 1)
        out["path_prob"][b, columns] = 0.0 if path_prob is None else torch.from_numpy(path_prob[b, :e])
        out["via_merge"][b, columns] = False
        out["graph_row"][b, columns] = -1
        out["child_rank"][b, columns] = -1
        out["num_nodes"][b] = first + e
    return replace(tree, ancestor_words=None, **out)


def with_extensions(tree: VerificationTree, extensions: Extensions, odds: float
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(path_prob float64 [B, N + E], depth int64 [B, N + E], num_nodes int64 [B]): the tree's
    nodes, each request's lookup nodes right after them, at the leaf's path probability times
    odds per lookup node (so that lookup nodes compete with the draft's for the verified rows)."""
    num_nodes = tree.num_nodes.numpy()
    batch, width = tree.path_prob.shape
    extra = extensions.tokens.shape[1]
    path_prob = np.zeros((batch, width + extra))
    depth = np.zeros((batch, width + extra), dtype=np.int64)
    path_prob[:, :width], depth[:, :width] = tree.path_prob.numpy(), tree.depth.numpy()
    for b in np.flatnonzero(extensions.leaf >= 0).tolist():
        n, e, leaf = int(num_nodes[b]), int(extensions.num[b]), int(extensions.leaf[b])
        steps = np.arange(1, e + 1)
        path_prob[b, n:n + e] = path_prob[b, leaf] * odds ** steps
        depth[b, n:n + e] = depth[b, leaf] + steps
    return path_prob, depth, num_nodes + extensions.num


def kept_extensions(path_prob: np.ndarray, num_draft: np.ndarray, node_budget: np.ndarray) -> np.ndarray:
    """int64 [B]: how many of each request's lookup nodes (the columns from num_draft[b] on) are
    among its node_budget[b] most likely nodes (ties: the earlier column, as the budget's
    selection orders them)."""
    kept = np.zeros(len(num_draft), dtype=np.int64)
    for b in np.flatnonzero(node_budget > 0).tolist():
        best = np.argsort(-path_prob[b], kind="stable")[: int(node_budget[b])]
        kept[b] = int((best >= num_draft[b]).sum())
    return kept


class LookupAccuracy:
    """P(a lookup node is the target's token | the path to its parent was accepted): an
    exponentially weighted ratio of hits to tries over about `window` tries, starting from
    `prior` with the weight of `prior_tries` tries."""

    def __init__(self, prior: float = 0.5, prior_tries: float = 2.0, window: float = 256.0) -> None:
        self._hits, self._tries = prior * prior_tries, prior_tries
        self._keep = 1.0 - 1.0 / window

    @property
    def value(self) -> float:
        return self._hits / self._tries

    def observe(self, hits: int, tries: int) -> None:
        if tries:
            decay = self._keep ** tries
            self._hits = decay * self._hits + hits
            self._tries = decay * self._tries + tries


def lookup_outcome(emitted: list[int], leaf_path: np.ndarray, extension: np.ndarray) -> tuple[int, int]:
    """(hits, tries) of one verified extension: the tokens the step emitted (accepted nodes, then
    the target's own token), the path of the node it hung under, and its verified lookup tokens.
    A lookup node is tried when the accepted path reached its parent, and hit when the target's
    token there is its token."""
    d = len(leaf_path)
    if len(emitted) <= d or list(emitted[:d]) != leaf_path.tolist():
        return 0, 0
    hits = tries = 0
    for i, token in enumerate(extension.tolist()):
        if d + i >= len(emitted):
            break
        tries += 1
        if emitted[d + i] != token:
            break
        hits += 1
    return hits, tries
