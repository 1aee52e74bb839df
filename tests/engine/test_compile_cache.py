"""vLLM's compile cache on the CPU build: a later start loads the compiled models a first one
saved (target and draft), and serves the same tokens; a draft_model engine with the same draft
loads gsd's compiled target.

vLLM 0.32 alone fails that load on CPU and compiles again at every start (vllm_v0_32/config_patches.py,
`_add_noop_finalize_loading`), and keys gsd's target apart from the chain's by a flag that
follows async scheduling (`_keep_the_targets_compile_key`). VLLM_FORCE_AOT_LOAD=1 makes a failed
or missing load an error, so a later engine starts only if both saved models load.
"""

from __future__ import annotations

import gc

import pytest

from vllm_gsd.testing.engines import greedy_token_ids, gsd_config, make_llm, token_prompts

pytestmark = pytest.mark.engine

PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "x"]


def _greedy_ids(llm, tokenizer) -> list[list[int]]:
    return greedy_token_ids(llm, token_prompts(tokenizer, PROMPTS), 24)


def _start_generate_stop(target: str, speculative_config: dict, tokenizer) -> list[list[int]]:
    llm = make_llm(target, speculative_config)
    try:
        assert not llm.llm_engine.vllm_config.model_config.enforce_eager  # the compiled mode
        return _greedy_ids(llm, tokenizer)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def test_later_starts_load_the_saved_compiled_models(engines, tiny_models, tokenizer, tmp_path, monkeypatch):
    reference = _greedy_ids(engines.get("target"), tokenizer)
    gsd = gsd_config(tiny_models["perturbed"])
    chain = {"method": "draft_model", "model": tiny_models["perturbed"], "num_speculative_tokens": 4}
    # The engine's processes copy the environment when they start.
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))

    def saved_models():
        return sorted(tmp_path.glob("vllm-cache/torch_compile_cache/torch_aot_compile/*/rank_0_0/model"))

    compiled = _start_generate_stop(tiny_models["target"], gsd, tokenizer)
    assert len(saved_models()) == 2  # the target's and the draft's

    chain_loaded = _start_generate_stop(tiny_models["target"], chain, tokenizer)
    # The chain loads gsd's target (one key for both); only its draft may be keyed apart (on
    # this pair vLLM keys the chain's draft by more than the model). Without the shared key: 4.
    assert len(saved_models()) <= 3
    monkeypatch.setenv("VLLM_FORCE_AOT_LOAD", "1")  # a load that fails now fails the start
    loaded = _start_generate_stop(tiny_models["target"], gsd, tokenizer)
    assert compiled == reference
    assert chain_loaded == reference
    assert loaded == reference
