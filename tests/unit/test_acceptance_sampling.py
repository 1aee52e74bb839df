"""The coupled Gumbel-max scheme of sampled requests (engine/sampling.py), on a small vocabulary.

Many requests (each its own noise key) verify a depth-2 tree whose children are the draft's
Gumbel-top-k under the noise of their position; the target's token at a row is its Gumbel-max
draw under the same noise, and the walk follows it. The first emitted token must follow the
target's p0, the first two the target's joint p0(x1) p1(x2 | x1) (chi-square); when a step
emits only one token the second is what the next step draws, with the same position's noise.
Power checks: a deliberately biased rule (the paper code's independent min(1, p/q) acceptance
without a residual) fails the same test, and the coupled children are accepted far more often
than the draft's deterministic top-k at a high temperature.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from vllm_gsd.graph import walk_tree
from vllm_gsd.graph.gumbel import gumbel_argmax, gumbel_noise, gumbel_top_k

VOCAB = 6
DRAWS = 40_000
ROOT_CHILDREN = 3
GRAND_CHILDREN = 2
BUDGET = ROOT_CHILDREN + ROOT_CHILDREN * GRAND_CHILDREN


def target_model(seed: int, concentration: float = 3.0):
    """p0 [V], p1 [V, V] (2nd token given the 1st), p2 [V, V, V]; q0, q1 an informative draft."""
    generator = torch.Generator().manual_seed(seed)

    def dirichlet(*shape):
        sample = torch._standard_gamma(torch.full(shape, concentration, dtype=torch.float64), generator=generator)
        return sample / sample.sum(-1, keepdim=True)

    p0, p1, p2 = dirichlet(VOCAB), dirichlet(VOCAB, VOCAB), dirichlet(VOCAB, VOCAB, VOCAB)
    q0 = 0.6 * p0 + 0.4 * dirichlet(VOCAB)
    q1 = 0.6 * p1 + 0.4 * dirichlet(VOCAB, VOCAB)
    return p0, p1, p2, q0, q1


def noise_at(keys: np.ndarray, position: int) -> torch.Tensor:
    return gumbel_noise(keys, np.full(keys.shape, position), VOCAB)


def coupled_tree(keys, q0, q1):
    """Rows 1..3: the root's children (position 1); rows 4..9: each child's (position 2)."""
    first, _ = gumbel_top_k(q0.log().expand(len(keys), VOCAB), noise_at(keys, 1), ROOT_CHILDREN)
    noise2 = noise_at(np.repeat(keys, ROOT_CHILDREN), 2)
    second, _ = gumbel_top_k(q1[first.reshape(-1)].log(), noise2, GRAND_CHILDREN)
    tokens = torch.cat([first, second.reshape(len(keys), -1)], dim=1)
    parents = torch.tensor([0] * ROOT_CHILDREN + [1 + i for i in range(ROOT_CHILDREN) for _ in range(GRAND_CHILDREN)])
    return tokens, parents.expand(len(keys), -1).contiguous(), torch.full((len(keys),), BUDGET)


def target_rows(tokens, p0, p1, p2):
    """Target probs [M, N + 1, V] of every tree row."""
    draws = tokens.shape[0]
    first = tokens[:, :ROOT_CHILDREN]
    second_parent = first.repeat_interleave(GRAND_CHILDREN, dim=1)
    return torch.cat([p0.expand(draws, 1, VOCAB), p1[first], p2[second_parent, tokens[:, ROOT_CHILDREN:]]], dim=1)


def coupled_walk(keys, p0, p1, p2, q0, q1):
    tokens, parents, num_nodes = coupled_tree(keys, q0, q1)
    target = target_rows(tokens, p0, p1, p2)
    # Row r's token is drawn at position depth(r) + 1 (the root at 1, the root's children at 2).
    depth_of_row = [0] + [1] * ROOT_CHILDREN + [2] * (ROOT_CHILDREN * GRAND_CHILDREN)
    row_target = torch.stack([gumbel_argmax(target[:, r].log(), noise_at(keys, depth_of_row[r] + 1))
                              for r in range(BUDGET + 1)], dim=1)
    return walk_tree(tokens, parents, num_nodes, row_target)


def first_two_tokens(paths, keys, p1):
    """(x1, x2) per request; x2 is the next step's draw (position 2's noise) when only x1 was emitted."""
    out = paths.output_token_ids
    x1 = out[:, 0]
    next_step = gumbel_argmax(p1[x1].log(), noise_at(keys, 2))
    return x1, torch.where(paths.num_accepted >= 1, out[:, 1], next_step)


def chi_square_pvalues(x1, x2, p0, p1):
    counts1 = np.bincount(x1.numpy(), minlength=VOCAB)
    counts2 = np.bincount((x1 * VOCAB + x2).numpy(), minlength=VOCAB * VOCAB)
    joint = (p0[:, None] * p1).reshape(-1).numpy()
    return (chisquare(counts1, p0.numpy() / p0.numpy().sum() * x1.numel()).pvalue,
            chisquare(counts2, joint / joint.sum() * x1.numel()).pvalue)


@pytest.mark.parametrize("seed", [1234, 99])
def test_coupled_walk_follows_the_target_distribution(seed):
    p0, p1, p2, q0, q1 = target_model(seed)
    keys = np.arange(DRAWS) + 10**6 * seed
    paths = coupled_walk(keys, p0, p1, p2, q0, q1)
    first, joint = chi_square_pvalues(*first_two_tokens(paths, keys, p1), p0, p1)
    assert first > 1e-3 and joint > 1e-3
    assert paths.num_accepted.float().mean() > 1.0  # the trees are accepted, not bypassed


def test_a_biased_rule_fails_the_same_test():
    """Power check: the paper code's rule (each child accepted with min(1, p/q) against the
    unmodified p, q; if all are rejected the token is drawn from p itself) is not lossless."""
    p0, p1, p2, q0, q1 = target_model(1234)
    rng = torch.Generator().manual_seed(5)
    children = torch.multinomial(q0.expand(DRAWS, VOCAB), ROOT_CHILDREN, generator=rng)
    x1 = torch.multinomial(p0.expand(DRAWS, VOCAB), 1, generator=rng).squeeze(1)
    uniforms = torch.rand(DRAWS, ROOT_CHILDREN, generator=rng, dtype=torch.float64)
    for slot in reversed(range(ROOT_CHILDREN)):  # the first accepted child wins
        token = children[:, slot]
        x1 = torch.where(uniforms[:, slot] * q0[token] < p0[token], token, x1)
    x2 = torch.multinomial(p1[x1], 1, generator=rng).squeeze(1)
    first, _ = chi_square_pvalues(x1, x2, p0, p1)
    assert first < 1e-6


def test_coupled_children_are_accepted_far_more_than_a_deterministic_top_k_at_high_temperature():
    """A flat target (temperature 1 over a spread distribution): the deterministic top-3 covers
    about half the mass; the draft's Gumbel-top-3 under the target's noise nearly always holds
    the target's draw."""
    p0, p1, p2, q0, q1 = target_model(7, concentration=30.0)  # flat rows
    keys = np.arange(DRAWS)
    coupled = coupled_walk(keys, p0, p1, p2, q0, q1)
    first_accepted = float((coupled.num_accepted >= 1).double().mean())
    deterministic_cover = float(p0[q0.topk(ROOT_CHILDREN).indices].sum())
    print(f"first level accepted: coupled {first_accepted:.3f}, deterministic top-3 {deterministic_cover:.3f}")
    assert first_accepted > deterministic_cover + 0.2


def test_seeded_text_does_not_depend_on_the_tree():
    """The emitted tokens are the target's Gumbel-max draws: a tree of other children (another
    draft) changes how many tokens a step confirms, never which."""
    p0, p1, p2, q0, q1 = target_model(3)
    _, _, _, other_q0, other_q1 = target_model(4)
    keys = np.arange(2000)
    ours, theirs = coupled_walk(keys, p0, p1, p2, q0, q1), coupled_walk(keys, p0, p1, p2, other_q0, other_q1)
    mine_two, their_two = first_two_tokens(ours, keys, p1), first_two_tokens(theirs, keys, p1)
    assert torch.equal(mine_two[0], their_two[0]) and torch.equal(mine_two[1], their_two[1])
