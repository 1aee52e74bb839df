"""Brute-force references shared by the graph tests."""

import numpy as np
import torch


def ancestor_words_reference(parent_row, num_nodes, budget):
    """Ancestor bitmask words by walking each row up to the root (contracts.md bit layout)."""
    batch = parent_row.shape[0]
    words = (budget + 1 + 31) // 32
    out = np.zeros((batch, budget + 1, words), dtype=np.int64)
    for b in range(batch):
        for row in range(budget + 1):
            node = row
            bits = {row}
            if 1 <= row <= int(num_nodes[b]):
                while node != 0:
                    node = int(parent_row[b, node - 1])
                    bits.add(node)
            for c in bits:
                out[b, row, c // 32] |= 1 << (c % 32)
    out = np.where(out >= 2**31, out - 2**32, out)
    return torch.from_numpy(out.astype(np.int32))
