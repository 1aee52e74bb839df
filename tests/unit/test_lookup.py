"""Context lookup (engine/lookup.py): vLLM's n-gram matcher against a plain reference, lookup
nodes hung under a tree's deepest leaf, their outcome as verification reports it, and how the
drafter weighs them against the draft's own nodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_gsd.engine.lookup import (LookupAccuracy, append_extensions, find_node, kept_extensions,
                                    lookup_continuation, lookup_extensions, lookup_outcome, node_path,
                                    with_extensions)
from vllm_gsd.graph import GraphBuilder, GraphParams, ancestor_words_from_parents, walk_tree


def reference_continuation(tokens: list[int], max_tokens: int, min_ngram: int, max_ngram: int) -> list[int]:
    """The longest n-gram ending the tokens that occurred earlier; the tokens after its first
    earlier occurrence."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        key = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == key]
        if starts:
            return tokens[starts[0] + n: starts[0] + n + max_tokens]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=40), st.lists(st.integers(0, 3), max_size=4),
       st.integers(1, 4), st.integers(1, 3), st.integers(2, 5))
def test_lookup_continuation_matches_reference(context, path, max_tokens, min_ngram, max_ngram):
    found = lookup_continuation(np.asarray(context, dtype=np.int64), np.asarray(path, dtype=np.int64),
                                max_tokens, min_ngram, max_ngram)
    assert found.dtype == np.int64
    assert found.tolist() == reference_continuation(context + path, max_tokens, min_ngram, max_ngram)


def test_lookup_continuation_finds_a_repeated_signature():
    context = np.asarray([5, 9, 7, 1, 2, 3, 4, 8, 6, 1, 2], dtype=np.int64)  # "1 2 3 4" seen before
    assert lookup_continuation(context, np.asarray([3]), 2).tolist() == [4, 8]
    assert lookup_continuation(context, np.asarray([], dtype=np.int64), 3).tolist() == [3, 4, 8]
    assert lookup_continuation(context, np.asarray([0]), 3).size == 0  # "2 0" never occurred
    assert lookup_continuation(context, np.asarray([3]), 0).size == 0


def two_trees():
    """Two requests' trees from the graph core: request 0 drafts 1 -> 2 -> 3 (with a sibling),
    request 1 drafts 7 -> 8."""
    params = GraphParams(node_budget=16, top_k=2, max_depth=3, merge_ngram=-1)
    builder = GraphBuilder(params, torch.tensor([0, 6]), torch.full((2, 0), -1))
    builder.expand(torch.tensor([[1, 4], [7, 5]]), torch.tensor([[0.7, 0.3], [0.9, 0.1]]))
    frontier = builder.frontier()
    rows = frontier.token_ids.tolist()
    tops = {1: [2, 5], 4: [2, 1], 7: [8, 9], 5: [8, 9]}
    probs = {1: [0.8, 0.2], 4: [0.6, 0.4], 7: [0.9, 0.1], 5: [0.5, 0.5]}
    builder.expand(torch.tensor([tops[t] for t in rows]), torch.tensor([probs[t] for t in rows]))
    frontier = builder.frontier()
    rows = frontier.token_ids.tolist()
    builder.expand(torch.tensor([[3, 1] if t == 2 else [9, 1] for t in rows]),
                   torch.tensor([[0.9, 0.1] if t == 2 else [0.6, 0.4] for t in rows]))
    return builder.build_tree()


def test_lookup_nodes_hang_under_the_deepest_most_likely_leaf():
    tree = two_trees()
    # Request 0's context held "1 2 3" followed by "4 4"; request 1's has no repeat.
    contexts = [np.asarray([1, 2, 3, 4, 4, 9, 0]), np.asarray([10, 11, 12, 6])]
    extensions = lookup_extensions(tree, contexts, 2)
    assert extensions.num.tolist() == [2, 0] and extensions.leaf[1] == -1
    leaf = int(extensions.leaf[0])
    assert node_path(tree.parent_row[0].numpy(), tree.draft_token_ids[0].numpy(), leaf).tolist() == [1, 2, 3]
    extended = append_extensions(tree, extensions.leaf, extensions.tokens, extensions.num)
    n0 = int(tree.num_nodes[0])
    assert extended.num_nodes.tolist() == [n0 + 2, int(tree.num_nodes[1])]
    assert extended.draft_token_ids[0, n0:n0 + 2].tolist() == [4, 4]
    assert node_path(extended.parent_row[0].numpy(), extended.draft_token_ids[0].numpy(), n0 + 1).tolist() == [1, 2, 3, 4, 4]
    # Contract: breadth-first rows, parents earlier, the lookup nodes marked as no graph node.
    for b in range(2):
        n = int(extended.num_nodes[b])
        assert (np.diff(extended.depth[b, :n].numpy()) >= 0).all()
        assert (extended.parent_row[b, :n].numpy() <= np.arange(n)).all()
    assert extended.graph_row[0, n0:n0 + 2].tolist() == [-1, -1] and extended.path_prob[0, n0:].sum() == 0
    assert torch.equal(extended.ancestor_words,
                       ancestor_words_from_parents(extended.parent_row, extended.num_nodes))
    # The target accepts the whole path when it agrees: 1 2 3 4 4, then its own token.
    width = extended.draft_token_ids.shape[1]
    target = torch.full((2, width + 1), 99, dtype=torch.int64)
    path_rows = [0]
    for token in [1, 2, 3, 4, 4]:
        children = [c for c in range(int(extended.num_nodes[0]))
                    if extended.parent_row[0, c] == path_rows[-1] and extended.draft_token_ids[0, c] == token]
        target[0, path_rows[-1]] = token
        path_rows.append(children[0] + 1)
    accepted = walk_tree(extended.draft_token_ids, extended.parent_row, extended.num_nodes, target)
    assert accepted.num_accepted.tolist() == [5, 0]
    assert accepted.output_token_ids[0, :6].tolist() == [1, 2, 3, 4, 4, 99]


