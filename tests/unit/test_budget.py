"""The adaptive node budget (vllm_gsd.policy): cost curves, calibration, choices."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from vllm_gsd.graph import GraphBuilder, GraphParams
from vllm_gsd.policy import AcceptanceModel, CostCurve, NodeBudgetPolicy, StepForecast, StepKind, best_step

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
    assert list(noisy.seconds) == [0.1, 0.12, 0.12]


def test_a_timing_spike_at_few_tokens_does_not_price_every_tree():
    # Measured on a busy 2-core machine: 2 tokens hit an interrupt. The forward is flat up to 6.
    spiked = CostCurve((1, 2, 3, 4, 6, 8), (0.0010, 0.0021, 0.0010, 0.0011, 0.0011, 0.0014))
    assert spiked(2) == pytest.approx(0.0010)
    policy = _policy(spiked, draft_cost=CostCurve((1,), (0.0002,)), node_budget=4, max_depth=2)
    chosen = policy.select(np.array([[0.3, 0.2, 0.1, 0.05]]), np.array([[1, 1, 2, 2]]), np.array([4]),
                           num_other_tokens=0, draft_seconds=0.0004)
    assert chosen.node_budget[0] > 0  # nodes with a fair chance are verified


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
        step = best_step(base, gains, fixed, CPU_LIKE)
        k, rate = step.num_nodes, step.rate
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


def _teach(policy, path_prob, depth, level_rows, drafted_depth=None, draft_seconds=0.2):
    """One drafted step as the proposer reports it: its forwards' rows, then its trees."""
    for level, rows in enumerate(level_rows):
        policy.observe_forward(level, rows, 1)
    num_nodes = np.full(path_prob.shape[0], path_prob.shape[1])
    policy.select(path_prob, depth, num_nodes, num_other_tokens=0, draft_seconds=draft_seconds,
                  drafted_depth=drafted_depth)


def test_at_high_load_the_policy_stops_drafting_and_at_low_load_it_drafts():
    policy = _policy(CPU_LIKE, draft_cost=CostCurve((1, 8, 64, 512), (0.04, 0.045, 0.16, 1.1)),
                     node_budget=8, max_depth=4)
    # Teach it a typical tree: a confident chain of 4 plus siblings.
    _teach(policy, np.tile([0.9, 0.8, 0.7, 0.6, 0.2, 0.15, 0.1, 0.05], (2, 1)),
           np.tile([1, 2, 3, 4, 1, 2, 2, 3], (2, 1)), level_rows=[2, 2, 2, 2])
    pays = policy.should_draft(num_tree_requests=1, num_other_tokens=0)
    assert pays and pays.num_requests is None  # a step that pays drafts every tree request
    assert 1 <= pays.depth <= 4
    assert not policy.should_draft(num_tree_requests=256, num_other_tokens=0)
    assert not policy.should_draft(num_tree_requests=0, num_other_tokens=3)


def test_the_policy_drafts_as_deep_as_pays():
    """Levels the target accepts with 0.9, 0.8, then 0.1, 0.05: with draft forwards at 40% of a
    target step, two levels pay best; with nearly free ones, all four."""
    path_prob = np.array([[0.9, 0.8, 0.1, 0.05]])
    depth = np.array([[1, 2, 3, 4]])
    costly = _policy(FLAT, draft_cost=CostCurve((1,), (0.04,)), node_budget=4, max_depth=4)
    cheap = _policy(FLAT, draft_cost=CostCurve((1,), (1e-5,)), node_budget=4, max_depth=4)
    for policy in (costly, cheap):
        _teach(policy, path_prob, depth, level_rows=[1, 1, 1, 1])
    assert costly.should_draft(1, 0).depth == 2
    assert cheap.should_draft(1, 0).depth == 4
    forecast = costly.predict(1, 0)
    tokens, seconds = forecast.tokens, forecast.seconds
    # Depth 2: 1 + 0.9 + 0.8 tokens in two draft forwards and one target step; plain: 1 in 0.1 s.
    assert tokens[2] / seconds[2] == pytest.approx(2.7 / (0.08 + 0.1))
    assert (tokens[0], seconds[0]) == (1, pytest.approx(0.1))


