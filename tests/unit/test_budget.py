"""The adaptive node budget (vllm_gsd.graph.budget): cost curves, calibration, choices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_gsd.graph import GraphBuilder, GraphParams
from vllm_gsd.graph.budget import AcceptanceModel, CostCurve, NodeBudgetPolicy, best_rate

FLAT = CostCurve((1,), (0.1,))
# A CPU-like target: flat up to 8 tokens, then linear.
CPU_LIKE = CostCurve((1, 8, 64, 512), (0.10, 0.11, 0.40, 2.80))


def test_cost_curve_interpolates_and_extends_linearly():
    curve = CostCurve((1, 8, 64), (0.1, 0.1, 0.38))
    assert curve(1) == pytest.approx(0.1)
    assert curve(36) == pytest.approx(0.1 + 0.28 * 28 / 56)
    assert curve(128) == pytest.approx(0.38 + 0.005 * 64)  # slope of the last segment
    assert curve(0) == 0.0
    np.testing.assert_allclose(curve(np.array([1, 8])), [0.1, 0.1])


def test_cost_curve_never_lets_more_tokens_look_cheaper():
    noisy = CostCurve.from_points([[16, 0.12], [1, 0.1], [8, 0.15]])
    assert noisy.tokens == (1, 8, 16)
    assert list(noisy.seconds) == [0.1, 0.15, 0.15]


@pytest.mark.parametrize("tokens, seconds", [((), ()), ((1, 1), (0.1, 0.2)), ((0,), (0.1,)),
                                             ((1,), (0.0,)), ((1,), (float("nan"),))])
def test_cost_curve_rejects_bad_points(tokens, seconds):
    with pytest.raises(ValueError):
        CostCurve(tokens, seconds)


def test_best_rate_is_the_brute_force_maximum():
    rng = np.random.default_rng(0)
    for _ in range(50):
        gains = np.sort(rng.uniform(0, 1, rng.integers(0, 40)))[::-1]
        base, fixed = float(rng.integers(1, 9)), float(rng.uniform(0, 0.5))
        k, rate = best_rate(base, gains, fixed, CPU_LIKE)
        rates = [(base + gains[:j].sum()) / (fixed + CPU_LIKE(base + j)) for j in range(gains.size + 1)]
        assert rate == pytest.approx(max(rates))
        assert k == int(np.argmax(rates))


def test_acceptance_model_learns_the_ratio_per_depth():
    model = AcceptanceModel(max_depth=3, prior=1.0)
    rng = np.random.default_rng(1)
    for _ in range(400):
        # One node per depth with draft path probs 0.9, 0.8, 0.7; the target accepts each level
        # with prob 0.5 given the previous: P(reach d) = 0.5^d.
        predicted = np.array([[0.0, 0.9, 0.8, 0.7]])
        accepted = 0
        while accepted < 3 and rng.random() < 0.5:
            accepted += 1
        model.observe(predicted, np.array([accepted]))
    np.testing.assert_allclose(model.scale()[1:], [0.5 / 0.9, 0.25 / 0.8, 0.125 / 0.7], rtol=0.3)


def test_an_underconfident_draft_is_corrected_within_a_few_trees():
    """A draft that is right with little confidence (path probs 0.05 per level, always accepted)."""
    model = AcceptanceModel(max_depth=3)
    for _ in range(5):
        model.observe(np.array([[0.0, 0.05, 0.0025, 0.000125]]), np.array([3]))
    scale = model.scale()
    assert scale[1] > 10 and scale[2] > 100 * scale[1] / 10
    gains = model.node_gain(np.array([0.05, 0.0025, 0.000125]), np.array([1, 2, 3]))
    assert (gains > 0.7).all() and (gains <= 1.0).all()


def test_an_unseen_depth_inherits_the_scale_above_it():
    model = AcceptanceModel(max_depth=4)
    model.observe(np.array([[0.0, 0.5, 0.0, 0.0, 0.0]] * 50), np.zeros(50, dtype=np.int64))
    scale = model.scale()
    assert scale[1] < 0.05
    np.testing.assert_allclose(scale[2:], scale[1])


def _policy(target_cost, draft_cost=FLAT, node_budget=8, max_depth=4):
    return NodeBudgetPolicy(target_cost, draft_cost, node_budget, max_depth)


def test_select_takes_every_useful_node_when_verification_is_free():
    policy = _policy(FLAT, node_budget=4)
    path_prob = np.array([[0.9, 0.5, 0.4, 0.1], [0.8, 0.0, 0.0, 0.0]])
    depth = np.array([[1, 1, 2, 2], [1, 0, 0, 0]])
    selection = policy.select(path_prob, depth, np.array([4, 1]), num_other_tokens=0, draft_seconds=0.0)
    assert selection.node_budget.tolist() == [4, 1]
    assert selection.expected_accepted == pytest.approx(0.9 + 0.5 + 0.4 + 0.1 + 0.8)


def test_select_shrinks_to_the_likeliest_nodes_when_verification_is_expensive():
    half = CostCurve((1, 2), (0.1, 0.15))  # each verified node costs half a plain step
    policy = _policy(half, node_budget=4)
    path_prob = np.array([[0.95, 0.3, 0.9, 0.05]])
    depth = np.array([[1, 1, 2, 2]])
    selection = policy.select(path_prob, depth, np.array([4]), num_other_tokens=0, draft_seconds=0.0)
    # Rates by nodes verified (best first: 0.95, 0.9, 0.3, 0.05): 1 / 0.1 = 10, 1.95 / 0.15 = 13,
    # 2.85 / 0.2 = 14.25, 3.15 / 0.25 = 12.6, 3.2 / 0.3 = 10.7.
    assert selection.node_budget.tolist() == [2]
    assert selection.rate == pytest.approx(14.25)


def test_an_exploring_step_verifies_each_trees_best_nodes_down_to_max_depth():
    expensive = CostCurve((1, 2), (0.1, 10.0))  # no node pays for itself
    policy = _policy(expensive, node_budget=4, max_depth=3)
    path_prob = np.array([[0.95, 0.3, 0.9, 0.05], [0.4, 0.0, 0.0, 0.0]])
    depth = np.array([[1, 1, 2, 2], [1, 0, 0, 0]])
    num_nodes = np.array([4, 1])
    assert policy.select(path_prob, depth, num_nodes, 0, 0.0).node_budget.tolist() == [0, 0]
    # Exploring, without verified nodes nothing would refresh the acceptance estimates.
    assert policy.select(path_prob, depth, num_nodes, 0, 0.0, explore=True).node_budget.tolist() == [3, 1]


def test_at_high_load_the_policy_stops_drafting_and_at_low_load_it_drafts():
    policy = _policy(CPU_LIKE, draft_cost=CostCurve((1, 8, 64, 512), (0.04, 0.045, 0.16, 1.1)),
                     node_budget=8, max_depth=4)
    # Teach it a typical tree: a confident chain of 4 plus siblings.
    path_prob = np.tile([0.9, 0.8, 0.7, 0.6, 0.2, 0.15, 0.1, 0.05], (2, 1))
    depth = np.tile([1, 2, 3, 4, 1, 2, 2, 3], (2, 1))
    for level, rows in enumerate([2, 2, 2, 2]):
        policy.observe_forward(level, rows, 1)
    policy.finish_draft()
    policy.select(path_prob, depth, np.array([8, 8]), num_other_tokens=0, draft_seconds=0.2)
    pays = policy.should_draft(num_tree_requests=1, num_other_tokens=0)
    assert pays and pays.num_requests is None  # a step that pays drafts every tree request
    assert not policy.should_draft(num_tree_requests=256, num_other_tokens=0)
    assert not policy.should_draft(num_tree_requests=0, num_other_tokens=3)


def test_a_long_run_of_plain_steps_is_broken_by_one_drafted_step():
    policy = _policy(CostCurve((1, 2), (0.1, 0.2)), draft_cost=CostCurve((1,), (1.0,)), node_budget=4)
    policy.select(np.array([[0.5, 0.2, 0.1, 0.1]]), np.array([[1, 1, 2, 2]]), np.array([4]), 0, 1.0)
    decisions = [policy.should_draft(8, 0) for _ in range(3 * policy.explore_every)]
    assert sum(map(bool, decisions)) == 3
    assert decisions[policy.explore_every - 1] and not any(decisions[: policy.explore_every - 1])
    # Exploring drafts a few trees (their catch-up is what the step costs), not the whole batch.
    assert decisions[policy.explore_every - 1].num_requests == policy.explore_requests < 8


def test_the_expected_draft_cost_counts_each_forward_as_often_as_it_runs():
    policy = _policy(FLAT, draft_cost=CostCurve((1, 10), (1.0, 2.0)), max_depth=3)
    for step in range(200):  # catch-up and level 1 every step, level 2 every other step
        policy.observe_forward(0, 1, 1)
        policy.observe_forward(1, 3, 1)
        if step % 2:
            policy.observe_forward(2, 6, 1)
        policy.finish_draft()
    # 1 request: catch-up 1 row (1.0 s), level 1 3 rows, level 2 6 rows half the time.
    expected = 1.0 + (1.0 + 2 / 9) + 0.5 * (1.0 + 5 / 9)
    assert policy.expected_draft_seconds(1) == pytest.approx(expected, rel=0.05)


def test_learned_scales_carry_real_step_times_into_the_decision():
    """Bare forwards say drafting pays at batch 8; real steps that verify trees take 3x their
    forward's time (attention under the graph mask, input building): then it does not."""
    def taught(learn_scales):
        policy = NodeBudgetPolicy(CPU_LIKE, CostCurve((1, 64), (0.02, 0.05)), node_budget=4,
                                  max_depth=2, learn_scales=learn_scales)
        policy.observe_forward(0, 2, 1)
        policy.observe_forward(1, 3, 1)
        policy.finish_draft()
        policy.select(np.tile([0.95, 0.9, 0.3, 0.2], (8, 1)), np.tile([1, 2, 1, 2], (8, 1)),
                      np.full(8, 4), 0, 0.04)
        for _ in range(100):
            policy.observe_time("plain", 0.11, 0.11)
            policy.observe_time("tree", 0.2, 0.6)
        return policy

    assert taught(learn_scales=False).should_draft(8, 0)
    learned = taught(learn_scales=True)
    assert learned.scale["tree"] == pytest.approx(3.0, rel=0.01) and learned.scale["plain"] == pytest.approx(1.0)
    assert not learned.should_draft(8, 0)


