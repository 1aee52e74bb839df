"""GSD under KV-cache pressure: requests preempted mid-tree are recomputed, and stay exact."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine


def test_preemption_mid_tree_keeps_greedy_exact(tiny_models, tokenizer):
    from vllm import SamplingParams

    from vllm_gsd.testing.engines import gsd_config, make_llm
    from vllm_gsd.testing.prompts import tiny_prompts

    prompts = [{"prompt_token_ids": tokenizer(t, add_special_tokens=False)["input_ids"]}
               for t in tiny_prompts()] * 3
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    # 20 blocks of 32 slots for 24 requests of ~140 tokens plus trees: the scheduler must preempt.
    small = dict(num_gpu_blocks_override=20, block_size=32, max_model_len=256)
    gsd = make_llm(tiny_models["target"], gsd_config(tiny_models["perturbed"]), **small)
    try:
        got = [list(o.outputs[0].token_ids) for o in gsd.generate(prompts, params, use_tqdm=False)]
        preemptions = {m.name: getattr(m, "value", None) for m in gsd.get_metrics()}
    finally:
        gsd.llm_engine.engine_core.shutdown()
    assert preemptions["vllm:num_preemptions"] > 0
    reference = make_llm(tiny_models["target"], max_model_len=256)
    try:
        want = [list(o.outputs[0].token_ids) for o in reference.generate(prompts, params, use_tqdm=False)]
    finally:
        reference.llm_engine.engine_core.shutdown()
    assert got == want
