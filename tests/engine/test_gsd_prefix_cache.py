"""Prefix caching (on by default in vLLM): a shared prefix is as good for the draft as for the
target, whoever cached it; and a draft with a shorter context than the target's is never run
past it."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_gsd.testing.engines import acceptance_of, greedy_params, mean_acceptance_length_of

pytestmark = pytest.mark.engine

PREFIX_TOKENS = 420
CODE = ("def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()\n\n"
        "class Config:\n    def __init__(self, path):\n        self.values = {}\n        with open(path) as f:\n"
        "            for line in f:\n                key, value = parse(line)\n                self.values[key] = value\n")


def shared_prefix(tokenizer, seed: int) -> list[int]:
    """PREFIX_TOKENS tokens: a few random ones first (no other test caches these blocks), then code."""
    header = np.random.default_rng(seed).integers(2, tokenizer.vocab_size, 12).tolist()
    body = tokenizer(CODE * 40, add_special_tokens=False)["input_ids"]
    return (header + body)[:PREFIX_TOKENS]


def test_a_prefix_cached_without_draft_kv_keeps_the_drafts_acceptance(engines, tokenizer):
    """The prefix's blocks are cached by a request whose steps never ran the draft (a grammar:
    served without speculation); then 8 greedy requests share it. Measured before the fix on this
    pair: mean acceptance length 0.72x of the same requests with caching off (the draft trusted
    KV it never wrote)."""
    from vllm.sampling_params import StructuredOutputsParams

    prefix = shared_prefix(tokenizer, seed=7)
    sharers = [{"prompt_token_ids": prefix + tokenizer(f"\n# part {i}\n", add_special_tokens=False)["input_ids"]}
               for i in range(8)]
    results = {}
    for name in ("gsd", "gsd_no_prefix_cache"):
        llm = engines.get(name)
        # A grammar request of its own per engine: vLLM records the backend it chose on the params.
        grammar = StructuredOutputsParams(choice=["import os", "def f"])
        llm.generate([{"prompt_token_ids": prefix}], greedy_params(40, structured_outputs=grammar), use_tqdm=False)
        outputs = llm.generate(sharers, greedy_params(40), use_tqdm=False)
        results[name] = outputs
    want = engines.get("target").generate(sharers, greedy_params(40), use_tqdm=False)
    for name, outputs in results.items():
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in want], name
    cached = results["gsd"]
    block_size = engines.get("gsd").llm_engine.vllm_config.cache_config.block_size
    assert all(o.num_cached_tokens >= PREFIX_TOKENS // block_size * block_size for o in cached)  # a hit
    on, off = (mean_acceptance_length_of(results[n]) for n in ("gsd", "gsd_no_prefix_cache"))
    print(f"mean acceptance length with prefix caching {on:.2f}, without {off:.2f}")
    assert acceptance_of(cached)[0] > 0
    assert on >= 0.9 * off


def test_a_draft_with_a_shorter_context_is_not_run_past_it(engines, tokenizer):
    """The "short" draft holds 256 positions, the target 512. Prompts below and past the draft's
    context: every output is the target's; requests past the draft's context got no tree (vLLM's
    per-request spec-decode metrics count each request's verify steps), one within it did. With a
    draft of the target's context the requests of 300 and 470 tokens got 9 and 8 verify steps."""
    from vllm_gsd.engine.metrics import gsd_stats
    from vllm_gsd.testing.tiny_models import SHORT_DRAFT_CONTEXT

    body = tokenizer(CODE * 40, add_special_tokens=False)["input_ids"]
    prompts = [{"prompt_token_ids": body[:length]} for length in (40, SHORT_DRAFT_CONTEXT - 30, 300, 470)]
    llm = engines.get("gsd_short_draft")
    got = llm.generate(prompts, greedy_params(36), use_tqdm=False)
    want = engines.get("target").generate(prompts, greedy_params(36), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert gsd_stats(llm).trees_verified > 0
    verify_steps = [acceptance_of([o])[0] for o in got]
    print(f"verify steps per request (prompts of 40, {SHORT_DRAFT_CONTEXT - 30}, 300, 470 tokens): {verify_steps}")
    assert verify_steps[0] > 0, verify_steps  # the second crosses 256 while it decodes: trees until then
    assert verify_steps[2:] == [0, 0], verify_steps
    assert llm.llm_engine.vllm_config.speculative_config.draft_model_config.max_model_len == SHORT_DRAFT_CONTEXT
