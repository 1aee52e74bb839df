"""vLLM's compile cache on the CPU build: a second start of a configuration loads the compiled
models the first one saved (target and draft), and serves the same tokens.

vLLM 0.32 alone fails that load on CPU and compiles again at every start (engine/patches.py,
`_add_noop_finalize_loading`). VLLM_FORCE_AOT_LOAD=1 makes a failed or missing load an error, so
the second engine starts only if both saved models load.
"""

from __future__ import annotations

import gc

import pytest

from vllm_gsd.testing.engines import gsd_config, make_llm

pytestmark = pytest.mark.engine

PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "x"]


def _greedy_ids(llm, tokenizer) -> list[list[int]]:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": tokenizer(t, add_special_tokens=False)["input_ids"]} for t in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _start_generate_stop(tiny_models, tokenizer) -> list[list[int]]:
    llm = make_llm(tiny_models["target"], gsd_config(tiny_models["perturbed"]))
    try:
        assert not llm.llm_engine.vllm_config.model_config.enforce_eager  # the compiled mode
        return _greedy_ids(llm, tokenizer)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def test_second_start_loads_the_saved_compiled_models(engines, tiny_models, tokenizer, tmp_path, monkeypatch):
    reference = _greedy_ids(engines.get("target"), tokenizer)
    # The engine's processes copy the environment when they start.
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    compiled = _start_generate_stop(tiny_models, tokenizer)
    saved = sorted(tmp_path.glob("vllm-cache/torch_compile_cache/torch_aot_compile/*/rank_0_0/model"))
    assert len(saved) == 2  # the target's and the draft's

    monkeypatch.setenv("VLLM_FORCE_AOT_LOAD", "1")  # a load that fails now fails the start
    loaded = _start_generate_stop(tiny_models, tokenizer)
    assert compiled == reference
    assert loaded == reference
