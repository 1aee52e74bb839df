"""ancestor_words_from_parents against a per-node reference, including bit 31 (sign bit)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graph_refs import ancestor_words_reference

from vllm_gsd.graph import ancestor_words_from_parents




@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 4), budget=st.integers(1, 100))
def test_ancestor_words_match_reference(seed, batch, budget):
    generator = torch.Generator().manual_seed(seed)
    num_nodes = torch.randint(0, budget + 1, (batch,), generator=generator)
    parent_row = torch.full((batch, budget), -1)
    for b in range(batch):
        for i in range(int(num_nodes[b])):
            # mostly deep chains, sometimes any earlier row
            parent_row[b, i] = i if torch.rand(1, generator=generator) < 0.7 else torch.randint(0, i + 1, (1,), generator=generator)
    got = ancestor_words_from_parents(parent_row, num_nodes)
    assert got.dtype == torch.int32 and got.shape == (batch, budget + 1, (budget + 32) // 32)
    assert torch.equal(got, ancestor_words_reference(parent_row, num_nodes, budget))


def test_chain_sets_sign_bit():
    budget = 40
    parent_row = torch.arange(budget).unsqueeze(0)
    words = ancestor_words_from_parents(parent_row, torch.tensor([budget]))
    assert words[0, 31, 0].item() == -1  # rows 0..31 all set: 0xFFFFFFFF
    assert words[0, 40, 1].item() == (1 << 9) - 1
    assert words[0, 0].tolist() == [1, 0]
