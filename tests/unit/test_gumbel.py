"""Keyed Gumbel-max sampling: exact draws, shared noise, batch independence, full-size vocabularies."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare

from vllm_gsd.graph.gumbel import gumbel_argmax, gumbel_noise, gumbel_top_k


def test_noise_depends_only_on_its_key_and_position():
    alone = gumbel_noise(np.array([5]), np.array([17]), 50)
    batch = gumbel_noise(np.array([1, 5, 5, 9]), np.array([17, 17, 3, 17]), 50)
    assert torch.equal(batch[1], alone[0])
    assert not torch.equal(batch[0], batch[1]) and not torch.equal(batch[1], batch[2])
    shared = gumbel_noise(np.array([5, 5]), np.array([17, 17]), 50)
    assert torch.equal(shared[0], shared[1])


def test_gumbel_argmax_draws_from_the_softmax():
    vocab, draws = 12, 24_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 1.5
    logits[3] = float("-inf")  # outside the support: never drawn
    noise = gumbel_noise(np.full(draws, 11), np.arange(draws), vocab)
    tokens = gumbel_argmax(logits.expand(draws, vocab), noise)
    counts = np.bincount(tokens.numpy(), minlength=vocab)
    assert counts[3] == 0
    expected = torch.softmax(logits, -1).double().numpy()
    support = expected > 0
    expected = expected[support] / expected[support].sum() * draws
    assert chisquare(counts[support], expected).pvalue > 1e-4


def test_top_k_is_sampling_without_replacement():
    """P(first = a, second = b) = p_a * p_b / (1 - p_a), over a small vocabulary."""
    vocab, draws = 5, 30_000
    logits = torch.tensor([1.0, 0.3, -0.2, 0.8, -1.0])
    noise = gumbel_noise(np.full(draws, 3), np.arange(draws), vocab)
    tokens, probs = gumbel_top_k(logits.expand(draws, vocab), noise, 2)
    assert torch.equal(tokens[:, 0], gumbel_argmax(logits.expand(draws, vocab), noise))
    assert (tokens[:, 0] != tokens[:, 1]).all() and (probs[:, 0] >= probs[:, 1]).all()
    p = torch.softmax(logits, -1).double().numpy()
    pairs = tokens[:, 0].numpy() * vocab + tokens[:, 1].numpy()
    counts = np.bincount(pairs, minlength=vocab * vocab)
    expected = np.array([p[a] * p[b] / (1 - p[a]) if a != b else 0.0
                         for a in range(vocab) for b in range(vocab)]) * draws
    support = expected > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support], expected[support] / expected[support].sum() * draws).pvalue > 1e-4


def test_a_draft_equal_to_the_target_always_proposes_its_token():
    vocab, rows = 300, 400
    scores = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)) / 0.7
    noise = gumbel_noise(np.arange(rows), np.full(rows, 40), vocab)
    tokens, _ = gumbel_top_k(scores, noise, 1)
    assert torch.equal(tokens[:, 0], gumbel_argmax(scores, noise))


def test_tokens_below_float32_resolution_are_drawn_on_a_full_size_vocabulary():
    """152k tokens: 2k carry almost all the mass, 150k a tail of 2e-8 each (3e-3 in all). Each
    tail token is below half a float32 ulp of the running CDF there, so an inverse-CDF draw over
    a float32 CDF gives a third of the tail tokens a whole ulp and the rest nothing (a total
    variation error of 2e-3); the Gumbel draw reaches the tail at its rate."""
    vocab, tail, draws = 151_936, 150_000, 3_000
    probs = torch.full((vocab,), 2e-8, dtype=torch.float64)
    probs[: vocab - tail] = (1.0 - 2e-8 * tail) / (vocab - tail)
    scores = probs.log()
    hits = 0
    for start in range(0, draws, 500):
        noise = gumbel_noise(np.full(500, 21), np.arange(start, start + 500), vocab)
        hits += int((gumbel_argmax(scores.expand(500, vocab), noise) >= vocab - tail).sum())
    expected = draws * 2e-8 * tail  # 9
    assert 3 <= hits <= 20, hits
    # Power check: the float32 CDF's own distribution is measurably not the target's here.
    cdf32 = probs.float().cumsum(0).double()
    induced = torch.diff(cdf32, prepend=torch.zeros(1, dtype=torch.float64)) / cdf32[-1]
    assert 0.5 * float((induced - probs).abs().sum()) > 1e-3
    assert expected > 5
