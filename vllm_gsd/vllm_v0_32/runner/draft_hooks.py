"""A gsd runner's drafts: the wrappers that vllm_v0_32/patches.py installs.

* `propose_draft_token_ids`: GsdProposer.propose_tree on the sampled tokens (after bookkeeping);
  an error in it on one rank of a multi-worker engine stops the engine (runner/rank_failure.py);
* `take_draft_token_ids`: the drafts as vLLM hands them to the scheduler, with the tree of every
  structured-output request (vllm_v0_32/scheduler_hooks.py).
"""

from __future__ import annotations

import functools

from vllm_gsd.vllm_v0_32.runner.rank_failure import stop_on_rank_failure
from vllm_gsd.vllm_v0_32.runner.state import is_gsd_runner


def wrap_propose_draft_token_ids(original):
    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        if not is_gsd_runner(self):
            return original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        try:
            return self.drafter.propose_tree(self, scheduler_output, sampled_token_ids)
        except Exception as error:
            stop_on_rank_failure(self, "drafter", error)

    return propose_draft_token_ids


def wrap_take_draft_token_ids(original):
    """The drafts as vLLM hands them to the scheduler, with the tree of every request that has a
    grammar: the scheduler checks a tree's nodes and fills its bitmask path by path
    (vllm_v0_32/scheduler_hooks.py)."""

    @functools.wraps(original)
    def take_draft_token_ids(self):
        drafts = original(self)
        if drafts is None or not is_gsd_runner(self):
            return drafts
        from vllm_gsd.vllm_v0_32.scheduler_hooks import TreeDraftTokenIds

        parents = [_grammar_tree_parents(self, req_id, tokens)
                   for req_id, tokens in zip(drafts.req_ids, drafts.draft_token_ids)]
        if all(p is None for p in parents):
            return drafts
        return TreeDraftTokenIds(drafts.req_ids, drafts.draft_token_ids, parents)

    return take_draft_token_ids


def _grammar_tree_parents(runner, req_id: str, tokens: list[int]) -> list[int] | None:
    """The parent rows of a structured-output request's proposed tree (None: no grammar, no tree)."""
    state = runner.requests.get(req_id)
    tree = runner.drafter.trees.get(req_id)
    if (not tokens or tree is None or state is None or state.sampling_params is None
            or state.sampling_params.structured_outputs is None
            or tree.draft_token_ids[:len(tokens)].tolist() != list(tokens)):
        return None
    return tree.parent_row[:len(tokens)].tolist()
