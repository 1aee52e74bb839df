"""Tiny-model vLLM engines for tests and benchmarks: configurations, the requests the engine
tests send (prompts as token ids, greedy sampling parameters, the token ids that come back) and
counter readers.

Exactness is tested in float32: in bf16 vLLM's own greedy output depends on the batch it runs
in (shared/reference/cpu-environment.md).
"""

from __future__ import annotations


MAX_MODEL_LEN = 512  # tests/engine/test_*.py assume this
NODE_BUDGET = 24
# Cost curves under which verifying more nodes costs nothing and drafting almost nothing: the
# adaptive node budget then always drafts every level and verifies the whole tree, so the tests
# see full trees deterministically (measured curves depend on the machine's load) while the
# adaptive code path runs. tests/engine/test_gsd_adaptive.py tests the policy's choices.
FREE_TREES = {"target": [[1, 1.0]], "draft": [[1, 1e-4]]}
GSD_KNOBS = {"top_k": 3, "max_depth": 4, "merge_ngram": 1, "min_child_ratio": 0.05, "leaf_prob": 0.0,
             "cost_curve": FREE_TREES}
# A target whose forward costs the same up to 8 query tokens, then grows linearly (as on a CPU),
# and a draft at a tenth of it: speculation pays for a few requests, not for many, so at batch 4
# and more the adaptive budget cuts some requests' trees to no node at all.
CPU_LIKE_COSTS = {"target": [[1, 1.0], [8, 1.0], [16, 2.0]], "draft": [[1, 0.1]]}
# The tiny target's reasoning markers, for the thinking-budget tests (vLLM's ReasoningConfig).
TEST_REASONING = {"reasoning_start_str": " think", "reasoning_end_str": " done"}
# Compact JSON under a grammar (vLLM's xgrammar backend reads it per engine): the tiny target
# would otherwise write whitespace between JSON fields up to max_tokens.
TEST_STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}
# The widest tree vLLM's plumbing allows, at the chain's depth: for the acceptance comparison.
WIDE_GSD = {"num_speculative_tokens": 128,
            "gsd": {"top_k": 4, "max_depth": 4, "merge_ngram": 1, "min_child_ratio": 0.0, "leaf_prob": 0.0,
                    "cost_curve": FREE_TREES}}


# The tiny pair's draft_vocab where a test engine reduces its draft's head (engine/draft_head.py):
# the first 384 of 1024 ids hold about 3/4 of the tiny prompts' tokens, so the step's extra ids
# (the context's own) matter, as they do for rarer tokens on a real pair.
REDUCED_DRAFT_VOCAB = 384

# A test engine's KV cache: room for every test's requests (64 x 512 tokens of the tiny pair
# take 130 MiB), small enough that the engines a test session keeps fit in memory beside its
# servers (a worker holds its KV cache plus about 1 GiB).
TEST_KV_CACHE_BYTES = 256 << 20


def make_llm(model: str, speculative_config: dict | None = None, **kwargs):
    """vLLM's LLM in its default mode, float32, with the tests' sizes."""
    import os

    from vllm import LLM

    args = dict(model=model, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
                seed=0, disable_log_stats=False, max_num_seqs=64, gpu_memory_utilization=0.5)
    if speculative_config is not None:
        args["per_request_spec_decode_metrics"] = "summary"
    args.update(kwargs)
    # vLLM's CPU platform lets VLLM_CPU_KVCACHE_SPACE (whole GiB) override kv_cache_memory_bytes:
    # lifted while the engine's processes start (they copy the environment then).
    lifted = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    try:
        return LLM(**args, speculative_config=speculative_config)
    finally:
        if lifted is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = lifted


def token_prompts(tokenizer, texts) -> list[dict]:
    """Each text as a prompt of token ids (no special tokens), as the engine tests send them."""
    return [{"prompt_token_ids": tokenizer(t, add_special_tokens=False)["input_ids"]} for t in texts]


def greedy_params(max_tokens: int, **kw):
    """SamplingParams of a greedy request that runs `max_tokens` tokens (ignore_eos; `kw` are
    further SamplingParams fields, ignore_eos=False included)."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **{"ignore_eos": True, **kw})


def token_ids(llm, prompts, params) -> list[list[int]]:
    """The output token ids of each prompt (its first completion) of one `llm.generate` call;
    `params` is one SamplingParams or one per prompt."""
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def greedy_token_ids(llm, prompts, max_tokens: int) -> list[list[int]]:
    """token_ids of a greedy generate call: greedy_params(max_tokens) for every prompt."""
    return token_ids(llm, prompts, greedy_params(max_tokens))


def gsd_config(draft: str, node_budget: int = NODE_BUDGET, **knobs) -> dict:
    """A gsd speculative_config: the tests' GSD_KNOBS with `knobs` over them; a knob given as
    None is left out, so GSD's default applies (cost_curve=None: curves measured at start-up)."""
    merged = {**GSD_KNOBS, **knobs}
    return {"method": "gsd", "model": draft, "num_speculative_tokens": node_budget,
            "gsd": {key: value for key, value in merged.items() if value is not None}}


def default_gsd_config(draft: str, node_budget: int = NODE_BUDGET) -> dict:
    """A gsd speculative_config with GSD's default knobs and CPU-like cost curves: what a user
    runs (the adaptive budget cuts trees under load), with curves that do not depend on how
    busy the test machine is."""
    return gsd_config(draft, node_budget, **{**dict.fromkeys(GSD_KNOBS), "cost_curve": CPU_LIKE_COSTS})


def acceptance_of(outputs) -> tuple[int, int]:
    """(verify steps, accepted draft tokens) summed over vLLM's per-request spec-decode metrics
    (engines made with per_request_spec_decode_metrics="summary"). Unlike the process-wide
    counters of `get_metrics()`, these belong to the engine that produced the outputs."""
    steps = accepted = 0
    for out in outputs:
        for completion in out.outputs:
            metrics = completion.spec_decode_metrics
            if metrics is not None:
                steps += sum(metrics.histogram)
                accepted += sum(j * count for j, count in enumerate(metrics.histogram))
    return steps, accepted


def mean_acceptance_length_of(outputs) -> float:
    """vLLM's mean acceptance length (accepted drafts + the target's token per step)."""
    steps, accepted = acceptance_of(outputs)
    return 1.0 + accepted / max(steps, 1)


def spec_metrics(llm) -> dict[str, object]:
    """vLLM's speculative-decoding counters from `get_metrics()`. Only the engine created last
    in a process records into them (vLLM re-registers its loggers per engine)."""
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            out[metric.name] = getattr(metric, "values", getattr(metric, "value", None))
    return out


def mean_acceptance_length(llm, before: dict | None = None) -> float:
    now = spec_metrics(llm)
    before = before or {}
    drafts = now["vllm:spec_decode_num_drafts"] - before.get("vllm:spec_decode_num_drafts", 0)
    accepted = (now["vllm:spec_decode_num_accepted_tokens"]
                - before.get("vllm:spec_decode_num_accepted_tokens", 0))
    return 1.0 + accepted / max(drafts, 1)