def test_a_depth_is_predicted_only_once_a_step_drafted_that_deep():
    policy = _policy(FLAT, draft_cost=CostCurve((1,), (1e-5,)), node_budget=4, max_depth=4)
    _teach(policy, np.array([[0.9, 0.8, 0.0, 0.0]]), np.array([[1, 2, 0, 0]]), level_rows=[1, 1],
           drafted_depth=2)
    rates = policy.predict(1, 0).rates
    assert not np.isnan(rates[:3]).any() and np.isnan(rates[3:]).all()
    assert policy.should_draft(1, 0).depth == 2
    np.testing.assert_allclose(policy.gain_curve(1), [0, 0.9, 0.9, 0.9, 0.9])
    np.testing.assert_allclose(policy.gain_curve(2), [0, 0.9, 1.7, 1.7, 1.7])


def test_a_long_run_of_plain_steps_is_broken_by_one_drafted_step():
    policy = _policy(CostCurve((1, 2), (0.1, 0.2)), draft_cost=CostCurve((1,), (1.0,)), node_budget=4)
    policy.select(np.array([[0.5, 0.2, 0.1, 0.1]]), np.array([[1, 1, 2, 2]]), np.array([4]), 0, 1.0)
    decisions = [policy.should_draft(8, 0) for _ in range(3 * policy.explore_every)]
    assert sum(map(bool, decisions)) == 3
    assert decisions[policy.explore_every - 1] and not any(decisions[: policy.explore_every - 1])
    # Exploring drafts a few trees (their catch-up is what the step costs), not the whole batch.
    assert decisions[policy.explore_every - 1].num_requests == policy.explore_requests < 8


def test_the_expected_draft_cost_counts_the_levels_of_the_depth():
    policy = _policy(FLAT, draft_cost=CostCurve((1, 10), (1.0, 2.0)), max_depth=3)
    policy.observe_forward(0, 1, 1)  # catch-up: 1 row per request
    policy.observe_forward(1, 3, 1)  # level 1: 3 rows; level 2 never drafted (taken as level 1)
    level1 = 1.0 + 2 / 9
    assert policy.expected_draft_seconds(1, depth=1) == pytest.approx(1.0)
    assert policy.expected_draft_seconds(1, depth=3) == pytest.approx(1.0 + 2 * level1)
    assert policy.expected_draft_seconds(2, depth=2) == pytest.approx((1.0 + 1 / 9) + (1.0 + 5 / 9))


def test_learned_scales_carry_real_step_times_into_the_decision():
    """Bare forwards say drafting pays at batch 8; real steps that verify trees take 3x their
    forward's time (attention under the graph mask, input building): then it does not."""
    def taught(learn_scales):
        policy = NodeBudgetPolicy(CPU_LIKE, CostCurve((1, 64), (0.02, 0.05)), node_budget=4,
                                  max_depth=2, learn_scales=learn_scales)
        policy.observe_forward(0, 2, 1)
        policy.observe_forward(1, 3, 1)
        policy.select(np.tile([0.95, 0.9, 0.3, 0.2], (8, 1)), np.tile([1, 2, 1, 2], (8, 1)),
                      np.full(8, 4), 0, 0.04)
        for _ in range(100):
            policy.observe_time(StepKind.PLAIN, 0.11, 0.11)
            policy.observe_time(StepKind.TREE, 0.2, 0.6)
        return policy

    assert taught(learn_scales=False).should_draft(8, 0)
    learned = taught(learn_scales=True)
    assert learned.scale[StepKind.TREE] == pytest.approx(3.0, rel=0.01) and learned.scale[StepKind.PLAIN] == pytest.approx(1.0)
    assert not learned.should_draft(8, 0)


def test_now_and_then_the_policy_drafts_one_level_deeper_than_it_knows():
    """Steps that draft 2 levels teach caps 1 and 2 only; every explore_every drafted steps one
    drafts a third level, so that a deeper tree that would pay is found."""
    policy = _policy(FLAT, draft_cost=CostCurve((1,), (0.04,)), node_budget=4, max_depth=4)
    depths = []
    for _ in range(3 * policy.explore_every):
        decision = policy.should_draft(1, 0)
        depths.append(decision.depth)
        drafted = min(decision.depth, 2) if decision.depth <= 3 else 4
        _teach(policy, np.array([[0.9, 0.8, 0.1, 0.05]]), np.array([[1, 2, 3, 4]]),
               level_rows=[1] * drafted, drafted_depth=decision.depth)
    assert depths[0] == 4  # nothing known: every level
    assert 0 < depths.count(3) <= 4 and depths.count(2) > 2 * policy.explore_every


