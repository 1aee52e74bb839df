"""Vectorized orderings shared by graph drafting and unrolling (numpy, CPU).

Both need "the best items of each request by probability, ties in creation order" many times per
step, on a few thousand items. numpy's stable argsort of floats (timsort) and searchsorted are
slow at that size, while np.sort of 64-bit integers is fast (SIMD); so items are ordered by
sorting packed keys: group | leading bits of the probability | item index.
"""

from __future__ import annotations

import numpy as np

_NOT_FLOAT_BITS = np.uint64(0x7FFF_FFFF_FFFF_FFFF)


def order_by_group_then_value_desc(group: np.ndarray, value: np.ndarray,
                                   ordered_below: int | None = None) -> np.ndarray | None:
    """Permutation sorting items by group ascending, then value descending, then index ascending.

    group: int64 [n], >= 0; value: float64 [n], >= 0 (+inf allowed; no NaN, no -0.0).
    ordered_below: items from this index on have no meaningful index order; if one of them ties
    (same group and value) with another item, None is returned instead.
    Non-negative floats order like their bit patterns, so the key keeps the leading bits of
    ~value between the group and the index. Two values of one group that share those leading
    bits but differ further down ("near ties") would be ordered by index instead of value: that
    is checked, and such inputs are sorted exactly by lexsort.
    """
    count = value.size
    if count <= 1:
        return np.arange(count)
    index_bits = (count - 1).bit_length()
    value_bits = min(63, 64 - index_bits - int(group.max()).bit_length())
    if value_bits < 24:  # too few bits left to be useful
        return _exact_order(group, value, ordered_below)
    key = group.astype(np.uint64) << np.uint64(value_bits)
    key |= (_NOT_FLOAT_BITS - value.view(np.uint64)) >> np.uint64(63 - value_bits)
    key <<= np.uint64(index_bits)
    key |= np.arange(count, dtype=np.uint64)
    key.sort()
    order = (key & np.uint64((1 << index_bits) - 1)).astype(np.int64)
    key >>= np.uint64(index_bits)
    tied = (key[1:] == key[:-1]).nonzero()[0]  # same group and leading bits
    if tied.size == 0:
        return order
    if ordered_below is not None and ((order[tied] >= ordered_below) | (order[tied + 1] >= ordered_below)).any():
        return None  # (a near tie too, possibly; the caller falls back to ordered ids)
    if (value[order[tied]] != value[order[tied + 1]]).any():
        return _exact_order(group, value, ordered_below)  # a near tie: exact (stable) fallback
    return order


def _exact_order(group: np.ndarray, value: np.ndarray, ordered_below: int | None) -> np.ndarray | None:
    order = np.lexsort((-value, group))
    if ordered_below is not None:
        tied = ((group[order[1:]] == group[order[:-1]]) & (value[order[1:]] == value[order[:-1]])).nonzero()[0]
        if ((order[tied] >= ordered_below) | (order[tied + 1] >= ordered_below)).any():
            return None
    return order


def stable_order_small(key: np.ndarray) -> np.ndarray:
    """Stable argsort of non-negative integers; a radix sort when they fit 16 bits."""
    if key.size and key.max() < 2**16:
        return np.argsort(key.astype(np.uint16), kind="stable")
    return np.argsort(key, kind="stable")


def position_in_group(sorted_group: np.ndarray, num_groups: int) -> np.ndarray:
    """Index of each item among the items of its group; `sorted_group` is non-decreasing."""
    count = np.bincount(sorted_group, minlength=num_groups)
    start = count.cumsum() - count
    return np.arange(sorted_group.size) - start[sorted_group]


def best_in_group(sorted_group: np.ndarray, value: np.ndarray, keep: np.ndarray,
                  count: np.ndarray | None = None) -> np.ndarray:
    """bool [n]: for items grouped by `sorted_group` (non-decreasing, int64 in 0..G-1), the
    keep[g] best of each group g by value descending, ties by index. value: float64, > -inf.
    count: the items per group, if known (np.bincount(sorted_group, minlength=G)).

    Each group's threshold (its keep[g]-th best value) comes from one row-wise sort of a dense
    [G, largest group] copy of the values; only ties at a threshold need the index order.
    """
    num_groups = keep.size
    if count is None:
        count = np.bincount(sorted_group, minlength=num_groups)
    position = np.arange(sorted_group.size) - (count.cumsum() - count)[sorted_group]
    columns = int(count.max())
    dense = np.full(num_groups * columns, -np.inf)
    dense[sorted_group * columns + position] = value
    dense = np.sort(dense.reshape(num_groups, columns), axis=1).reshape(-1)  # ascending rows
    at = np.arange(num_groups) * columns + np.minimum(np.maximum(columns - keep, 0), columns - 1)
    threshold = dense[at]
    threshold[keep <= 0] = np.inf
    item_threshold = threshold[sorted_group]
    kept = value >= item_threshold
    tie_below = (keep > 0) & (keep < columns) & (threshold > -np.inf) & (dense[np.maximum(at - 1, 0)] == threshold)
    if tie_below.any():  # ties at a threshold: the first ones fill what the better ones left
        kept = value > item_threshold
        room = keep - np.bincount(sorted_group[kept], minlength=num_groups)
        tied = (value == item_threshold).nonzero()[0]
        tied_group = sorted_group[tied]
        kept[tied[position_in_group(tied_group, num_groups) < room[tied_group]]] = True
    return kept


def best_of_runs(run_start: np.ndarray, run_of: np.ndarray, value: np.ndarray,
                 tie: np.ndarray) -> np.ndarray:
    """For items laid out in runs (run r = items run_start[r] .. run_start[r+1] - 1, run_of[i] =
    the run of item i): the `tie` of each run's best item, highest value then lowest tie."""
    best_value = np.maximum.reduceat(value, run_start)
    candidate_tie = np.where(value == best_value[run_of], tie, np.iinfo(np.int64).max)
    return np.minimum.reduceat(candidate_tie, run_start)


def runs_of_equal(sorted_key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(run_start, run_of) of the runs of equal values in a sorted array."""
    new_run = np.empty(sorted_key.size, dtype=bool)
    new_run[:1] = True
    np.not_equal(sorted_key[1:], sorted_key[:-1], out=new_run[1:])
    return new_run.nonzero()[0], new_run.cumsum() - 1
