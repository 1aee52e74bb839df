"""walk_tree against a brute-force reference on random trees.

walk_tree runs numpy steps on CPU tensors and torch steps elsewhere; both are checked here."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_gsd.graph import AcceptedPaths, GraphBuilder, GraphParams, walk_tree
from vllm_gsd.graph.acceptance import _walk_tree_torch



def _deepest(parents, num_nodes) -> int:
    """The depth of the deepest node any walk can enter (a node whose parent is an earlier row)."""
    deepest = 0
    for b in range(parents.shape[0]):
        depth = [0] * (parents.shape[1] + 1)
        for row in range(1, min(int(num_nodes[b]), parents.shape[1]) + 1):
            parent = int(parents[b, row - 1])
            if 0 <= parent < row:
                depth[row] = depth[parent] + 1
                deepest = max(deepest, depth[row])
    return deepest


def _walk_tree_torch_to_depth(tokens, parents, num_nodes, row_target):
    """The torch walk with the scorer's bound: exactly as many gathers as the deepest node."""
    return _walk_tree_torch(tokens, parents, num_nodes, row_target, max_depth=_deepest(parents, num_nodes))


WALKS = {"numpy (CPU tensors)": walk_tree, "torch (other devices)": _walk_tree_torch,
         "torch to the trees' depth": _walk_tree_torch_to_depth}


def random_bfs_trees(generator, batch, budget, vocab):
    """Random breadth-first trees with distinct sibling tokens, padded per contracts.md."""
    tokens = torch.full((batch, budget), -1)
    parents = torch.full((batch, budget), -1)
    num_nodes = torch.randint(0, budget + 1, (batch,), generator=generator)
    for b in range(batch):
        depth = [0]
        used: dict[int, set] = {}
        for i in range(int(num_nodes[b])):
            # parent among rows of the deepest or second deepest level keeps BFS order valid
            candidates = [r for r in range(i + 1) if depth[r] >= depth[-1] - 1 and len(used.get(r, ())) < vocab]
            parent = candidates[int(torch.randint(0, len(candidates), (1,), generator=generator))]
            if depth[parent] + 1 < depth[-1]:
                parent = i  # keep depths non-decreasing
            free = [t for t in range(vocab) if t not in used.get(parent, set())]
            token = free[int(torch.randint(0, len(free), (1,), generator=generator))]
            used.setdefault(parent, set()).add(token)
            tokens[b, i], parents[b, i] = token, parent
            depth.append(depth[parent] + 1)
    return tokens, parents, num_nodes


def brute_force_greedy(tokens, parents, num_nodes, row_target):
    """Enumerate every root path; keep the longest whose tokens all equal their predecessor's target."""
    batch, budget = tokens.shape
    rows_out, tokens_out, accepted = [], [], []
    for b in range(batch):
        best = [0]
        for end in range(1, int(num_nodes[b]) + 1):
            path = [end]
            while path[-1] != 0:
                path.append(int(parents[b, path[-1] - 1]))
            path = path[::-1]
            if all(int(tokens[b, path[j] - 1]) == int(row_target[b, path[j - 1]]) for j in range(1, len(path))):
                if len(path) > len(best):
                    best = path
        emitted = [int(row_target[b, r]) for r in best]
        rows_out.append(best + [-1] * (budget + 1 - len(best)))
        tokens_out.append(emitted + [-1] * (budget + 1 - len(emitted)))
        accepted.append(len(best) - 1)
    return AcceptedPaths(torch.tensor(rows_out), torch.tensor(tokens_out), torch.tensor(accepted))


def first_child_walk(tokens, parents, num_nodes, row_target):
    """The walk one request at a time: move to the lowest-row child carrying the target token."""
    batch, budget = tokens.shape
    rows = torch.full((batch, budget + 1), -1)
    emitted = torch.full((batch, budget + 1), -1)
    accepted = torch.zeros(batch, dtype=torch.long)
    for b in range(batch):
        row, step = 0, 0
        while True:
            rows[b, step], emitted[b, step] = row, row_target[b, row]
            children = [i + 1 for i in range(int(num_nodes[b]))
                        if int(parents[b, i]) == row and int(tokens[b, i]) == int(row_target[b, row])]
            if not children:
                break
            row, step = children[0], step + 1
        accepted[b] = step
    return AcceptedPaths(rows, emitted, accepted)


def assert_same_paths(got, want):
    assert torch.equal(got.accepted_rows, want.accepted_rows)
    assert torch.equal(got.output_token_ids, want.output_token_ids)
    assert torch.equal(got.num_accepted, want.num_accepted)


@pytest.mark.parametrize("walk", WALKS.values(), ids=WALKS.keys())
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), budget=st.integers(1, 24), vocab=st.integers(2, 5))
def test_walk_tree_matches_brute_force(walk, seed, batch, budget, vocab):
    generator = torch.Generator().manual_seed(seed)
    tokens, parents, num_nodes = random_bfs_trees(generator, batch, budget, vocab)
    row_target = torch.randint(0, vocab, (batch, budget + 1), generator=generator)
    assert_same_paths(walk(tokens, parents, num_nodes, row_target),
                      brute_force_greedy(tokens, parents, num_nodes, row_target))


