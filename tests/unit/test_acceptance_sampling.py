"""Statistical losslessness of sampling verification (chi-square on a small vocabulary).

A batch of many identical requests (different uniforms) verifies a depth-2 tree. The first
emitted token must follow the target's p0, and the first two emitted tokens the target's joint
p0(x1) p1(x2 | x1): when a step emits only one token, the second is what the next step would
draw, a plain target sample. A deliberately biased rule (the paper code's independent
min(1, p/q) acceptance without residual) must fail the same test, which shows its power.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from vllm_gsd.graph import AcceptedPaths, recursive_rejection_accept, sample_accept, sample_rows

VOCAB = 6
DRAWS = 40_000
ROOT_CHILDREN = 3
GRAND_CHILDREN = 2
BUDGET = ROOT_CHILDREN + ROOT_CHILDREN * GRAND_CHILDREN


def target_model(generator):
    """p0 [V], p1 [V, V] (2nd token given the 1st), p2 [V, V, V]; all cells clearly positive."""
    def dirichlet(*shape):
        sample = torch.distributions.Gamma(torch.full(shape, 3.0, dtype=torch.float64), 1.0).sample()
        return sample / sample.sum(-1, keepdim=True)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
    p0, p1, p2 = dirichlet(VOCAB), dirichlet(VOCAB, VOCAB), dirichlet(VOCAB, VOCAB, VOCAB)
    # An informative draft: close to the target but not equal.
    q0 = 0.6 * p0 + 0.4 * dirichlet(VOCAB)
    q1 = 0.6 * p1 + 0.4 * dirichlet(VOCAB, VOCAB)
    return p0, p1, p2, q0, q1


def sample_without_replacement(probs, count, generator):
    """[M, count] tokens drawn in order without replacement from probs [M, V] (Gumbel top-k)."""
    gumbel = -torch.log(-torch.log(torch.rand(probs.shape, generator=generator, dtype=torch.float64)))
    return (probs.log() + gumbel).topk(count, dim=-1).indices


def depth_two_tree(first_tokens, second_tokens):
    """Rows 1..3: root children; rows 4..9: GRAND_CHILDREN children of each root child."""
    draws = first_tokens.shape[0]
    tokens = torch.cat([first_tokens, second_tokens.reshape(draws, -1)], dim=1)
    parents = torch.tensor([0] * ROOT_CHILDREN + [1 + i for i in range(ROOT_CHILDREN) for _ in range(GRAND_CHILDREN)])
    return tokens, parents.expand(draws, -1).contiguous(), torch.full((draws,), BUDGET)


def row_distributions(tokens, p0, p1, p2, q0, q1):
    """target and draft probs [M, N + 1, V] of every tree row (depth-2 rows' draft is unused)."""
    draws = tokens.shape[0]
    first = tokens[:, :ROOT_CHILDREN]
    second_parent = first.repeat_interleave(GRAND_CHILDREN, dim=1)
    second = tokens[:, ROOT_CHILDREN:]
    target = torch.cat([p0.expand(draws, 1, VOCAB), p1[first], p2[second_parent, second]], dim=1)
    draft = torch.cat([q0.expand(draws, 1, VOCAB), q1[first], q1[second]], dim=1)
    return target, draft


def first_two_tokens(paths, p1, generator):
    """(x1, x2) per request; x2 drawn from the target when the step emitted only x1."""
    out = paths.output_token_ids
    x1 = out[:, 0]
    fallback = sample_rows(p1[x1], torch.rand(x1.shape, generator=generator, dtype=torch.float64))
    x2 = torch.where(paths.num_accepted >= 1, out[:, 1], fallback)
    return x1, x2


def chi_square_pvalues(x1, x2, p0, p1):
    counts1 = np.bincount(x1.numpy(), minlength=VOCAB)
    counts2 = np.bincount((x1 * VOCAB + x2).numpy(), minlength=VOCAB * VOCAB)
    expect1 = p0.numpy() * x1.numel()
    joint = (p0[:, None] * p1).reshape(-1).numpy()
    expect2 = joint / joint.sum() * x1.numel()
    return chisquare(counts1, expect1).pvalue, chisquare(counts2, expect2).pvalue


def biased_accept(tokens, parents, num_nodes, target, draft, uniforms):
    """The paper code's rule: each child accepted with min(1, p/q) against the *unmodified* p, q;
    if all are rejected the target token is drawn from p itself (no residual). Not lossless."""
    draws, budget = tokens.shape
    index = torch.arange(draws)
    current = torch.zeros(draws, dtype=torch.long)
    active = torch.ones(draws, dtype=torch.bool)
    emitted, accepted = [], torch.zeros(draws, dtype=torch.long)
    # every request has the same tree shape, so request 0's child table serves all
    parent_list = parents[0].tolist()
    children = [[i + 1 for i in range(budget) if parent_list[i] == c] for c in range(budget + 1)]
    max_children = max(len(c) for c in children)
    table = torch.zeros(budget + 1, max_children, dtype=torch.long)
    for c, rows in enumerate(children):
        table[c, : len(rows)] = torch.tensor(rows, dtype=torch.long) if rows else 0
    for _ in range(budget + 1):
        p, q, u = target[index, current], draft[index, current], uniforms[index, current]
        chosen = torch.zeros(draws, dtype=torch.long)
        child_rows = table[current]
        for slot in range(min(max_children, u.shape[1] - 1)):
            row = child_rows[:, slot]
            token = tokens[index, (row - 1).clamp(min=0)]
            ok = (row > 0) & (chosen == 0) & (u[:, slot] * q[index, token] < p[index, token])
            chosen = torch.where(ok, row, chosen)
        bonus = sample_rows(p, u[:, -1])
        emitted.append(torch.where(active, torch.where(chosen > 0, tokens[index, (chosen - 1).clamp(min=0)], bonus), -1))
        moved = active & (chosen > 0)
        accepted += moved.long()
        if not moved.any():
            break
        current = torch.where(moved, chosen, current)
        active = moved
    out = torch.stack(emitted + [torch.full((draws,), -1)] * (budget + 1 - len(emitted)), 1)
    return AcceptedPaths(accepted_rows=torch.full_like(out, -1), output_token_ids=out, num_accepted=accepted)


@pytest.fixture(scope="module")
def model():
    return target_model(torch.Generator().manual_seed(1234))


def test_sample_accept_follows_target(model):
    p0, p1, p2, q0, q1 = model
    generator = torch.Generator().manual_seed(7)
    # Deterministic children: the draft's top tokens (any choice is lossless for sample_accept).
    first = q0.topk(ROOT_CHILDREN).indices.expand(DRAWS, -1)
    second = q1[first].topk(GRAND_CHILDREN, dim=-1).indices
    tokens, parents, num_nodes = depth_two_tree(first, second)
    target, _ = row_distributions(tokens, p0, p1, p2, q0, q1)
    uniforms = torch.rand(DRAWS, BUDGET + 1, generator=generator, dtype=torch.float64)
    paths = sample_accept(tokens, parents, num_nodes, target, uniforms)
    assert paths.num_accepted.float().mean() > 0.5  # the tree is actually used
    p_first, p_joint = chi_square_pvalues(*first_two_tokens(paths, p1, generator), p0, p1)
    assert p_first > 1e-3 and p_joint > 1e-3


def sampled_tree(model, generator, slots=ROOT_CHILDREN):
    p0, p1, p2, q0, q1 = model
    first = sample_without_replacement(q0.expand(DRAWS, -1), ROOT_CHILDREN, generator)
    second = sample_without_replacement(q1[first].reshape(-1, VOCAB), GRAND_CHILDREN, generator)
    tokens, parents, num_nodes = depth_two_tree(first, second.reshape(DRAWS, ROOT_CHILDREN, GRAND_CHILDREN))
    target, draft = row_distributions(tokens, p0, p1, p2, q0, q1)
    uniforms = torch.rand(DRAWS, BUDGET + 1, slots + 1, generator=generator, dtype=torch.float64)
    return tokens, parents, num_nodes, target, draft, uniforms


@pytest.mark.parametrize("slots", [ROOT_CHILDREN, 1])  # 1: later children are never tried
def test_recursive_rejection_follows_target(model, slots):
    generator = torch.Generator().manual_seed(11)
    tokens, parents, num_nodes, target, draft, uniforms = sampled_tree(model, generator, slots)
    paths = recursive_rejection_accept(tokens, parents, num_nodes, target, draft, uniforms)
    assert paths.num_accepted.float().mean() > 0.8
    p_first, p_joint = chi_square_pvalues(*first_two_tokens(paths, model[1], generator), model[0], model[1])
    assert p_first > 1e-3 and p_joint > 1e-3


def test_recursive_rejection_is_deterministic_given_uniforms(model):
    generator = torch.Generator().manual_seed(5)
    inputs = [tensor[:2000] for tensor in sampled_tree(model, generator)]
    first = recursive_rejection_accept(*inputs)
    second = recursive_rejection_accept(*inputs)
    assert torch.equal(first.output_token_ids, second.output_token_ids)
    assert torch.equal(first.accepted_rows, second.accepted_rows)


def test_biased_rule_is_detected(model):
    generator = torch.Generator().manual_seed(13)
    tokens, parents, num_nodes, target, draft, uniforms = sampled_tree(model, generator)
    paths = biased_accept(tokens, parents, num_nodes, target, draft, uniforms)
    p_first, p_joint = chi_square_pvalues(*first_two_tokens(paths, model[1], generator), model[0], model[1])
    assert p_first < 1e-6 and p_joint < 1e-6


def test_sample_rows_inverse_cdf():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]])
    uniforms = torch.tensor([0.0, 0.49, 0.5, 0.999999, 1.0 - 1e-12])
    tokens = sample_rows(probs.expand(5, -1), uniforms)
    assert tokens.tolist() == [1, 1, 3, 3, 3]


