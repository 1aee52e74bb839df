"""Orderings shared by graph drafting and unrolling (compiled with numba, called from their loops).

Both need "the best items by probability, ties in creation order" for a few dozen items at a
time: the budget's best new nodes of a request, the best paths of its tree, the tree's rows by
depth. numpy's sorts cost microseconds of overhead per call at that size, and numba's own compile
for a long time, so these are written out: a quickselect for a threshold and a stable merge sort.
Values are path probabilities: >= 0, no NaN (+inf allowed).
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
def order_by_group_then_value_desc(items: np.ndarray, group: np.ndarray, value: np.ndarray) -> np.ndarray:
    """`items` (indices into group and value) stably sorted by group[item] ascending, then
    value[item] descending: equal items keep their given order. Insertion sort in runs of 64
    (the usual whole input: a request's paths, already by depth when generated breadth-first,
    so that items move only within their depth), then bottom-up merges. Keys are copied next
    to the items, so that comparisons read memory in order."""
    count = items.size
    order, keys, values = items.copy(), np.empty(count, np.int64), np.empty(count)
    for i in range(count):
        keys[i], values[i] = group[items[i]], value[items[i]]
    run = 64
    for start in range(0, count, run):
        for i in range(start + 1, min(start + run, count)):
            item, key, v = order[i], keys[i], values[i]
            j = i
            while j > start and (key < keys[j - 1] or (key == keys[j - 1] and v > values[j - 1])):
                order[j], keys[j], values[j] = order[j - 1], keys[j - 1], values[j - 1]
                j -= 1
            order[j], keys[j], values[j] = item, key, v
    other, other_keys, other_values = np.empty_like(order), np.empty_like(keys), np.empty_like(values)
    while run < count:
        for lo in range(0, count, 2 * run):
            mid, hi = min(lo + run, count), min(lo + 2 * run, count)
            i, j = lo, mid
            for out in range(lo, hi):
                # Take the right one only when it sorts strictly first: equal items keep their order.
                if j < hi and (i >= mid or keys[j] < keys[i] or (keys[j] == keys[i] and values[j] > values[i])):
                    other[out], other_keys[out], other_values[out] = order[j], keys[j], values[j]
                    j += 1
                else:
                    other[out], other_keys[out], other_values[out] = order[i], keys[i], values[i]
                    i += 1
        order, other = other, order
        keys, other_keys = other_keys, keys
        values, other_values = other_values, values
        run *= 2
    return order
