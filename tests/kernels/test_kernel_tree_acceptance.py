"""triton_walk_tree (one launch per batch) against vllm_gsd.graph.acceptance.walk_tree and a
python oracle, on random trees whose target tokens follow the tree with high probability."""

from __future__ import annotations

import pytest
import torch

from scripts.tools.kernel_testutils import gen, pad_trees, randint, random_parents
from vllm_gsd.graph.acceptance import walk_tree as torch_ref
from vllm_gsd.kernels import triton_walk_tree


def _walk_loop(draft, parents, num_nodes, target):
    b, n = draft.shape
    rows = torch.full((b, n + 1), -1, dtype=torch.int64)
    toks = torch.full((b, n + 1), -1, dtype=torch.int64)
    acc = torch.zeros(b, dtype=torch.int64)
    for i in range(b):
        r, k = 0, 0
        rows[i, 0] = 0
        while True:
            t = int(target[i, r])
            toks[i, k] = t
            kids = [c for c in range(int(num_nodes[i])) if int(parents[i, c]) == r and int(draft[i, c]) == t]
            if not kids:
                break
            r, k = kids[0] + 1, k + 1
            rows[i, k] = r
        acc[i] = k
    return rows, toks, acc


def _batch(seed, n_budget, batch, vocab=5, follow=0.8):
    """Small vocab -> sibling token collisions (lowest row must win); the target follows a
    child with probability `follow`, else draws a random token."""
    g = gen(seed)
    kinds = ("random", "chain", "star", "random")
    trees = []
    for i in range(batch):
        n = [n_budget, 0, randint(g, 1, n_budget)][i % 3]
        trees.append(random_parents(n, g, kinds[i % 4]))
    parent_row, num_nodes = pad_trees(trees, n_budget)
    draft = torch.randint(0, vocab, (batch, n_budget), generator=g)
    draft[parent_row < 0] = -1
    target = torch.randint(0, vocab, (batch, n_budget + 1), generator=g)
    for i in range(batch):
        for r in range(n_budget + 1):
            kids = [c for c in range(int(num_nodes[i])) if int(parent_row[i, c]) == r]
            if kids and torch.rand((), generator=g) < follow:
                target[i, r] = draft[i, kids[randint(g, 0, len(kids) - 1)]]
    return draft, parent_row, num_nodes, target


CASES = [(1, 1, 3), (2, 7, 5), (3, 16, 9), (4, 33, 4), (5, 64, 6), (6, 256, 4)]


@pytest.mark.parametrize("seed,n_budget,batch", CASES)
def test_triton_matches_python_oracle(seed, n_budget, batch, poison_empty):
    draft, parents, num_nodes, target = _batch(seed, n_budget, batch)
    rows, toks, acc = triton_walk_tree(draft, parents, num_nodes, target)
    e_rows, e_toks, e_acc = _walk_loop(draft, parents, num_nodes, target)
    torch.testing.assert_close(rows, e_rows, atol=0, rtol=0)
    torch.testing.assert_close(toks, e_toks, atol=0, rtol=0)
    torch.testing.assert_close(acc, e_acc, atol=0, rtol=0)


@pytest.mark.parametrize("seed,n_budget,batch", CASES)
def test_triton_matches_torch_reference(seed, n_budget, batch, poison_empty):
    draft, parents, num_nodes, target = _batch(seed + 50, n_budget, batch)
    rows, toks, acc = triton_walk_tree(draft, parents, num_nodes, target)
    ref = torch_ref(draft, parents, num_nodes, target)
    torch.testing.assert_close(rows, ref.accepted_rows, atol=0, rtol=0)
    torch.testing.assert_close(toks, ref.output_token_ids, atol=0, rtol=0)
    torch.testing.assert_close(acc, ref.num_accepted.to(torch.int64), atol=0, rtol=0)


def test_full_chain_accepted(poison_empty):
    n = 256
    draft = torch.arange(10, 10 + n)[None]
    parents, num_nodes = pad_trees([random_parents(n, gen(0), "chain")], n)
    target = torch.cat([draft, torch.tensor([[7]])], dim=1)  # row r's target = token of row r+1
    rows, toks, acc = triton_walk_tree(draft, parents, num_nodes, target)
    assert int(acc[0]) == n
    assert rows[0].tolist() == list(range(n + 1))
    assert toks[0].tolist() == list(range(10, 10 + n)) + [7]