def test_continue_drafting_weighs_the_next_level_against_its_forward():
    cheap_draft = _policy(FLAT, draft_cost=CostCurve((1,), (1e-6,)))
    costly_draft = _policy(FLAT, draft_cost=CostCurve((1,), (10.0,)))
    gains, frontier = np.array([0.9, 0.8]), np.array([0.8])
    assert cheap_draft.continue_drafting(gains, frontier, 1, 0, draft_seconds=0.05, level=2)
    assert not costly_draft.continue_drafting(gains, frontier, 1, 0, draft_seconds=0.05, level=2)
    assert not cheap_draft.continue_drafting(gains, np.zeros(0), 1, 0, draft_seconds=0.05, level=2)
    assert not cheap_draft.continue_drafting(gains, frontier, 1, 0, draft_seconds=0.05, level=4)


def _random_graph(seed: int, batch: int, budget: int, top_k: int = 3, depth: int = 4, vocab: int = 12):
    generator = torch.Generator().manual_seed(seed)
    params = GraphParams(node_budget=budget, top_k=top_k, max_depth=depth, merge_ngram=1)
    builder = GraphBuilder(params, torch.randint(0, vocab, (batch,), generator=generator),
                           torch.randint(0, vocab, (batch, 2), generator=generator))
    while (frontier := builder.frontier()) is not None:
        probs = torch.softmax(torch.randn(frontier.request_index.numel(), vocab, generator=generator) * 2, -1)
        top_probs, top_ids = probs.topk(top_k, dim=-1)
        builder.expand(top_ids, top_probs)
    return builder


