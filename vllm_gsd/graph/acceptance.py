"""Tree acceptance on a batch of flattened verification trees (plain torch, no per-node loops).

Rows follow contracts.md: row 0 is the root, row i+1 is node i. A walk starts at the root; at
row r the target's token for that row decides: if a child of r (a node with parent_row == r)
carries it, the walk moves there, else that token is emitted as the target's own token and the
walk stops. Every function returns AcceptedPaths in vLLM's SamplerOutput layout.

Loops are over walk steps (at most the tree depth + 1) and, for recursive rejection, over the
candidate slots of one node (at most top_k); everything inside is batched over requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    """
    batch, budget = draft_token_ids.shape
    device = draft_token_ids.device
    is_node = _node_mask(draft_token_ids, num_nodes)
    batch_index = torch.arange(batch, device=device)
    accepted_rows = torch.full((batch, budget + 1), -1, dtype=torch.long, device=device)
    output_token_ids = torch.full((batch, budget + 1), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    current = torch.zeros(batch, dtype=torch.long, device=device)
    active = torch.ones(batch, dtype=torch.bool, device=device)
    for step in range(budget + 1):
        target = row_target_token[batch_index, current]
        accepted_rows[:, step] = torch.where(active, current, -1)
        output_token_ids[:, step] = torch.where(active, target, -1)
        match = is_node & (parent_row == current.unsqueeze(1)) & (draft_token_ids == target.unsqueeze(1))
        moved = active & match.any(1)
        if not bool(moved.any()):
            break
        child_row = match.to(torch.uint8).argmax(1) + 1  # first matching child
        current = torch.where(moved, child_row, current)
        num_accepted += moved.long()
        active = moved
    return AcceptedPaths(accepted_rows, output_token_ids, num_accepted)


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
