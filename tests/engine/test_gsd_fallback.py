"""Request options the tree path cannot honour are served exactly, without speculation."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.engine

TEXTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "for i in range(10):\n"]


def _prompts(tokenizer):
    return [{"prompt_token_ids": tokenizer(t, add_special_tokens=False)["input_ids"]} for t in TEXTS]


def _run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("option", [
    {"repetition_penalty": 1.3},
    {"presence_penalty": 0.8, "frequency_penalty": 0.4},
    {"min_tokens": 12},
    {"logit_bias": {5: 3.0, 17: -2.0}},
    {"min_p": 0.3, "temperature": 0.0},
    {"bad_words": ["def"]},
])
def test_unsupported_option_is_served_exactly(engines, tokenizer, option):
    from vllm import SamplingParams

    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 24, **option})
    prompts = _prompts(tokenizer)
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # The option's requests run beside tree requests in one batch.
    got = _run(engines.get("gsd"), prompts + prompts, [params] * 3 + [plain] * 3)
    want = _run(engines.get("target"), prompts + prompts, [params] * 3 + [plain] * 3)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_logprobs_along_accepted_paths(engines, tokenizer):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)
    got = _run(engines.get("gsd"), _prompts(tokenizer), params)
    want = _run(engines.get("target"), _prompts(tokenizer), params)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lp_g, lp_w in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert set(lp_g) == set(lp_w)
            for token, entry in lp_w.items():
                assert math.isclose(lp_g[token].logprob, entry.logprob, abs_tol=1e-4)


def test_n_greater_than_one(engines, tokenizer):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True, n=3)
    first = _run(engines.get("gsd"), _prompts(tokenizer)[:1], params)[0]
    again = _run(engines.get("gsd"), _prompts(tokenizer)[:1], params)[0]
    assert len(first.outputs) == 3 and all(len(c.token_ids) == 16 for c in first.outputs)
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1


def test_structured_output_is_served_exactly(engines, tokenizer):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0.0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["import os", "def f"]))
    prompts = _prompts(tokenizer)
    got = _run(engines.get("gsd"), prompts, params)
    want = _run(engines.get("target"), prompts, params)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert all(o.outputs[0].text in ("import os", "def f") for o in got)