def test_the_selection_cut_by_build_tree_verifies_what_was_chosen():
    builder = _random_graph(3, batch=4, budget=16)
    tree = builder.build_tree()
    policy = _policy(CostCurve((1, 2), (0.1, 0.13)), node_budget=16)
    selection = policy.select(tree.path_prob.numpy(), tree.depth.numpy(), tree.num_nodes.numpy(), 0, 0.0)
    cut = builder.build_tree(node_budget=selection.node_budget)
    assert cut.num_nodes.tolist() == selection.node_budget.tolist()
    assert 0 < int(cut.num_nodes.sum()) < int(tree.num_nodes.sum())
    gains = policy.acceptance.node_gain(cut.path_prob.numpy(), cut.depth.numpy())
    real = np.arange(16)[None, :] < cut.num_nodes.numpy()[:, None]
    assert gains[real].sum() == pytest.approx(selection.expected_accepted)


def _referee_run(referee, steps, plain_rate, spec_rate, num_requests=1):
    """Drive the referee as the engine does (a plain step emits 1 token per request, a
    speculative one 3); return (speculative steps, seconds, seconds plain steps would take)."""
    speculated, seconds, plain_seconds = 0, 0.0, 0.0
    for _ in range(steps):
        allowed, _ = referee.allows(num_requests)
        speculated += allowed
        tokens = num_requests * (3 if allowed else 1)
        took = tokens / (spec_rate if allowed else plain_rate)
        referee.observe(allowed, num_requests, tokens=tokens, seconds=took)
        seconds, plain_seconds = seconds + took, plain_seconds + tokens / plain_rate
    return speculated, seconds, plain_seconds


