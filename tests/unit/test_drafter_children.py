"""The draft's children under a request's options (engine/drafter/children.py): each row's
draft logits are processed with the history the target's row after the same path has."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_gsd.engine.drafter.children import draft_children
from vllm_gsd.engine.drafter.choose import Candidate, Sampling
from vllm_gsd.engine.node_processing import RequestOptions

VOCAB = 16


class IdentityHead:
    """A draft head whose logits are the hidden states."""

    reduced = False
    vocab_size = VOCAB

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def _hidden(rows: int) -> torch.Tensor:
    hidden = torch.zeros(rows, VOCAB)
    hidden[:, 5], hidden[:, 6] = 5.0, 4.0  # token 5 first, token 6 second
    return hidden


@pytest.mark.parametrize("sampling", [None, Sampling(noise_key=3, temperature=1e-3, top_k=0, top_p=1.0)],
                         ids=["greedy", "sampled"])
def test_a_penalty_counts_the_rows_own_path(sampling):
    """Rows of one request: the root, and a node whose path below the root is [5]. Under a
    repetition penalty of 2 the node's first child is 6 (5 is on its path), the root's 5; a
    request without options, or rows given no paths, get 5 everywhere."""
    options = RequestOptions(prompt_token_ids=(), output_token_ids=(), repetition_penalty=2.0)
    candidates = [Candidate(0, "a", 0, 10, sampling, options), Candidate(1, "b", 0, 10, sampling, None)]
    request_index, depth = np.asarray([0, 0, 1, 1]), np.asarray([0, 1, 0, 1])
    paths = {0: [], 1: [5], 2: [], 3: [5]}

    def row_paths(rows: np.ndarray) -> list[list[int]]:
        return [paths[r] for r in rows.tolist()]

    children = draft_children(IdentityHead(), _hidden(4), 1, VOCAB, candidates, request_index, depth, None, None,
                              row_paths)
    assert children.tokens[:, 0].tolist() == [5, 6, 5, 5]
    pathless = draft_children(IdentityHead(), _hidden(4), 1, VOCAB, candidates, request_index, depth)
    assert pathless.tokens[:, 0].tolist() == [5, 5, 5, 5]
