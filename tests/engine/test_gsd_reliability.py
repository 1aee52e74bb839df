"""GSD under KV-cache pressure: requests preempted mid-tree are recomputed, and stay exact."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine


def test_preemption_mid_tree_keeps_greedy_exact_and_seeded_text(engines, tiny_models, tokenizer):
    """24 requests (greedy and seeded sampling, mixed) in a KV cache too small for them: the
    scheduler preempts requests mid-tree and recomputes them. Greedy tokens are the target's own;
    seeded text is what the same request samples with room to spare."""
    from vllm import SamplingParams

    from vllm_gsd.testing.engines import greedy_params, gsd_config, make_llm, token_prompts
    from vllm_gsd.testing.prompts import tiny_prompts

    prompts = token_prompts(tokenizer, tiny_prompts()) * 3
    greedy = greedy_params(120)
    params = [greedy if i % 3 else SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=120,
                                                  ignore_eos=True)
              for i in range(len(prompts))]
    # 20 blocks of 32 slots for 24 requests of ~140 tokens plus trees: the scheduler must preempt.
    small = dict(num_gpu_blocks_override=20, block_size=32, max_model_len=256)
    gsd = make_llm(tiny_models["target"], gsd_config(tiny_models["perturbed"]), **small)
    try:
        got = [list(o.outputs[0].token_ids) for o in gsd.generate(prompts, params, use_tqdm=False)]
        preemptions = {m.name: getattr(m, "value", None) for m in gsd.get_metrics()}
    finally:
        gsd.llm_engine.engine_core.shutdown()
    print(f"preemptions: {preemptions['vllm:num_preemptions']}")
    assert preemptions["vllm:num_preemptions"] > 0
    want = [list(o.outputs[0].token_ids) for o in engines.get("target").generate(
        prompts, [greedy] * len(prompts), use_tqdm=False)]
    roomy = [list(o.outputs[0].token_ids) for o in engines.get("gsd").generate(
        prompts, params, use_tqdm=False)]
    for i, p in enumerate(params):
        assert got[i] == (want[i] if p.temperature == 0.0 else roomy[i]), f"request {i}"