def _chain_after_two_levels(policy, second_prob: float):
    """A step that drafted the catch-up and one expansion of a chain: depth-1 node 0.9, depth-2
    node 0.9 * second_prob, which the next forward would expand."""
    path_prob = np.array([[0.9, 0.9 * second_prob]])
    return dict(level=2, path_prob=path_prob, depth=np.array([[1, 2]]), num_nodes=np.array([2]),
                frontier_request=np.array([0]), frontier_path_prob=path_prob[0, 1:], num_other_tokens=0)


def test_a_level_is_drafted_while_the_draft_is_sure_enough_to_pay_for_it():
    """A draft forward costs 40% of a target step. Recent children at the third level came with
    probability 0.9 (best) and 0.05: under a sure frontier (path 0.81) the forward adds about
    0.73 expected tokens for 0.4 of a step, more than the step's 2.7 tokens per 1.8 steps; under
    an unsure one (path 0.09) it adds 0.08, and the step stops."""
    policy = _policy(FLAT, draft_cost=CostCurve((1,), (0.04,)), node_budget=8, max_depth=6)
    policy.observe_children(2, np.array([[0.9, 0.05]]))
    assert policy.next_level_pays(**_chain_after_two_levels(policy, 0.9), draft_seconds=0.08)
    assert not policy.next_level_pays(**_chain_after_two_levels(policy, 0.1), draft_seconds=0.08)
    # Nearly free draft forwards: even the unsure frontier is worth a level.
    cheap = _policy(FLAT, draft_cost=CostCurve((1,), (1e-5,)), node_budget=8, max_depth=6)
    cheap.observe_children(2, np.array([[0.9, 0.05]]))
    assert cheap.next_level_pays(**_chain_after_two_levels(cheap, 0.1), draft_seconds=2e-5)


def test_a_level_whose_children_were_never_seen_is_drafted():
    policy = _policy(FLAT, draft_cost=CostCurve((1,), (10.0,)), node_budget=8, max_depth=6)
    policy.observe_children(1, np.array([[0.9, 0.05]]))  # level 2's children: not seen
    assert policy.next_level_pays(**_chain_after_two_levels(policy, 0.1), draft_seconds=20.0)


def test_a_level_pays_against_the_steps_expected_rate_not_its_sunk_cost():
    """A long catch-up already spent makes the step's own rate low; against the rate the step
    was expected to reach (a few tokens a plain step), a level adding 0.08 tokens for 0.4 of a
    step does not pay, however much was spent before it."""
    policy = _policy(FLAT, draft_cost=CostCurve((1,), (0.04,)), node_budget=8, max_depth=6)
    policy.observe_children(2, np.array([[0.9, 0.05]]))
    unsure = _chain_after_two_levels(policy, 0.1)
    assert policy.next_level_pays(**unsure, draft_seconds=5.0)  # its own rate: 1.99 tokens in 5.1 s
    assert not policy.next_level_pays(**unsure, draft_seconds=5.0, rate_to_beat=2.7 / 0.18)


def test_children_beyond_a_requests_node_budget_count_nothing():
    policy = _policy(FLAT, draft_cost=CostCurve((1,), (0.04,)), node_budget=2, max_depth=6)
    policy.observe_children(2, np.array([[0.9, 0.05]]))
    # The graph holds its 2 nodes: the sure frontier's children could not be kept.
    assert not policy.next_level_pays(**_chain_after_two_levels(policy, 0.9), draft_seconds=0.08)


def test_children_pruned_by_the_sibling_ratio_are_not_expected():
    policy = NodeBudgetPolicy(FLAT, CostCurve((1,), (0.04,)), 8, 6, min_child_ratio=0.2)
    policy.observe_children(0, np.array([[0.5, 0.3, 0.05], [0.9, 0.1, 0.0]]))
    # Kept: 0.5, 0.3 (0.05 < 0.2 * 0.5) and 0.9 (0.1 < 0.2 * 0.9); means by rank.
    np.testing.assert_allclose(policy._child_probs[0], [0.7, 0.15, 0.0])


