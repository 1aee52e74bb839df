"""Tree acceptance on a batch of flattened verification trees (tensors, no per-node loops).

Rows follow contracts.md: row 0 is the root, row i+1 is node i. A walk starts at the root; at
row r the target's token for that row decides: if a child of r (a node with parent_row == r)
carries it, the walk moves there, else that token is emitted as the target's own token and the
walk stops. Every function returns AcceptedPaths in vLLM's SamplerOutput layout.

Loops are over walk steps (at most the tree depth + 1) and, for recursive rejection, over the
candidate slots of one node (at most top_k); everything inside is batched over requests.
walk_tree runs the same rule compiled (numba) for CPU tensors: a walk is a few loads per row.
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


def _node_mask(draft_token_ids: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """bool [B, N]: node i is a real node (i + 1 <= num_nodes[b])."""
    budget = draft_token_ids.shape[1]
    node_rows = torch.arange(1, budget + 1, device=draft_token_ids.device)
    return node_rows.unsqueeze(0) <= num_nodes.to(draft_token_ids.device).unsqueeze(1)


def walk_tree(draft_token_ids: torch.Tensor, parent_row: torch.Tensor, num_nodes: torch.Tensor,
              row_target_token: torch.Tensor) -> AcceptedPaths:
    """Walk each tree along the target's per-row tokens.

    draft_token_ids, parent_row: int64 [B, N]; num_nodes: int64 [B];
    row_target_token: int64 [B, N + 1], the target's token at every row (argmax for greedy, a
    draw for sampling). From row r with target token t: move to the first (lowest-row) child of
    r whose token is t; if none, emit t and stop. Output token j is row_target_token at
    accepted row j, so the accepted nodes' tokens are followed by the target's bonus token.

    First every row's next row is found at once (its lowest-row child carrying the target's
    token at that row); the walk then takes one gather per accepted node. A node whose parent
    is not an earlier row (off contract) is never entered. CPU tensors take a compiled loop
    over the rows instead (each torch op costs microseconds); results are on the inputs' device.
    """
    tensors = (draft_token_ids, parent_row, num_nodes, row_target_token)
    if all(tensor.device.type == "cpu" for tensor in tensors):
        batch, budget = draft_token_ids.shape
        rows, tokens = np.empty((2, batch, budget + 1), dtype=np.int64)
        accepted = np.empty(batch, dtype=np.int64)
        _walk_tree_compiled(*(_int64_array(tensor) for tensor in tensors), rows, tokens, accepted)
        return AcceptedPaths(torch.from_numpy(rows), torch.from_numpy(tokens), torch.from_numpy(accepted))
    return _walk_tree_torch(*tensors)


def _int64_array(tensor: torch.Tensor) -> np.ndarray:
    """The (CPU) tensor as a contiguous int64 numpy array (one compiled specialization), without
    a copy when it already is one."""
    if tensor.dtype == torch.int64 and not tensor.requires_grad and tensor.is_contiguous():
        return tensor.numpy()
    return np.ascontiguousarray(tensor.detach().to(torch.int64).numpy())


def _walk_tree_torch(draft_token_ids, parent_row, num_nodes, row_target_token) -> AcceptedPaths:
    batch, budget = draft_token_ids.shape
    device = draft_token_ids.device
    stop = budget + 1  # a column past the last row, where a walk rests once it has stopped
    rows = torch.arange(1, budget + 1, device=device)
    is_node = (rows <= num_nodes.to(device).unsqueeze(1)) & (parent_row >= 0) & (parent_row < rows)
    parent = torch.where(is_node, parent_row, 0)
    match = is_node & (row_target_token.gather(1, parent) == draft_token_ids)
    next_row = torch.full((batch, budget + 2), stop, dtype=torch.long, device=device)
    next_row.scatter_reduce_(1, torch.where(match, parent, stop), torch.where(match, rows, stop), "amin")

    current = torch.zeros(batch, 1, dtype=torch.long, device=device)
    path = [current]
    for _ in range(budget):
        current = next_row.gather(1, current)
        if bool((current == stop).all()):
            break
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


def greedy_accept(draft_token_ids: torch.Tensor, parent_row: torch.Tensor, num_nodes: torch.Tensor,
                  target_logits: torch.Tensor) -> AcceptedPaths:
    """Greedy verification: walk_tree on the argmax of target_logits [B, N + 1, V].

    Ties go to the lowest token id (torch.argmax), as in target-only greedy decoding.
    """
    return walk_tree(draft_token_ids, parent_row, num_nodes, target_logits.argmax(-1))


def sample_rows(target_probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row: int64 [...] from probs [..., V] and uniforms [...] in [0, 1).

    Token = the smallest i with cdf[i] > u * cdf[-1] (probs need not be normalized), never a
    zero-probability token. Deterministic given the uniforms.
    """
    cdf = target_probs.cumsum(-1).contiguous()
    threshold = uniforms.to(cdf.dtype).unsqueeze(-1) * cdf[..., -1:]
    token = torch.searchsorted(cdf, threshold, right=True).squeeze(-1)
    vocab = target_probs.shape[-1]
    last_positive = vocab - 1 - (target_probs.flip(-1) > 0).to(torch.uint8).argmax(-1)
    return torch.minimum(token, last_positive)  # u * total may round up to total


def sample_accept(draft_token_ids: torch.Tensor, parent_row: torch.Tensor, num_nodes: torch.Tensor,
                  target_probs: torch.Tensor, uniforms: torch.Tensor) -> AcceptedPaths:
    """Lossless sampling verification for any choice of children.

    target_probs: [B, N + 1, V] (processed: temperature, top-p, ...), uniforms: [B, N + 1].
    Each row draws its token from the target; the walk follows the draws. Every emitted token
    is a real draw from the target given its accepted prefix, so the output distribution is
    exactly the target's.
    """
    return walk_tree(draft_token_ids, parent_row, num_nodes, sample_rows(target_probs, uniforms))