def test_child_order_decides_which_sibling_is_tried_first(model):
    p0, p1, _, q0, _ = model
    generator = torch.Generator().manual_seed(3)
    draws = 2000
    first = sample_without_replacement(q0.expand(draws, -1), ROOT_CHILDREN, generator)
    parents = torch.zeros(draws, ROOT_CHILDREN, dtype=torch.long)
    num_nodes = torch.full((draws,), ROOT_CHILDREN)
    uniforms = torch.rand(draws, ROOT_CHILDREN + 1, ROOT_CHILDREN + 1, generator=generator, dtype=torch.float64)

    def rows(tokens):
        target = torch.cat([p0.expand(draws, 1, VOCAB), p1[tokens]], 1)
        draft = torch.cat([q0.expand(draws, 1, VOCAB), q0.expand(draws, ROOT_CHILDREN, VOCAB)], 1)
        return target, draft

    in_order = recursive_rejection_accept(first, parents, num_nodes, *rows(first), uniforms)
    flipped = first.flip(1)
    # Row uniforms must follow the rows: rows 1..3 swap places when the children are flipped.
    flipped_uniforms = torch.cat([uniforms[:, :1], uniforms[:, 1:].flip(1)], 1)
    rank = torch.arange(ROOT_CHILDREN - 1, -1, -1).expand(draws, -1)
    reordered = recursive_rejection_accept(flipped, parents, num_nodes, *rows(flipped), flipped_uniforms,
                                           child_order=rank)
    assert torch.equal(in_order.output_token_ids, reordered.output_token_ids)
    assert torch.equal(in_order.num_accepted, reordered.num_accepted)
