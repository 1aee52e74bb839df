"""Which requests may be verified as a tree, and why not.

The tree path processes the target's logits with temperature, top-k and top-p only (as vLLM's own
rejection sampler does for drafts), and it reads draft rows as a tree, not as the linear suffix
that vLLM's penalties, bad-words and grammar machinery assume. A request that needs anything else
is served exactly, without speculation: `tree_refusal_reason` says why, once per request in the log.
"""

from __future__ import annotations

from typing import Any


def tree_refusal_reason(sampling_params: Any, num_output_tokens: int) -> str | None:
    """None if the request can be verified as a tree; otherwise the reason it cannot."""
    if sampling_params is None:
        return "not a generation request"
    p = sampling_params
    checks = (
        (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0,
         "penalties"),
        (bool(p.bad_words) or bool(p._bad_words_token_ids), "bad_words"),
        (p.structured_outputs is not None, "structured output"),
        (bool(p.logit_bias), "logit_bias"),
        (bool(p.allowed_token_ids), "allowed_token_ids"),
        (p.min_p > 0.0, "min_p"),
        (p.min_tokens > num_output_tokens, "min_tokens not yet reached"),
        (p.thinking_token_budget is not None, "thinking_token_budget"),
        (p.repetition_detection is not None, "repetition_detection"),
    )
    reasons = [name for active, name in checks if active]
    return ", ".join(reasons) if reasons else None
