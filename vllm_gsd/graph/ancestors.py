"""Ancestor bitmasks over the rows of a tree (the contracts.md `ancestor_words` layout).

Bit `c % 32` of word `c // 32` in row `r` is set iff row `c` is an ancestor of row `r` or `r`
itself. Words are int32, so bit 31 is the sign bit: only bitwise operations are meaningful.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch


def num_ancestor_words(num_rows: int) -> int:
    """W = cdiv(num_rows, 32) int32 words hold one bit per row."""
    return (num_rows + 31) // 32


def _bit_values_int64() -> list[int]:
    # int32 two's complement value of bit j: bit 31 is the sign bit.
    return [(1 << j) if j < 31 else -(1 << 31) for j in range(32)]


@lru_cache(maxsize=64)
def own_bit_words_numpy(num_rows: int) -> np.ndarray:
    """int32 [num_rows, W]: row r has only its own bit set (cached, read-only: copy to modify)."""
    words = np.zeros((num_rows, num_ancestor_words(num_rows)), dtype=np.int32)
    rows = np.arange(num_rows)
    words[rows, rows // 32] = np.array(_bit_values_int64(), dtype=np.int64)[rows % 32].astype(np.int32)
    words.flags.writeable = False
    return words


def own_bit_words(num_rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 [num_rows, W]: row r has only its own bit set (torch twin of own_bit_words_numpy)."""
    rows = torch.arange(num_rows, device=device)
    word_of_row = rows // 32
    # int32 value of bit j, made where it is used (no host copy): bit 31 is the sign bit.
    bit = torch.arange(32, dtype=torch.int32, device=device)
    bit_values = torch.where(bit < 31, torch.ones_like(bit) << bit.clamp(max=30), torch.iinfo(torch.int32).min)
    words = torch.zeros(num_rows, num_ancestor_words(num_rows), dtype=torch.int32, device=device)
    words[rows, word_of_row] = bit_values[rows % 32]
    return words


def ancestor_words_from_parents(parent_row: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """Ancestor bitmasks of flattened trees, the reference for the Triton kernel.

    parent_row: int64 [B, N], parent row of node row i+1 (0 = root, always < i+1), -1 padded.
    num_nodes: int64 [B], n_b <= N.
    Returns int32 [B, N + 1, W], W = cdiv(N + 1, 32): row r holds the bits of r and all its
    ancestors; row 0 only bit 0; rows past n_b only their own bit.

    Pointer doubling: after k rounds each row has OR-ed in every ancestor at distance <= 2^k,
    so ceil(log2 N) rounds cover any depth with no loop over nodes.
    """
    batch, budget = parent_row.shape
    num_rows = budget + 1
    device = parent_row.device
    rows = torch.arange(num_rows, device=device)
    node_rows = rows[1:].expand(batch, budget)
    is_node = node_rows <= (num_nodes if num_nodes.device == device else num_nodes.to(device)).view(batch, 1)
    valid_parent = is_node & (parent_row >= 0) & (parent_row < node_rows)
    # Rows without a real parent (root, padding) point at themselves: a fixed point of the jump.
    jump = torch.cat(
        [torch.zeros(batch, 1, dtype=torch.long, device=device),
         torch.where(valid_parent, parent_row, node_rows)],
        dim=1,
    )
    own = own_bit_words(num_rows, device).expand(batch, -1, -1)
    num_words = own.shape[-1]
    words = own | torch.gather(own, 1, jump.unsqueeze(-1).expand(-1, -1, num_words))
    covered = 1  # distances 0..covered are in `words`
    while covered < budget:
        words = words | torch.gather(words, 1, jump.unsqueeze(-1).expand(-1, -1, num_words))
        jump = torch.gather(jump, 1, jump)
        covered *= 2
    return words.contiguous()
