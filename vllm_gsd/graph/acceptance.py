"""Tree acceptance on a batch of flattened verification trees.

Rows follow contracts.md: row 0 is the root, row i+1 is node i. A walk starts at the root; at
row r the target's token for that row decides: if a child of r (a node with parent_row == r)
carries it, the walk moves there, else that token is emitted as the target's own token and the
walk stops. The result is AcceptedPaths in vLLM's SamplerOutput layout. Greedy verification
walks the target's argmax; sampled verification its Gumbel-max draws (engine/sampling.py), so
the rule is the same: exact for any tree.

On device tensors the walk is batched over requests (a loop over walk steps only); CPU tensors
take the same rule compiled (numba): a walk is a few loads per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit


@dataclass
class AcceptedPaths:
    """accepted_rows int64 [B, N + 1]: rows of the accepted path, starting at 0, -1 padded;
    output_token_ids int64 [B, N + 1]: the accepted nodes' tokens then one target token, -1 padded;
    num_accepted int64 [B]: accepted draft nodes a (a + 1 tokens emitted).
    """

    accepted_rows: torch.Tensor
    output_token_ids: torch.Tensor
    num_accepted: torch.Tensor


def walk_tree(draft_token_ids: torch.Tensor, parent_row: torch.Tensor, num_nodes: torch.Tensor,
              row_target_token: torch.Tensor, max_depth: int | None = None) -> AcceptedPaths:
    """Walk each tree along the target's per-row tokens.

    draft_token_ids, parent_row: int64 [B, N]; num_nodes: int64 [B];
    row_target_token: int64 [B, N + 1], the target's token at every row (argmax for greedy, a
    draw for sampling). From row r with target token t: move to the first (lowest-row) child of
    r whose token is t; if none, emit t and stop. Output token j is row_target_token at
    accepted row j, so the accepted nodes' tokens are followed by the target's bonus token.

    First every row's next row is found at once (its lowest-row child carrying the target's
    token at that row); the walk then takes one gather per depth, max_depth of them (at least
    the depth of every tree's deepest node; None: N), with no early exit, so the host never
    waits on the device. A node whose parent is not an earlier row (off contract) is never
    entered. CPU tensors take a compiled loop over the rows instead (each torch op costs
    microseconds; max_depth is not needed there); results are on the inputs' device.
    """
    tensors = (draft_token_ids, parent_row, num_nodes, row_target_token)
    if all(tensor.device.type == "cpu" for tensor in tensors):
        batch, budget = draft_token_ids.shape
        rows, tokens = np.empty((2, batch, budget + 1), dtype=np.int64)
        accepted = np.empty(batch, dtype=np.int64)
        _walk_tree_compiled(*(_int64_array(tensor) for tensor in tensors), rows, tokens, accepted)
        return AcceptedPaths(torch.from_numpy(rows), torch.from_numpy(tokens), torch.from_numpy(accepted))
    return _walk_tree_torch(*tensors, max_depth=max_depth)


def _int64_array(tensor: torch.Tensor) -> np.ndarray:
    """The (CPU) tensor as a contiguous int64 numpy array (one compiled specialization), without
    a copy when it already is one."""
    if tensor.dtype == torch.int64 and not tensor.requires_grad and tensor.is_contiguous():
        return tensor.numpy()
    return np.ascontiguousarray(tensor.detach().to(torch.int64).numpy())


def _walk_tree_torch(draft_token_ids, parent_row, num_nodes, row_target_token,
                     max_depth: int | None = None) -> AcceptedPaths:
    batch, budget = draft_token_ids.shape
    device = draft_token_ids.device
    stop = budget + 1  # a column past the last row, where a walk rests once it has stopped
    rows = torch.arange(1, budget + 1, device=device)
    is_node = (rows <= num_nodes.to(device).unsqueeze(1)) & (parent_row >= 0) & (parent_row < rows)
    parent = torch.where(is_node, parent_row, 0)
    match = is_node & (row_target_token.gather(1, parent) == draft_token_ids)
    next_row = torch.full((batch, budget + 2), stop, dtype=torch.long, device=device)
    next_row.scatter_reduce_(1, torch.where(match, parent, stop), torch.where(match, rows, stop), "amin")

    # Once stopped a walk rests at `stop` (next_row[stop] is stop): a fixed number of gathers,
    # one per depth a path can reach, gives the early-exit walk's result without reading.
    current = torch.zeros(batch, 1, dtype=torch.long, device=device)
    path = [current]
    for _ in range(budget if max_depth is None else max(0, min(int(max_depth), budget))):
        current = next_row.gather(1, current)
        path.append(current)
    path.append(torch.full((batch, budget + 1 - len(path)), stop, dtype=torch.long, device=device))
    path_rows = torch.cat(path, 1)  # [B, N + 1]
    stopped = torch.full((batch, 1), -1, dtype=torch.long, device=device)
    output_token_ids = torch.cat([row_target_token.long(), stopped], 1).gather(1, path_rows)
    accepted_rows = torch.where(path_rows == stop, -1, path_rows)
    return AcceptedPaths(accepted_rows, output_token_ids, (path_rows != stop).sum(1) - 1)


@njit(cache=True, nogil=True, error_model="numpy")
def _walk_tree_compiled(draft_token_ids, parent_row, num_nodes, row_target_token, path, tokens, num_accepted):
    """walk_tree's rule on numpy arrays (same layout), one request at a time, written into
    path, tokens [B, N + 1] and num_accepted [B]. A node's lowest-row matching sibling wins:
    rows are scanned upwards and a parent's next row is set once."""
    batch, budget = draft_token_ids.shape
    path[:] = -1
    tokens[:] = -1
    next_row = np.empty(budget + 1, np.int64)
    for b in range(batch):
        next_row[:] = 0  # 0: no child carries the target's token (the root is nobody's child)
        for row in range(1, min(num_nodes[b], budget) + 1):
            parent = parent_row[b, row - 1]
            if 0 <= parent < row and next_row[parent] == 0 \
                    and draft_token_ids[b, row - 1] == row_target_token[b, parent]:
                next_row[parent] = row
        current, step = 0, 0
        path[b, 0], tokens[b, 0] = 0, row_target_token[b, 0]
        while next_row[current] != 0:  # rows only increase: at most budget steps
            current = next_row[current]
            step += 1
            path[b, step], tokens[b, step] = current, row_target_token[b, current]
        num_accepted[b] = step