def _ordered_children(is_node: torch.Tensor, parent_row: torch.Tensor, current: torch.Tensor,
                      child_order: torch.Tensor | None, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [B, slots] of the first `slots` children of `current` (by child_order, then row).

    Returns (child_rows, valid); invalid slots hold row 0.
    """
    batch, budget = parent_row.shape
    rows = torch.arange(1, budget + 1, device=parent_row.device).expand(batch, budget)
    is_child = is_node & (parent_row == current.unsqueeze(1))
    order_key = rows if child_order is None else child_order * (budget + 1) + rows
    sort_key = torch.where(is_child, order_key, torch.iinfo(torch.long).max)
    sorted_key, index = sort_key.sort(dim=1)
    if slots > budget:
        pad = slots - budget
        sorted_key = torch.cat([sorted_key, sorted_key.new_full((batch, pad), torch.iinfo(torch.long).max)], 1)
        index = torch.cat([index, index.new_zeros(batch, pad)], 1)
    valid = sorted_key[:, :slots] != torch.iinfo(torch.long).max
    return torch.where(valid, index[:, :slots] + 1, 0), valid


def recursive_rejection_accept(draft_token_ids: torch.Tensor, parent_row: torch.Tensor,
                               num_nodes: torch.Tensor, target_probs: torch.Tensor,
                               draft_probs: torch.Tensor, uniforms: torch.Tensor,
                               child_order: torch.Tensor | None = None) -> AcceptedPaths:
    """Lossless multi-candidate verification when children were sampled from the draft.

    target_probs, draft_probs: [B, N + 1, V]: p and q at every row (normalized).
    uniforms: [B, N + 1, C + 1]: C accept tests per row, then one for the residual draw.
    child_order: optional int64 [B, N] key ordering siblings (e.g. VerificationTree.child_rank);
    default: ascending row.

    Precondition (what makes it lossless): the children of row r, in that order, are the first
    draws of a sampling *without replacement* from draft_probs[b, r] (any q works, e.g. the q of
    the graph node a merged copy came from; only the order of the draws matters).

    Recursive rejection sampling at row r with residual p' = p and q' = q: the j-th child x is
    accepted with probability min(1, p'(x) / q'(x)); on rejection p' <- norm(max(p' - q', 0))
    and q' <- q' without x, renormalized; after C rejections emit a draw from p'. Each try is
    a standard speculative-sampling step of target p' against x ~ q', whose rejection residual
    does not depend on x, so by induction the emitted token is distributed as p exactly.
    """
    batch, budget = draft_token_ids.shape
    device = draft_token_ids.device
    slots = uniforms.shape[-1] - 1
    is_node = _node_mask(draft_token_ids, num_nodes)
    batch_index = torch.arange(batch, device=device)
    dtype = torch.promote_types(target_probs.dtype, draft_probs.dtype)
    accepted_rows = torch.full((batch, budget + 1), -1, dtype=torch.long, device=device)
    output_token_ids = torch.full((batch, budget + 1), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    current = torch.zeros(batch, dtype=torch.long, device=device)
    active = torch.ones(batch, dtype=torch.bool, device=device)
    padded_tokens = torch.cat([draft_token_ids.new_zeros(batch, 1), draft_token_ids.clamp(min=0)], 1)
    for step in range(budget + 1):
        residual = target_probs[batch_index, current].to(dtype)  # p' [B, V]
        proposal = draft_probs[batch_index, current].to(dtype)  # q' [B, V]
        row_uniforms = uniforms[batch_index, current]  # [B, C + 1]
        child_rows, child_valid = _ordered_children(is_node, parent_row, current, child_order, slots)
        accepted_child = torch.zeros(batch, dtype=torch.long, device=device)
        decided = torch.zeros(batch, dtype=torch.bool, device=device)
        for slot in range(slots):
            trying = child_valid[:, slot] & ~decided & active
            if not bool(trying.any()):
                break
            token = padded_tokens[batch_index, child_rows[:, slot]]
            p_token = residual[batch_index, token]
            q_token = proposal[batch_index, token]
            accept = trying & (row_uniforms[:, slot].to(dtype) * q_token < p_token)
            accepted_child = torch.where(accept, child_rows[:, slot], accepted_child)
            decided |= accept
            reject = (trying & ~accept).unsqueeze(1)
            next_residual = (residual - proposal).clamp(min=0)
            mass = next_residual.sum(-1, keepdim=True)
            # mass == 0 means p' == q', where rejection has probability 0; keep p' then.
            next_residual = torch.where(mass > 0, next_residual / mass.clamp(min=torch.finfo(dtype).tiny), residual)
            next_proposal = proposal.clone()
            next_proposal[batch_index, token] = 0
            next_proposal = next_proposal / next_proposal.sum(-1, keepdim=True).clamp(min=torch.finfo(dtype).tiny)
            residual = torch.where(reject, next_residual, residual)
            proposal = torch.where(reject, next_proposal, proposal)
        bonus = sample_rows(residual, row_uniforms[:, slots])
        emitted = torch.where(decided, padded_tokens[batch_index, accepted_child], bonus)
        accepted_rows[:, step] = torch.where(active, current, -1)
        output_token_ids[:, step] = torch.where(active, emitted, -1)
        moved = active & decided
        if not bool(moved.any()):
            break
        current = torch.where(moved, accepted_child, current)
        num_accepted += moved.long()
        active = moved
    return AcceptedPaths(accepted_rows, output_token_ids, num_accepted)
