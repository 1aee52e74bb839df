"""Counter-based uniforms: deterministic per (seed, position), and uniform."""

import numpy as np
from scipy.stats import kstest

from vllm_gsd.graph.counter_rng import counter_uniforms


def test_same_key_same_uniform_and_keys_differ():
    seeds, positions = np.array([1, 1, 2, 7]), np.array([5, 6, 5, 5])
    a, b = counter_uniforms(seeds, positions), counter_uniforms(seeds, positions)
    assert np.array_equal(a, b)
    assert len(set(a.tolist())) == 4
    assert ((a >= 0) & (a < 1)).all()


def test_uniform_over_positions_and_over_seeds():
    positions = np.arange(20_000)
    assert kstest(counter_uniforms(np.full(20_000, 3), positions), "uniform").pvalue > 1e-3
    assert kstest(counter_uniforms(np.arange(20_000), np.full(20_000, 9)), "uniform").pvalue > 1e-3
    # Neighbouring positions are not correlated (lag-1).
    u = counter_uniforms(np.full(20_000, 11), positions)
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.03
