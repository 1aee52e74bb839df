"""The compiled orderings of the graph core against sorted() on random values, ties included."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_gsd.graph.ordering import keep_best, kth_largest, order_by_value_within_groups


def random_values(rng, count, kind):
    """Distinct, exactly tied, or near-tied (equal but for the last mantissa bit) values, a few +inf."""
    if kind == "ties":
        values = rng.integers(0, 4, count) / 4.0
    else:
        values = rng.random(count)
        if kind == "near":
            values = np.repeat(values[: (count + 2) // 3], 3)[:count]
            values = np.nextafter(values, 2.0 * (rng.random(count) < 0.5))  # one ulp up or down
    values[rng.random(count) < 0.05] = np.inf
    return values


kinds = st.sampled_from(["distinct", "ties", "near"])


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), count=st.integers(1, 300), kind=kinds, data=st.data())
def test_kth_largest_is_the_sorted_value(seed, count, kind, data):
    values = random_values(np.random.default_rng(seed), count, kind)
    k = data.draw(st.integers(1, count))
    assert kth_largest(values.copy(), k) == sorted(values, reverse=True)[k - 1]


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), count=st.integers(0, 300), kind=kinds, data=st.data())
def test_keep_best_keeps_the_best_by_value_then_order(seed, count, kind, data):
    rng = np.random.default_rng(seed)
    value = random_values(rng, count + 5, kind)
    items = np.sort(rng.permutation(count + 5)[:count])
    keep = data.draw(st.integers(0, count + 2))
    best = sorted(range(count), key=lambda i: (-value[items[i]], i))[:keep]
    assert keep_best(items, value, keep).tolist() == items[sorted(best)].tolist()


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), count=st.integers(0, 700), groups=st.integers(1, 8), kind=kinds)
def test_order_by_value_within_groups_is_the_stable_sort(seed, count, groups, kind):
    """Items given by group (as breadth-first paths come by depth), in any order within one;
    runs past 256 items (few groups, many items) take the merge sort."""
    rng = np.random.default_rng(seed)
    group = rng.integers(0, groups, count + 3)
    value = random_values(rng, count + 3, kind)
    items = rng.permutation(count + 3)[:count]
    items = items[np.argsort(group[items], kind="stable")]
    expected = sorted(items.tolist(), key=lambda i: (group[i], -value[i]))  # stable: ties keep input order
    assert order_by_value_within_groups(items, group, value).tolist() == expected