def test_referee_loses_little_to_speculation_that_measures_slower():
    from vllm_gsd.graph.budget import WallClockReferee

    for spec_rate in (2.0, 6.0, 9.0):  # far slower, slower, a little slower than plain (10)
        referee = WallClockReferee()
        speculated, seconds, plain_seconds = _referee_run(referee, 5000, plain_rate=10.0, spec_rate=spec_rate)
        assert seconds <= 1.03 * plain_seconds, (spec_rate, speculated)
        assert referee.rates(1)[1] < referee.rates(1)[0]


def test_referee_keeps_speculation_that_measures_faster():
    from vllm_gsd.graph.budget import WallClockReferee

    referee = WallClockReferee()
    speculated, seconds, plain_seconds = _referee_run(referee, 1000, plain_rate=10.0, spec_rate=15.0)
    assert speculated >= 0.95 * 1000 and seconds < 0.75 * plain_seconds


def test_referee_judges_each_load_apart():
    from vllm_gsd.graph.budget import WallClockReferee

    referee = WallClockReferee()
    _referee_run(referee, 300, plain_rate=10.0, spec_rate=6.0, num_requests=32)
    assert _referee_run(referee, 300, plain_rate=10.0, spec_rate=15.0, num_requests=1)[0] >= 280
    assert not referee.allows(32)[0]


def test_referee_tries_again_and_follows_a_change():
    """Speculation that loses, then wins (the machine got quieter): found again."""
    from vllm_gsd.graph.budget import WallClockReferee

    referee = WallClockReferee()
    _referee_run(referee, 500, plain_rate=10.0, spec_rate=6.0)
    assert _referee_run(referee, 3000, plain_rate=10.0, spec_rate=20.0)[0] >= 2000


def _observe(referee, speculative, steps, rate, predicted_speedup=None, tokens=3):
    for _ in range(steps):
        referee.observe(speculative, 1, tokens=tokens, seconds=tokens / rate, predicted_speedup=predicted_speedup)


def test_referee_insists_where_drafted_steps_measure_faster_than_the_model_predicts():
    """A model timed in a slow moment predicts 1.1x for the steps it drafts while they measure
    1.5x: a step it would run plainly at a predicted 0.9x is corrected to 1.23x and drafts; one
    at 0.6x (corrected 0.82x) stays plain."""
    from vllm_gsd.graph.budget import WallClockReferee

    referee = WallClockReferee()
    assert not referee.insists(1, 0.9)[0]  # nothing measured
    _observe(referee, False, 5, rate=10.0, tokens=1)
    _observe(referee, True, 5, rate=15.0, predicted_speedup=1.1)
    assert referee.insists(1, 0.9)[0]
    assert not referee.insists(1, 0.6)[0]
    assert not referee.insists(8, 0.9)[0]  # another load: not measured there


def test_referee_never_insists_where_drafted_steps_measure_slower():
    from vllm_gsd.graph.budget import WallClockReferee

    referee = WallClockReferee()
    _observe(referee, False, 5, rate=10.0, tokens=1)
    _observe(referee, True, 5, rate=9.0, predicted_speedup=0.5)  # the model was far too pessimistic
    assert not referee.insists(1, 0.9)[0]


def test_referee_rates_are_tokens_over_seconds_not_a_mean_of_step_rates():
    """Trees accept 1 token in 0.1 s and 5 in 0.9 s in turn: 6 tokens in 1 s, 6 tokens/s. A mean
    of the steps' own rates (10 and 5.6) would say 7.8."""
    from vllm_gsd.graph.budget import WallClockReferee

    referee = WallClockReferee(smoothing=0.05)
    for tokens, seconds in ((1, 0.1), (5, 0.9)) * 100:
        referee.observe(True, 1, tokens=tokens, seconds=seconds)
    assert abs(referee.rates(1)[1] - 6.0) < 0.4
