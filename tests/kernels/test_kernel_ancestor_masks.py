"""triton_ancestor_words_from_parents against the graph room's torch reference and a
pure-python oracle, on random BFS trees up to 256+ nodes."""

from __future__ import annotations

import pytest
import torch

from scripts.tools.kernel_testutils import ancestor_words_loop, gen, pad_trees, randint, random_parents
from vllm_gsd.graph import ancestor_words_from_parents as torch_ref
from vllm_gsd.kernels import triton_ancestor_words_from_parents


def _batch(seed, n_budget, batch, kinds=("random", "chain", "star")):
    g = gen(seed)
    trees = []
    for i in range(batch):
        n = [0, n_budget, randint(g, 0, n_budget)][i % 3]  # empty, full budget, random size
        trees.append(random_parents(n, g, kinds[i % len(kinds)]))
    return pad_trees(trees, n_budget)


@pytest.mark.parametrize("n_budget,batch", [(1, 2), (5, 3), (31, 4), (32, 5), (33, 3), (64, 4), (100, 3), (256, 4), (300, 2)])
def test_triton_matches_python_oracle(n_budget, batch, poison_empty):
    parent_row, num_nodes = _batch(100 + n_budget, n_budget, batch)
    out = triton_ancestor_words_from_parents(parent_row, num_nodes)
    w = (n_budget + 1 + 31) // 32
    assert out.shape == (batch, n_budget + 1, w) and out.dtype == torch.int32
    torch.testing.assert_close(out, ancestor_words_loop(parent_row, num_nodes), atol=0, rtol=0)


@pytest.mark.parametrize("seed,n_budget,batch", [(1, 16, 8), (2, 63, 5), (3, 256, 6), (4, 257, 3)])
def test_triton_matches_torch_reference(seed, n_budget, batch, poison_empty):
    parent_row, num_nodes = _batch(seed, n_budget, batch)
    torch.testing.assert_close(triton_ancestor_words_from_parents(parent_row, num_nodes),
                               torch_ref(parent_row, num_nodes), atol=0, rtol=0)


def test_sign_bit_and_padding_rows(poison_empty):
    """A 40-deep chain sets bit 31 (the int32 sign bit); rows past num_nodes keep their own bit."""
    parent_row, num_nodes = pad_trees([list(range(40))], 45)
    out = triton_ancestor_words_from_parents(parent_row, num_nodes)
    assert int(out[0, 40, 0]) == -1  # all 32 bits of word 0: rows 0..31 are ancestors of 40
    assert int(out[0, 40, 1]) == (1 << 9) - 1  # rows 32..40
    assert int(out[0, 0, 0]) == 1 and int(out[0, 0, 1]) == 0
    for r in range(41, 46):
        assert int(out[0, r, r // 32]) == 1 << (r % 32) and int(out[0, r, 1 - r // 32]) == 0