def test_levels_steps_stop_short_of_weigh_less_in_the_expected_draft_cost():
    policy = _policy(FLAT, draft_cost=CostCurve((1,), (1.0,)), max_depth=4)
    for level in range(3):
        policy.observe_forward(level, 1, 1)
    assert policy.expected_draft_seconds(1, depth=3) == pytest.approx(3.0)
    for _ in range(200):  # allowed 3 forwards, every step stopped after 2
        policy.observe_levels(allowed_depth=3, drafted_depth=2)
    assert policy.expected_draft_seconds(1, depth=3) == pytest.approx(2.0, abs=1e-6)
    assert policy.expected_draft_seconds(1, depth=2) == pytest.approx(2.0)


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


class _World:
    """A machine and a cost model. A plain step takes `plain_seconds` for 1 token per request; a
    step drafting d levels truly yields truth[d] = (tokens, seconds) per request-step (its tokens
    swing by +-`swing` from step to step), while the model predicts model[d] = (tokens, seconds)."""

    def __init__(self, plain_seconds, truth, model=None, swing=0.9, seed=0, depths=4):
        self.plain_seconds, self.truth, self.model = plain_seconds, truth, model or truth
        self.swing, self.rng = swing, np.random.default_rng(seed)
        self.depths = depths

    def prediction(self):
        tokens, seconds = np.full(self.depths + 1, np.nan), np.full(self.depths + 1, np.nan)
        tokens[0], seconds[0] = 1.0, self.plain_seconds
        for d, (t, sec) in self.model.items():
            tokens[d], seconds[d] = t, sec
        return StepForecast(tokens, seconds)

    def run(self, referee, steps, num_requests=1):
        """Drive the referee as the engine does; return (steps by arm, seconds, seconds plain
        steps would take for the same tokens)."""
        arms, seconds, plain_seconds = collections.Counter(), 0.0, 0.0
        for _ in range(steps):
            forecast = self.prediction()
            tokens, predicted = forecast.tokens, forecast.seconds
            depth = referee.choose(num_requests, forecast).depth
            arms[depth] += 1
            if depth == 0:
                emitted, took = 1.0, self.plain_seconds
            else:
                mean, took = self.truth[depth]
                emitted = max(1.0, mean + self.rng.choice([-1.0, 1.0]) * self.swing)
            referee.observe(depth, num_requests, emitted, took, tokens[depth], predicted[depth])
            seconds += took
            plain_seconds += emitted * self.plain_seconds
        return arms, seconds, plain_seconds


def _referee(max_depth=4, **kwargs):
    from vllm_gsd.policy import WallClockReferee

    return WallClockReferee(max_depth, **kwargs)


def test_referee_loses_little_to_speculation_that_measures_slower():
    """The model promises 1.5x at every depth; the machine gives 0.2x, 0.6x or 0.9x plain."""
    for ratio in (0.2, 0.6, 0.9):
        truth = {d: (2.0 + d, (2.0 + d) * 0.1 / ratio) for d in range(1, 5)}
        model = {d: (2.0 + d, (2.0 + d) * 0.1 / 1.5) for d in range(1, 5)}
        arms, seconds, plain_seconds = _World(0.1, truth, model).run(_referee(), 3000)
        assert seconds <= 1.03 * plain_seconds, (ratio, arms)


def test_referee_keeps_speculation_that_measures_faster():
    """The model says depth 2 is 1.1x plain, the machine gives 1.5x: plain steps are few."""
    truth = {d: (3.0, 0.2) for d in range(1, 5)}
    model = {d: (3.0, 0.27) for d in range(1, 5)}
    arms, seconds, plain_seconds = _World(0.1, truth, model).run(_referee(), 1000)
    assert arms[0] <= 0.05 * 1000
    assert seconds <= 1.03 * plain_seconds / 1.5


def test_referee_finds_the_fastest_depth_whatever_the_model_says():
    """Depth 2 runs fastest; the model (its costs off by depth) ranks depth 4 first."""
    truth = {1: (2.0, 0.16), 2: (2.8, 0.2), 3: (3.2, 0.25), 4: (3.4, 0.37)}
    model = {1: (2.0, 0.16), 2: (2.8, 0.25), 3: (3.2, 0.3), 4: (3.4, 0.2)}
    arms, seconds, plain_seconds = _World(0.1, truth, model).run(_referee(), 2000)
    assert arms.most_common(1)[0][0] == 2 and arms[2] >= 0.8 * 2000, arms
    assert seconds <= 1.04 * plain_seconds * 0.1 / (0.2 / 2.8)


