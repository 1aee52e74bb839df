"""What the trees verified this step teach: the acceptance model's calibration (the draft's path
probabilities against the nodes the target accepted) and the context lookup's odds (lookup nodes
tried and accepted). Lookup nodes carry no path probability: the acceptance model calibrates the
draft alone.
"""

from __future__ import annotations

import numpy as np

from vllm_gsd.engine.lookup import LookupAccuracy, lookup_outcome, node_path
from vllm_gsd.engine.metrics import GsdStats
from vllm_gsd.policy import AcceptanceModel


def observe_verified(trees: dict, req_ids: list[str], scheduler_output, valid_sampled_token_ids: list[list[int]],
                     acceptance: AcceptanceModel | None, lookup_accuracy: LookupAccuracy, stats: GsdStats) -> None:
    """trees: the trees proposed last step by request id (engine/proposer.ProposedTree);
    req_ids, valid_sampled_token_ids: the batch's requests and what each emitted this step;
    acceptance: None without the adaptive budget."""
    if not trees:
        return
    predicted, accepted = [], []
    hits = tries = 0
    for i, req_id in enumerate(req_ids):
        tree = trees.get(req_id)
        verified = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
        if tree is None or verified == 0 or not valid_sampled_token_ids[i]:
            continue
        if verified > tree.lookup_from:
            leaf = int(tree.parent_row[tree.lookup_from]) - 1
            h, t = lookup_outcome(valid_sampled_token_ids[i],
                                  node_path(tree.parent_row.numpy(), tree.draft_token_ids.numpy(), leaf),
                                  tree.draft_token_ids[tree.lookup_from:verified].numpy())
            hits, tries = hits + h, tries + t
        if acceptance is None:
            continue
        max_depth = acceptance.max_depth
        predicted.append(np.bincount(tree.depth[:verified].numpy(), tree.path_prob[:verified].numpy(),
                                     minlength=max_depth + 1)[: max_depth + 1])
        accepted.append(len(valid_sampled_token_ids[i]) - 1)
    if accepted:
        acceptance.observe(np.stack(predicted), np.asarray(accepted))
    lookup_accuracy.observe(hits, tries)
    stats.lookup_nodes_tried += tries
    stats.lookup_nodes_accepted += hits
