"""Grammars over trees in vLLM's scheduler: the wrappers that vllm_v0_32/patches.py installs.

vLLM's scheduler checks a request's drafts against its grammar as a chain, and fills one
grammar-bitmask row per draft as the chain's states. For a gsd engine:

* the runner hands the scheduler each structured-output request's tree with its draft tokens
  (`TreeDraftTokenIds`: the parents of its nodes, runner/draft_hooks.wrap_take_draft_token_ids);
* `update_draft_token_ids`: a request with a grammar keeps its tree's nodes through the last
  one the grammar allows after its own path (engine/tree_grammar.py); while the grammar does
  not yet constrain the request (a reasoning section in progress) it drafts nothing; the tree's
  parents and which nodes the grammar allows are kept for the bitmask;
* `grammar_bitmask`: a request with a kept tree gets one row per tree row, each the grammar's
  state after that row's path (a refused node's row open: it is never reached); every other
  request gets vLLM's own rows.

The runner applies the rows to the logits as for a chain (root first, then the nodes in the
order verified), so the target never emits a token the grammar refuses, and a node whose token
it refuses after its path is never accepted, nor any node below it.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import numpy as np
from vllm.v1.outputs import DraftTokenIds

from vllm_gsd.engine.config import is_gsd
from vllm_gsd.engine.tree_grammar import allowed_nodes, fill_tree_bitmask, kept_node_count


@dataclass
class TreeDraftTokenIds(DraftTokenIds):
    """vLLM's DraftTokenIds with, per request, its tree's parent rows (None: no grammar to
    check it against, or no tree)."""

    parents: list[list[int] | None] = field(default_factory=list)


# The tree each structured-output request's drafts form, kept from the step that drafted them to
# the one that schedules them: request -> (draft tokens, parents). Weak keys: a finished request
# takes its entry with it.
_kept_trees: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wrap_update_draft_token_ids(original):
    @functools.wraps(original)
    def update_draft_token_ids(self, draft_token_ids):
        if not is_gsd(self.vllm_config.speculative_config):
            return original(self, draft_token_ids)
        parents_of = getattr(draft_token_ids, "parents", None) or [None] * len(draft_token_ids.req_ids)
        for req_id, spec_token_ids, parents in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids,
                                                   parents_of):
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.is_prefill_chunk:
                request.spec_token_ids = []
                continue
            if parents is None or not request.use_structured_output:
                request.spec_token_ids = self.structured_output_manager.validate_tokens(request, spec_token_ids)
                continue
            request.spec_token_ids = _grammar_tree(self.structured_output_manager, request, spec_token_ids, parents)

    return update_draft_token_ids


def _grammar_tree(manager, request, tokens: list[int], parents: list[int]) -> list[int]:
    from vllm.v1.structured_output import ConstraintBounds

    if manager._get_constraint_bounds(request, ()) != ConstraintBounds(0, 0):
        _kept_trees.pop(request, None)
        return []  # a reasoning section in progress: the grammar applies from a later token
    allowed = allowed_nodes(request.structured_output_request.grammar, tokens, parents)
    keep = kept_node_count(allowed)
    _kept_trees[request] = (tuple(tokens[:keep]), tuple(parents[:keep]), tuple(allowed[:keep]))
    return tokens[:keep]


def wrap_grammar_bitmask(original):
    @functools.wraps(original)
    def grammar_bitmask(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens):
        if not is_gsd(self.vllm_config.speculative_config) or not structured_output_request_ids:
            return original(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens)
        if self._grammar_bitmask is None:  # as vLLM allocates it: a row per draft and one more
            self._grammar_bitmask = self.backend.allocate_token_bitmask(
                self.vllm_config.scheduler_config.max_num_seqs * (1 + self.vllm_config.num_speculative_tokens))
        blocks = []
        for req_id in structured_output_request_ids:
            request = requests[req_id]
            tree = _scheduled_tree(request, scheduled_spec_decode_tokens.get(req_id, ()))
            if tree is None:  # vLLM's rows for this request alone (it fills from row 0)
                rows = original(self, requests, [req_id], scheduled_spec_decode_tokens)
            else:
                tokens, parents, allowed = tree
                grammar = request.structured_output_request.grammar
                end = fill_tree_bitmask(
                    grammar, req_id, tokens, parents, allowed,
                    lambda index, constrained: self._fill_bitmasks(((grammar, index, constrained),)), 0)
                rows = self._grammar_bitmask[:end].numpy()
            blocks.append(rows.copy())  # the next request's rows overwrite the shared buffer
        return np.concatenate(blocks)

    return grammar_bitmask


def _scheduled_tree(request, scheduled: list[int]):
    """The kept tree of a request (tokens, parents, allowed), cut to the nodes scheduled this
    step (a prefix of them), or None if its scheduled drafts are not that tree's (or it has none)."""
    kept = _kept_trees.get(request)
    if kept is None or not scheduled or -1 in scheduled:
        return None
    tokens, parents, allowed = kept
    if tuple(scheduled) != tokens[:len(scheduled)]:
        return None
    n = len(scheduled)
    return list(scheduled), list(parents[:n]), list(allowed[:n])