def test_referee_leaves_a_misjudged_depth_within_a_few_steps():
    """A short run (60 steps, about one batch-1 request of a few hundred tokens): the model ranks
    the deepest drafts first, the machine runs depth 2 fastest; the referee walks there level by
    level and spends most of the run on it."""
    truth = {1: (2.0, 0.16), 2: (2.8, 0.2), 3: (3.2, 0.27), 4: (3.4, 0.37)}
    model = {1: (2.0, 0.16), 2: (2.8, 0.25), 3: (3.2, 0.3), 4: (3.4, 0.2)}
    for seed in range(12):  # the yields swing: the walk must not hang on one unlucky step
        arms, seconds, plain_seconds = _World(0.1, truth, model, seed=seed).run(_referee(), 60)
        assert arms[1] + arms[2] >= 45 and arms[4] <= 6, (seed, arms)
        assert seconds <= 0.85 * plain_seconds, (seed, arms)


def test_referee_judges_each_load_apart():
    referee = _referee()
    slow = {d: (3.0, 0.5) for d in range(1, 5)}
    _World(0.1, slow, {d: (3.0, 0.2) for d in range(1, 5)}).run(referee, 300, num_requests=32)
    fast = {d: (3.0, 0.2) for d in range(1, 5)}
    assert _World(0.1, fast).run(referee, 300, num_requests=1)[0][0] <= 20
    forecast = _World(0.1, fast).prediction()
    assert referee.choose(32, forecast).depth == 0


def test_referee_starts_a_heavier_load_from_what_a_lighter_one_measured():
    """Drafting measured 0.4x plain at batch 8; at batch 32 the model still promises 1.5x. A
    drafted step at 32 requests is the dearest there is: none is tried blindly, the first comes
    at the bounded retry cost. A lighter load is judged afresh (test above)."""
    referee = _referee()
    model = {d: (3.0, 0.2) for d in range(1, 5)}
    _World(0.1, {d: (3.0, 0.75) for d in range(1, 5)}, model).run(referee, 300, num_requests=8)
    arms, _, _ = _World(0.1, {d: (3.0, 0.75) for d in range(1, 5)}, model).run(referee, 60, num_requests=32)
    assert arms[0] == 60, arms


def test_referee_counts_the_catch_up_into_the_cost_of_a_try():
    """Drafting loses (0.6x plain). A try after a plain streak also pays the draft's catch-up on
    the streak (here 4 plain steps' worth): tries come about that much more rarely."""
    def drafted_steps(catch_up_seconds):
        referee, world = _referee(), _World(0.1, {d: (3.0, 0.5) for d in range(1, 5)}, {d: (3.0, 0.2) for d in range(1, 5)})
        arms = collections.Counter()
        for step in range(6000):
            forecast = world.prediction()
            tokens, predicted = forecast.tokens, forecast.seconds
            depth = referee.choose(1, forecast, catch_up_seconds).depth
            arms[depth] += step >= 100  # the tries, not the first measurements
            # The engine leaves the catch-up out of the step it measures (it is the streak's).
            took = 0.1 if depth == 0 else 0.5
            referee.observe(depth, 1, 1.0 if depth == 0 else 3.0, took, tokens[depth], predicted[depth])
        return sum(n for d, n in arms.items() if d)

    tries, tries_with_catch_up = drafted_steps(0.0), drafted_steps(0.4)
    assert tries > 0 and tries_with_catch_up == pytest.approx(tries * 0.5 / 0.9, rel=0.25)