def test_extensions_fit_the_tree_width_and_skip_empty_trees():
    tree = two_trees()
    width = tree.draft_token_ids.shape[1]
    room = width - int(tree.num_nodes[0])
    tokens = np.arange(2 * (room + 3)).reshape(2, room + 3)
    leaf = np.asarray([int(np.argmax(tree.depth[0, :int(tree.num_nodes[0])])), -1])
    extended = append_extensions(tree, leaf, tokens, np.asarray([room + 3, room + 3]))
    assert extended.num_nodes.tolist() == [width, int(tree.num_nodes[1])]
    with pytest.raises(ValueError, match="not a deepest node"):
        append_extensions(tree, np.asarray([0, -1]), tokens, np.asarray([1, 0]))


def test_find_node_locates_a_path_after_renumbering():
    tree = two_trees()
    for b in range(2):
        for node in range(int(tree.num_nodes[b])):
            path = node_path(tree.parent_row[b].numpy(), tree.draft_token_ids[b].numpy(), node)
            assert find_node(tree, b, path) == node
    assert find_node(tree, 0, np.asarray([1, 2, 9])) == -1


@pytest.mark.parametrize("emitted, expected", [
    ([1, 2, 3, 4, 4, 7], (2, 2)),  # both lookup nodes accepted
    ([1, 2, 3, 4, 5], (1, 2)),  # the first accepted, the target chose otherwise at the second
    ([1, 2, 3, 6], (0, 1)),  # the leaf reached, the first lookup node rejected
    ([1, 2, 5], (0, 0)),  # the leaf itself rejected: no lookup node tried
    ([1, 5, 3, 4], (0, 0)),  # another path
])
def test_lookup_outcome(emitted, expected):
    assert lookup_outcome(emitted, np.asarray([1, 2, 3]), np.asarray([4, 4])) == expected


def test_lookup_accuracy_follows_the_hits():
    accuracy = LookupAccuracy(prior=0.5, prior_tries=2.0, window=64.0)
    assert accuracy.value == 0.5
    for _ in range(200):
        accuracy.observe(1, 4)
    assert accuracy.value == pytest.approx(0.25, abs=0.01)
    accuracy.observe(0, 0)
    assert accuracy.value == pytest.approx(0.25, abs=0.01)


def test_lookup_nodes_compete_with_the_drafts_own_by_path_probability():
    tree = two_trees()
    extensions = lookup_extensions(tree, [np.asarray([1, 2, 3, 4, 4, 9, 0]), np.asarray([6])], 2)
    path_prob, depth, num_nodes = with_extensions(tree, extensions, odds=0.5)
    n0, leaf = int(tree.num_nodes[0]), int(extensions.leaf[0])
    assert num_nodes.tolist() == [n0 + 2, int(tree.num_nodes[1])]
    leaf_prob = float(tree.path_prob[0, leaf])
    assert path_prob[0, n0:n0 + 2] == pytest.approx([leaf_prob * 0.5, leaf_prob * 0.25])
    assert depth[0, n0:n0 + 2].tolist() == [3 + 1, 3 + 2]
    # A budget of every node keeps both; one that stops above the leaf's odds keeps none.
    assert kept_extensions(path_prob, num_nodes - extensions.num, num_nodes).tolist() == [2, 0]
    above = int((path_prob[0, :n0] > leaf_prob * 0.5).sum())
    assert kept_extensions(path_prob, num_nodes - extensions.num, np.asarray([above, 0])).tolist() == [0, 0]
    assert kept_extensions(path_prob, num_nodes - extensions.num, np.asarray([above + 1, 0]))[0] in (0, 1)
