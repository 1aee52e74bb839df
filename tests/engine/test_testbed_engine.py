"""The tiny target in real vLLM: greedy output equals HF transformers greedy, token for token.

This is what makes the tiny models a valid oracle for the engine tests: any difference between
vLLM with GSD and HF greedy must then come from GSD, not from the model or tokenizer export.
Float32 (bf16 greedy depends on the batch, see shared/reference/cpu-environment.md).
"""

from __future__ import annotations

import gc
import os

import pytest

from vllm_gsd.testing import tiny_models
from vllm_gsd.testing.engines import greedy_params
from vllm_gsd.testing.prompts import tiny_prompts

pytestmark = pytest.mark.engine

MAX_NEW_TOKENS = 32
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def tiny_llm(tiny_target_path):
    """One vLLM engine on the tiny target for the module (float32, eager)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    import vllm

    llm = vllm.LLM(
        str(tiny_target_path),
        enforce_eager=True,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        seed=0,
    )
    yield llm
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def hf_target(tiny_target_path):
    """(model, tokenizer) of the tiny target in HF transformers, float32."""
    from transformers import AutoTokenizer

    return tiny_models.load_float32(tiny_target_path), AutoTokenizer.from_pretrained(
        tiny_target_path
    )


def _vllm_greedy(llm, prompts: list[str], max_tokens: int = MAX_NEW_TOKENS):
    return llm.generate(prompts, greedy_params(max_tokens), use_tqdm=False)


def _long_prompt(tokenizer, num_tokens: int) -> str:
    """A stdlib source excerpt of about `num_tokens` tokens (crosses several KV blocks)."""
    text = tiny_models.local_corpus(200_000)[3]
    ids = tokenizer(text, add_special_tokens=False).input_ids[:num_tokens]
    return tokenizer.decode(ids)


def test_vllm_tokenizes_like_hf(tiny_llm, hf_target):
    _, tokenizer = hf_target
    prompts = tiny_prompts()
    outputs = _vllm_greedy(tiny_llm, prompts, max_tokens=1)
    for prompt, output in zip(prompts, outputs):
        assert list(output.prompt_token_ids) == tokenizer(prompt).input_ids, prompt


def test_vllm_greedy_equals_hf_greedy_in_a_batch(tiny_llm, hf_target):
    model, tokenizer = hf_target
    prompts = tiny_prompts()
    outputs = _vllm_greedy(tiny_llm, prompts)
    for prompt, output in zip(prompts, outputs):
        expected = tiny_models.hf_greedy_generate(model, tokenizer, prompt, MAX_NEW_TOKENS)
        assert list(output.outputs[0].token_ids) == expected, prompt


def test_vllm_greedy_equals_hf_greedy_on_a_long_prompt(tiny_llm, hf_target):
    model, tokenizer = hf_target
    prompt = _long_prompt(tokenizer, 600)
    output = _vllm_greedy(tiny_llm, [prompt])[0]
    assert len(output.prompt_token_ids) > 500
    expected = tiny_models.hf_greedy_generate(model, tokenizer, prompt, MAX_NEW_TOKENS)
    assert list(output.outputs[0].token_ids) == expected


def test_tiny_output_is_not_degenerate(tiny_llm):
    """The trained target's greedy text varies with the prompt (a random model's often does not)."""
    texts = [o.outputs[0].text for o in _vllm_greedy(tiny_llm, tiny_prompts())]
    assert len(set(texts)) == len(texts)
    assert any("self" in text or "(" in text for text in texts)