def test_referee_tries_again_and_follows_a_change():
    """Speculation that loses (0.6x plain), then wins (2x: the machine got quieter): found again
    within one retry period (a drafted step measured at 0.5 s, retried once the steps since
    took 0.5 s / explore_share = 50 s: 500 plain steps), then kept."""
    referee = _referee()
    model = {d: (3.0, 0.2) for d in range(1, 5)}
    _World(0.1, {d: (3.0, 0.5) for d in range(1, 5)}, model).run(referee, 500)
    faster = _World(0.1, {d: (3.0, 0.15) for d in range(1, 5)}, model)
    arms, _, _ = faster.run(referee, 1000)
    assert arms[0] <= 500 + 20, arms
    arms, _, _ = faster.run(referee, 2000)
    assert arms[0] <= 0.05 * 2000, arms


def test_referee_measures_plain_steps_first():
    referee = _referee()
    forecast = _World(0.1, {1: (3.0, 0.2)}).prediction()
    assert referee.choose(1, forecast).depth == 0 and not referee.plain_measured(1)
    for _ in range(3):
        referee.observe(0, 1, 1.0, 0.1, 1.0, 0.1)
    assert referee.plain_measured(1) and referee.choose(1, forecast).depth == 1


def test_referee_corrects_cost_per_arm_and_yield_for_all_drafted_arms():
    """Depth 1 steps take twice and yield half what the model says: depth 1's seconds are
    corrected by its own steps, depth 2's (never run) like depth 1's; the yield of both by the
    drafted steps together; a plain step stays as predicted."""
    referee = _referee(max_depth=2, prior_steps=2.0)
    for _ in range(3):
        referee.observe(0, 1, 1.0, 0.1, 1.0, 0.1)
    for _ in range(50):
        referee.observe(1, 1, 1.5, 0.4, 3.0, 0.2)
    corrected = referee.corrected(1, StepForecast(np.array([1.0, 3.0, 4.0]), np.array([0.1, 0.2, 0.25])))
    tokens, seconds = corrected.tokens, corrected.seconds
    assert tokens[0] == 1.0 and seconds[0] == pytest.approx(0.1)
    assert tokens[1] == pytest.approx(1.5, rel=0.05) and seconds[1] == pytest.approx(0.4, rel=0.02)
    assert tokens[2] == pytest.approx(2.0, rel=0.05) and seconds[2] == pytest.approx(0.5, rel=0.02)
    # The yield follows the model's recent bias: steps that yield what the model expects bring it back.
    for _ in range(100):
        referee.observe(1, 1, 3.0, 0.4, 3.0, 0.2)
    tokens = referee.corrected(1, StepForecast(np.array([1.0, 3.0, 4.0]), np.array([0.1, 0.2, 0.25]))).tokens
    assert tokens[2] == pytest.approx(4.0, rel=0.05)


def test_referee_measures_drafting_before_judging_it_on_the_models_first_trees():
    """The model, from its first trees, rates drafting at 0.6x plain; the machine runs it at 1.4x.
    Drafting is measured at once (min_steps steps), found faster, and kept for the run."""
    truth = {d: (3.0, 0.21) for d in range(1, 5)}
    model = {d: (3.0, 0.5) for d in range(1, 5)}
    for seed in range(6):
        arms, seconds, plain_seconds = _World(0.1, truth, model, seed=seed).run(_referee(), 60)
        assert arms[0] <= 6, (seed, arms)
        assert seconds <= 0.85 * plain_seconds, (seed, arms)


def test_referee_averages_an_arms_first_steps_evenly():
    """A first drafted step four times slower than the next ones (a one-time cost) weighs as one
    step of three, not as most of the arm's figure."""
    referee = _referee(max_depth=1)
    for _ in range(3):
        referee.observe(0, 1, 1.0, 0.1, 1.0, 0.1)
    for took in (0.8, 0.2, 0.2):
        referee.observe(1, 1, 3.0, took, 3.0, 0.2)
    seconds = referee.corrected(1, StepForecast(np.array([1.0, 3.0]), np.array([0.1, 0.2]))).seconds
    assert seconds[1] == pytest.approx(0.2 * 4 ** (1 / 3), rel=0.01)


