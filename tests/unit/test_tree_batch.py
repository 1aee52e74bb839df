"""The trees of one forward (engine/tree_batch.py) on batches built by hand: which requests the
attention layers treat as trees (a chain is not one), each query token's tree row, the trees'
base positions and ancestor words, and the per-row trees the scorer reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_gsd.engine.tree_batch import TreeSlot, build_tree_batch, chain_trees, is_chain

# Per request: the parent row of each node (row i + 1; row 0 is the root), and its query tokens
# this step (a tree's rows are its last n + 1; earlier ones are causal, as in a chunk).
TREE = [0, 0, 1, 1, 2]  # root -> 1, 2; 1 -> 3, 4; 2 -> 5
PLAIN: list[int] = []  # a decode without drafts
CHAIN = [0, 1, 2]  # drafts verified as a chain: causal, vLLM's kernel
SIBLINGS = [0, 0]  # two children of the root, after three causal tokens
PARENTS = [TREE, PLAIN, CHAIN, SIBLINGS]
QUERY_LEN = [6, 1, 4, 6]
TREE_BASE = np.array([40, 9, 17, 123])


def _depths(parents: list[int]) -> list[int]:
    depth = [0]
    for parent in parents:
        depth.append(depth[parent] + 1)
    return depth[1:]


def _ancestors(parents: list[int], row: int) -> set[int]:
    seen = {row}
    while row:
        row = parents[row - 1]
        seen.add(row)
    return seen


def _bits(words: torch.Tensor) -> set[int]:
    return {32 * w + b for w, word in enumerate(words.tolist()) for b in range(32) if (word >> b) & 1}


def _batch(parents_of_request=PARENTS, query_len=QUERY_LEN, tree_base=TREE_BASE, options=None):
    width = max(map(len, parents_of_request))
    parent_row = torch.full((len(parents_of_request), width), -1, dtype=torch.int64)
    depth = torch.zeros((len(parents_of_request), width), dtype=torch.int64)
    for b, parents in enumerate(parents_of_request):
        parent_row[b, :len(parents)] = torch.tensor(parents, dtype=torch.int64)
        depth[b, :len(parents)] = torch.tensor(_depths(parents), dtype=torch.int64)
    num_nodes = torch.tensor([len(p) for p in parents_of_request], dtype=torch.int64)
    query_start_loc = np.concatenate([[0], np.cumsum(query_len)])
    via_merge = torch.zeros_like(parent_row, dtype=torch.bool)
    keys = [None] * len(parents_of_request)
    return build_tree_batch(parent_row, depth, num_nodes, tree_base, via_merge, keys, query_start_loc,
                            torch.device("cpu"), options)


def test_only_requests_with_a_real_tree_get_graph_masked_rows():
    attention = _batch().attention
    assert attention.request_index.tolist() == [0, 3]  # no drafts and a chain take vLLM's kernel
    assert attention.query_start.tolist() == [0, 11]
    assert attention.query_len.tolist() == [6, 6]
    assert not attention.covers_all_rows


def test_every_query_token_has_its_tree_row_or_is_causal():
    rows = _batch().attention.query_tree_row.tolist()
    assert rows[0:6] == [0, 1, 2, 3, 4, 5]  # the tree: root, then its nodes
    assert rows[6:7] == [-1]  # the plain decode
    assert rows[7:11] == [-1, -1, -1, -1]  # the chain, rows and all
    assert rows[11:17] == [-1, -1, -1, 0, 1, 2]  # the tree's rows are the request's last n + 1
    assert len(rows) == sum(QUERY_LEN)


def test_tree_base_is_each_tree_requests_root_position():
    batch = _batch()
    assert batch.attention.tree_base.dtype == torch.int32
    assert batch.attention.tree_base.tolist() == [40, 123]  # the tree requests' only
    assert batch.tree_base.tolist() == TREE_BASE.tolist()  # the scorer's: every request


@pytest.mark.parametrize("which, parents", [(0, TREE), (1, SIBLINGS)])
def test_ancestor_words_hold_each_row_and_its_ancestors(which, parents):
    words = _batch().attention.ancestor_words
    assert words.dtype == torch.int32
    for row in range(len(parents) + 1):
        assert _bits(words[which, row]) == _ancestors(parents, row), row
    assert _bits(words[0, 3]) == {0, 1, 3}  # spelled out: node 3 sees the root and node 1 only
    assert _bits(words[0, 5]) == {0, 2, 5}


def test_the_scorer_reads_every_request_by_batch_row():
    batch = _batch()
    assert batch.num_nodes.tolist() == [5, 0, 3, 2]
    assert batch.parent_row[2].tolist()[:3] == CHAIN  # a chain is still verified as one
    assert batch.depth[0].tolist() == [1, 1, 2, 2, 2]
    assert batch.options_of(3) is None  # no options given
    assert _batch(options=["opts0", None]).options_of(0) == "opts0"
    assert _batch(options=["opts0", None]).options_of(3) is None  # past the list: none


def test_a_batch_of_tree_rows_only_covers_all_rows():
    attention = _batch([TREE, SIBLINGS], [6, 3], np.array([5, 8])).attention
    assert attention.covers_all_rows
    assert attention.query_tree_row.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]


def test_a_batch_without_trees_plans_nothing():
    attention = _batch([PLAIN, CHAIN], [1, 4], np.array([3, 4])).attention
    assert attention.request_index.numel() == 0
    assert attention.query_tree_row.tolist() == [-1] * 5


def test_chain_trees_pads_each_chain():
    parent_row, depth = chain_trees([2, 0, 3])
    assert parent_row.tolist() == [[0, 1, -1], [-1, -1, -1], [0, 1, 2]]
    assert depth.tolist() == [[1, 2, 0], [0, 0, 0], [1, 2, 3]]
    assert chain_trees([])[0].shape == (0, 0)


def test_is_chain():
    parent_row = torch.tensor([[0, 1, 2], [0, 1, 1], [0, 0, -1], [0, 1, -1], [-1, -1, -1]])
    num_nodes = torch.tensor([3, 3, 2, 2, 0])
    assert is_chain(parent_row, num_nodes).tolist() == [True, False, False, True, True]
    # Only the first num_nodes count: a chain of 2 with a sibling past it is a chain of 2.
    assert is_chain(torch.tensor([[0, 1, 1]]), torch.tensor([2])).tolist() == [True]


def test_tree_slot_holds_one_forwards_trees_and_restores_the_previous():
    slot = TreeSlot()
    outer, inner = object(), object()
    with slot.holding(outer):
        assert slot.current is outer
        with pytest.raises(RuntimeError):
            with slot.holding(inner):
                assert slot.current is inner
                raise RuntimeError("a failed metadata build")
        assert slot.current is outer
    assert slot.current is None
