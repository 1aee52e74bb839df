"""The merge rule's two indexes, compiled for level_kernel.py: which drafted nodes share an
n-gram, and which reach which.

Drafted n-grams are found through an open-addressing hash table per request (Fibonacci hashing
on the n-gram's tokens; a hit is confirmed token by token, so a collision costs only time), its
slots heading chains of the drafted rows with one n-gram. "Drafted row m reaches node x" is bit
m-1 of x's reachability words, kept transitively closed as edges are added. Arrays are flat by
node id b * (N + 1) + row (level_kernel.MergeState).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, error_model="numpy")
def first_slot(h, mask):
    """The first slot of hash h in a table of mask + 1 slots: its high bits (Fibonacci hashing)."""
    return np.int64(h >> np.uint64(40)) & mask


@njit(cache=True, nogil=True, error_model="numpy")
def child_hash(gram, parent_node, t, multiplier):
    """Hash of the n-gram (gram[parent_node, 1:], t) of a proposed child."""
    h = np.uint64(0)
    for i in range(1, gram.shape[1]):
        h = (h ^ np.uint64(gram[parent_node, i] + 1)) * multiplier
    return (h ^ np.uint64(t + 1)) * multiplier


@njit(cache=True, nogil=True, error_model="numpy")
def is_childs_gram(gram, node, parent_node, t):
    """Whether node's n-gram is (gram[parent_node, 1:], t)."""
    last = gram.shape[1] - 1
    for i in range(last):
        if gram[node, i] != gram[parent_node, i + 1]:
            return False
    return gram[node, last] == t


@njit(cache=True, nogil=True, error_model="numpy")
def same_tokens(gram, node, other, first_column):
    """Whether gram[node, first_column:] == gram[other, first_column:]: from column 0, two nodes
    have one n-gram; from column 1, children of the two with one token would."""
    for i in range(first_column, gram.shape[1]):
        if gram[node, i] != gram[other, i]:
            return False
    return True


@njit(cache=True, nogil=True, error_model="numpy")
def find_drafted(b, base, parent_node, t, h, gram, drafted_table):
    """The first row of request b's chain of drafted nodes with the n-gram (gram[parent_node,
    1:], t) of hash h, 0 if none."""
    mask = drafted_table.shape[1] - 1
    slot = first_slot(h, mask)
    while drafted_table[b, slot]:
        if is_childs_gram(gram, base + drafted_table[b, slot], parent_node, t):
            return drafted_table[b, slot]
        slot = (slot + 1) & mask
    return 0


@njit(cache=True, nogil=True, error_model="numpy")
def insert_drafted(b, base, row, h, gram, drafted_table, next_same):
    """Add drafted row `row` of request b, whose n-gram hashes to h (its candidate's hash), to
    its n-gram's chain (at the front)."""
    node = base + row
    mask = drafted_table.shape[1] - 1
    slot = first_slot(h, mask)
    while drafted_table[b, slot]:
        head = drafted_table[b, slot]
        if same_tokens(gram, base + head, node, 0):
            next_same[node] = head
            drafted_table[b, slot] = row
            return
        slot = (slot + 1) & mask
    next_same[node] = 0
    drafted_table[b, slot] = row


@njit(cache=True, nogil=True, error_model="numpy")
def reaches(reach, node, m):
    """Whether drafted row m reaches flat node `node`."""
    return (reach[node, (m - 1) >> 6] >> np.uint64((m - 1) & 63)) & np.uint64(1) != 0


@njit(cache=True, nogil=True, error_model="numpy")
def add_reach_edge(reach, base, drafted, src_node, dst):
    """Record the pseudo edge src -> drafted row dst: every node reachable from dst (rows
    1..drafted whose set holds dst) gains every node that reaches src. (The ordering rule
    keeps src out of them, so src's set does not change meanwhile.)"""
    for x in range(1, drafted + 1):
        if reaches(reach, base + x, dst):
            or_into(reach, base + x, src_node)


@njit(cache=True, nogil=True, error_model="numpy")
def or_into(reach, node, other):
    """reach[node] |= reach[other] (one uint64 word at a time, no temporary)."""
    for w in range(reach.shape[1]):
        reach[node, w] |= reach[other, w]