def test_referee_does_not_walk_a_load_whose_catch_up_costs_more_than_the_walk():
    """Eight requests fresh from their prompts: the draft would first catch up on every prompt
    (here 4 s, against 0.5 s a drafted step). The model rates drafting 0.6x plain: drafting is
    left to the bounded retries, which count the catch-up, not walked at once."""
    referee, world = _referee(), _World(0.1, {d: (3.0, 0.5) for d in range(1, 5)}, {d: (3.0, 0.5) for d in range(1, 5)})
    arms = collections.Counter()
    for _ in range(60):
        forecast = world.prediction()
        tokens, predicted = forecast.tokens, forecast.seconds
        depth = referee.choose(8, forecast, catch_up_seconds=4.0).depth
        arms[depth] += 1
        referee.observe(depth, 8, 1.0 if depth == 0 else 3.0, 0.1 if depth == 0 else 0.5, tokens[depth], predicted[depth])
    assert arms[0] == 60, arms


def test_referee_does_not_walk_a_draft_the_model_rates_below_half_the_plain_rate():
    """Batch 8 on 2 cores, as logged: plain steps 0.19 s; a drafted step 1.2 s for about 3.6
    tokens per request (0.57x plain), which the model, from its first trees, rated 0.37x to
    0.45x. Drafting is not walked (under a bar of a quarter of the plain rate it was: 6 to 9
    steps of 1.2 s), only retried at the bounded cost. A walk that starts where the model is
    hopeful (0.57x) ends at its first step if that measures below half the plain rate."""
    truth = {d: (2.0 + 0.4 * d, 0.6 + 0.15 * d) for d in range(1, 5)}
    hopeful_truth = {d: (t, 1.5 * s) for d, (t, s) in truth.items()}  # 0.38x
    for world_truth, model_share, walked in ((truth, 0.8, 0), (hopeful_truth, 1.0, 1)):
        model = {d: (model_share * t, s) for d, (t, s) in truth.items()}
        for seed in range(6):
            arms, seconds, plain_seconds = _World(0.19, world_truth, model, seed=seed).run(_referee(), 200, num_requests=8)
            assert sum(n for d, n in arms.items() if d) == walked, (model_share, seed, arms)
            assert seconds <= plain_seconds + walked * 1.8, (model_share, seed, arms)


def test_referee_walks_on_while_the_measured_rate_is_near_plain():
    """Drafting measures 0.9x plain (the model says 0.6x): the depths next to it are still
    measured (one of them may pay; at one request a walk keeps the estimates fresh after a few
    poor trees), and the run loses little."""
    truth = {d: (3.0, 0.3 / 0.9) for d in range(1, 5)}
    model = {d: (3.0, 0.5) for d in range(1, 5)}
    arms, seconds, plain_seconds = _World(0.1, truth, model, swing=0.0).run(_referee(), 400)
    assert sum(n for d, n in arms.items() if d) >= 6, arms
    assert seconds <= 1.03 * plain_seconds, arms


def test_drafting_pays_back_a_catch_up_only_within_the_tokens_left():
    """A catch-up of 1.6 s (eight fresh prompts: the draft's prefill), drafting 1.25x plain at 8
    requests of 0.15 s plain steps (53 tokens/s): 47 tokens a request save 1.4 s, too few;
    200 save 6 s; an unbounded request, or no catch-up, always pays."""
    from vllm_gsd.policy import pays_back

    plain_rate = 8 / 0.15
    assert not pays_back(plain_rate, 1.25 * plain_rate, 1.6, 8, 47)
    assert pays_back(plain_rate, 1.25 * plain_rate, 1.6, 8, 200)
    assert pays_back(plain_rate, 1.25 * plain_rate, 1.6, 8, None)
    assert pays_back(plain_rate, 1.25 * plain_rate, 0.0, 8, 1)
    assert not pays_back(plain_rate, 0.8 * plain_rate, 0.1, 8, 10_000)  # slower drafting never pays one back


def test_referee_drafts_fresh_requests_only_where_their_catch_up_pays_back():
    """Once drafting has measured 1.5x plain, requests fresh from their prompts (a catch-up of
    2 s) are drafted when they may generate 500 tokens more, not when only 20."""
    truth = {d: (3.0, 0.2) for d in range(1, 5)}
    referee, world = _referee(), _World(0.1, truth)
    world.run(referee, 200)  # both arms measured at this load
    forecast = world.prediction()
    long_depth = referee.choose(1, forecast, catch_up_seconds=2.0, tokens_left=500).depth
    short = referee.choose(1, forecast, catch_up_seconds=2.0, tokens_left=20)
    short_depth, why = short.depth, short.why
    assert long_depth > 0
    assert short_depth == 0 and "would not pay back" in why
