"""Orderings shared by graph drafting and unrolling (compiled with numba, called from their loops).

Both need "the best items by probability, ties in creation order" for a few dozen items at a
time: the budget's best new nodes of a request, the best paths of its tree, the tree's rows by
depth. numpy's sorts cost microseconds of overhead per call at that size, and numba's take long
to compile, so these are written out: a quickselect for a threshold, and placement by rank
within a group. Values are path probabilities: >= 0, no NaN (+inf allowed).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, error_model="numpy")
def kth_largest(values: np.ndarray, k: int) -> float:
    """The k-th largest of `values` (1 <= k <= size), which it reorders (quickselect)."""
    lo, hi, want = 0, values.size - 1, k - 1  # the answer's position in descending order
    while lo < hi:
        pivot = values[(lo + hi) >> 1]
        i, j = lo, hi
        while i <= j:  # Hoare partition, descending: [lo, j] >= pivot >= [i, hi]
            while values[i] > pivot:
                i += 1
            while values[j] < pivot:
                j -= 1
            if i <= j:
                values[i], values[j] = values[j], values[i]
                i += 1
                j -= 1
        if want <= j:
            hi = j
        elif want >= i:
            lo = i
        else:
            return values[want]
    return values[want]


@njit(cache=True, nogil=True, error_model="numpy")
def keep_best(items: np.ndarray, value: np.ndarray, keep: int) -> np.ndarray:
    """The `keep` best of `items` by value[item] descending, ties to the earlier item, in their
    given order: a threshold by selection, then one pass."""
    if keep <= 0:
        return items[:0]
    if keep >= items.size:
        return items
    values = np.empty(items.size)
    for i in range(items.size):
        values[i] = value[items[i]]
    threshold = kth_largest(values.copy(), keep)
    ties = keep  # how many at the threshold are kept: what the better ones leave
    for v in values:
        if v > threshold:
            ties -= 1
    kept = np.empty(keep, np.int64)
    num_kept = 0
    for i in range(items.size):
        if values[i] > threshold or (values[i] == threshold and ties > 0):
            if values[i] == threshold:
                ties -= 1
            kept[num_kept] = items[i]
            num_kept += 1
    return kept


@njit(cache=True, nogil=True, error_model="numpy")
def order_by_value_within_groups(items: np.ndarray, group: np.ndarray, value: np.ndarray) -> np.ndarray:
    """`items` (indices into group and value, group[item] non-decreasing) with each run of one
    group sorted by value[item] descending, stably: equal items keep their given order.

    Each item of a run is placed by its rank, the number of items of the run that are larger,
    or equal and given earlier: n^2 branch-free comparisons (vectorized), which beat a branching
    sort for the few dozen paths of one depth. Runs over 256 items (many copies of equal
    probability) are merge-sorted instead."""
    count = items.size
    order, values = np.empty_like(items), np.empty(count)
    for i in range(count):
        values[i] = value[items[i]]
    start = 0
    while start < count:
        end = start + 1
        while end < count and group[items[end]] == group[items[start]]:
            end += 1
        if end - start <= 256:
            for i in range(start, end):
                v, rank = values[i], 0
                for j in range(start, i):
                    rank += values[j] >= v
                for j in range(i + 1, end):
                    rank += values[j] > v
                order[start + rank] = items[i]
        else:
            order[start:end] = _merge_sort_desc(items[start:end], values[start:end])
        start = end
    return order


@njit(cache=True, nogil=True, error_model="numpy")
def _merge_sort_desc(items: np.ndarray, values: np.ndarray) -> np.ndarray:
    """`items` stably sorted by their `values` descending (bottom-up merges)."""
    count = items.size
    order, keys = items.copy(), values.copy()
    other, other_keys = np.empty_like(order), np.empty_like(keys)
    run = 1
    while run < count:
        for lo in range(0, count, 2 * run):
            mid, hi = min(lo + run, count), min(lo + 2 * run, count)
            i, j = lo, mid
            for out in range(lo, hi):
                if j < hi and (i >= mid or keys[j] > keys[i]):  # the right one only when strictly first
                    other[out], other_keys[out] = order[j], keys[j]
                    j += 1
                else:
                    other[out], other_keys[out] = order[i], keys[i]
                    i += 1
        order, other = other, order
        keys, other_keys = other_keys, keys
        run *= 2
    return order
