"""Which requests may be verified as a tree, and why not.

The tree path processes every target row as vLLM's sampler processes a request's next token,
with the history of the row's own path (engine/node_processing.py): temperature, top-k, top-p,
min_p, penalties, bad words, allowed token ids, logit bias and min_tokens; a grammar's bitmask
row by row along each node's path (vllm_v0_32/scheduler_hooks.py); the thinking budget with
vLLM's state machine run along each node's path (vllm_v0_32/thinking_budget.py). Repetition
detection and stop conditions are the scheduler's, checked on the accepted tokens one at a time
as for any request.

What a tree cannot honour is served exactly, without speculation, and `tree_refusal_reason`
says why, once per request in the log: today only requests that generate nothing.
"""

from __future__ import annotations

from typing import Any


def tree_refusal_reason(sampling_params: Any, num_output_tokens: int) -> str | None:
    """None if the request can be verified as a tree; otherwise the reason it cannot."""
    if sampling_params is None:
        return "not a generation request"
    return None
