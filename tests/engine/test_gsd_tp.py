"""Tensor parallelism: gsd at tp=2 (vLLM's multiprocessing executor) equals tp=1 and the target."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine

TEXTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Queue:\n    def push(self, x):\n",
         "for i in range(10):\n"]


def test_tp2_greedy_equals_tp1_and_target(engines, tokenizer):
    from vllm import SamplingParams

    from vllm_gsd.engine.metrics import gsd_stats

    prompts = [{"prompt_token_ids": tokenizer(t, add_special_tokens=False)["input_ids"]} for t in TEXTS]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def run(name):
        return [list(o.outputs[0].token_ids) for o in engines.get(name).generate(prompts, params, use_tqdm=False)]

    tp2 = run("gsd_tp2")
    assert tp2 == run("gsd") == run("target")
    # Both ranks drafted and verified trees (their agreement is checked every step).
    assert gsd_stats(engines.get("gsd_tp2")).trees_verified > 0