@pytest.mark.parametrize("walk", WALKS.values(), ids=WALKS.keys())
def test_walk_tree_lowest_row_wins_among_equal_siblings(walk):
    # Siblings sharing a token (not from the graph builder, but allowed input): row order decides.
    generator = torch.Generator().manual_seed(3)
    batch, budget = 6, 30
    parents = torch.full((batch, budget), -1)
    for b in range(batch):
        for i in range(budget):
            parents[b, i] = int(torch.randint(0, i + 1, (1,), generator=generator))
    tokens = torch.randint(0, 2, (batch, budget), generator=generator)
    num_nodes = torch.tensor([30, 0, 1, 17, 29, 8])
    tokens[torch.arange(budget) >= num_nodes[:, None]] = -1
    row_target = torch.randint(0, 2, (batch, budget + 1), generator=generator)
    assert_same_paths(walk(tokens, parents, num_nodes, row_target),
                      first_child_walk(tokens, parents, num_nodes, row_target))
    # A full binary tree of equal tokens: the walk goes down the leftmost path.
    parents = (torch.arange(budget) // 2).unsqueeze(0)
    got = walk(torch.ones(1, budget, dtype=torch.long), parents, torch.tensor([budget]),
               torch.ones(1, budget + 1, dtype=torch.long))
    assert got.accepted_rows[0, :5].tolist() == [0, 1, 3, 7, 15] and got.num_accepted.tolist() == [4]


@pytest.mark.parametrize("walk", WALKS.values(), ids=WALKS.keys())
def test_walk_tree_never_enters_off_contract_nodes(walk):
    # A node whose parent is not an earlier row (here itself, or past the budget) is skipped,
    # so the walk ends instead of looping.
    tokens = torch.tensor([[5, 5, 7]])
    parents = torch.tensor([[0, 2, 9]])  # row 2 claims to be its own child, row 3 a child of row 9
    row_target = torch.tensor([[5, 5, 5, 5]])
    got = walk(tokens, parents, torch.tensor([3]), row_target)
    assert got.accepted_rows.tolist() == [[0, 1, -1, -1]]
    assert got.output_token_ids.tolist() == [[5, 5, -1, -1]]
    # A node count below 0 is an empty tree, one above the budget is every row.
    got = walk(tokens.expand(2, 3), torch.tensor([[0, 1, 2], [0, 1, 2]]), torch.tensor([-3, 7]), row_target.expand(2, 4))
    assert got.accepted_rows.tolist() == [[0, -1, -1, -1], [0, 1, 2, -1]]
    assert got.output_token_ids.tolist() == [[5, -1, -1, -1], [5, 5, 5, -1]]
    assert got.num_accepted.tolist() == [0, 2]


def test_greedy_walk_of_built_trees_follows_the_argmax():
    generator = torch.Generator().manual_seed(0)
    batch, vocab, budget = 8, 5, 20
    params = GraphParams(node_budget=budget, top_k=3, max_depth=4, merge_ngram=1)
    builder = GraphBuilder(params, torch.randint(0, vocab, (batch,), generator=generator), torch.full((batch, 2), -1))
    while (frontier := builder.frontier()) is not None:
        probs = torch.softmax(torch.randn(frontier.token_ids.numel(), vocab, generator=generator), -1)
        top_probs, top_ids = probs.topk(3)
        builder.expand(top_ids, top_probs)
    tree = builder.build_tree()
    logits = torch.randn(batch, budget + 1, vocab, generator=generator)
    # Make the target agree with the first child of many rows, so paths are long.
    first_child = torch.full((batch, budget + 1), -1)
    for b in range(batch):
        for i in reversed(range(int(tree.num_nodes[b]))):
            first_child[b, tree.parent_row[b, i]] = tree.draft_token_ids[b, i]
    agree = (first_child >= 0) & (torch.rand(batch, budget + 1, generator=generator) < 0.8)
    logits[agree.nonzero(as_tuple=True) + (first_child[agree],)] += 100.0
    got = walk_tree(tree.draft_token_ids, tree.parent_row, tree.num_nodes, logits.argmax(-1))
    want = brute_force_greedy(tree.draft_token_ids, tree.parent_row, tree.num_nodes, logits.argmax(-1))
    assert torch.equal(got.accepted_rows, want.accepted_rows)
    assert torch.equal(got.output_token_ids, want.output_token_ids)
    assert got.num_accepted.sum() > batch  # the test exercises multi-node paths


@pytest.mark.parametrize("walk", WALKS.values(), ids=WALKS.keys())
def test_walk_tree_empty_trees_emit_one_token(walk):
    tokens = torch.full((2, 4), -1)
    parents = torch.full((2, 4), -1)
    got = walk(tokens, parents, torch.zeros(2, dtype=torch.long), torch.tensor([[3, 0, 0, 0, 0], [1, 0, 0, 0, 0]]))
    assert got.output_token_ids[:, 0].tolist() == [3, 1]
    assert got.num_accepted.tolist() == [0, 0]
    assert got.accepted_rows[:, 1:].eq(-1).all()
