"""Tensor parallelism: gsd at tp=2 (vLLM's multiprocessing executor) equals tp=1 and the target,
every rank builds the same trees, and a rank that builds different ones stops the engine."""

from __future__ import annotations

import pytest

from vllm_gsd.testing.engines import gsd_config, make_llm
from vllm_gsd.testing.worker_probes import WORKER_PROBES, tree_counts_per_rank

pytestmark = pytest.mark.engine

TEXTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Queue:\n    def push(self, x):\n",
         "for i in range(10):\n"]


def _prompts(tokenizer):
    return [{"prompt_token_ids": tokenizer(t, add_special_tokens=False)["input_ids"]} for t in TEXTS]


def _greedy(llm, prompts):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_tp2_greedy_equals_tp1_and_target(engines, tokenizer):
    """At GSD's default knobs (engine "gsd_tp2"; the adaptive budget decides on every rank)."""
    prompts = _prompts(tokenizer)
    tp2 = _greedy(engines.get("gsd_tp2"), prompts)
    assert tp2 == _greedy(engines.get("gsd"), prompts) == _greedy(engines.get("target"), prompts)
    # Both ranks drafted and verified trees, the same ones (their agreement is also checked
    # every step, which the next test proves).
    counts = tree_counts_per_rank(engines.get("gsd_tp2"))
    assert len(counts) == 2 and counts[0]["trees_verified"] > 0
    assert counts[0] == counts[1], counts
    # Only rank 0 adds them to the vllm:gsd_* counters: /metrics sums every worker process.
    assert engines.get("gsd_tp2").collective_rpc(lambda worker: worker.model_runner.gsd.metrics.exports) == [True, False]


@pytest.mark.timeout(300)
def test_rank_that_builds_other_trees_stops_the_engine(tiny_models, engines, tokenizer, monkeypatch, capfd):
    from vllm.v1.engine.exceptions import EngineDeadError

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per CPU worker
    llm = make_llm(tiny_models["target"], gsd_config(tiny_models["perturbed"]), tensor_parallel_size=2,
                   worker_extension_cls=WORKER_PROBES)
    try:
        # Trees on every step (the tests' free cost curves) at tp 2: the target's tokens.
        assert _greedy(llm, _prompts(tokenizer)) == _greedy(engines.get("target"), _prompts(tokenizer))
        assert llm.collective_rpc("gsd_test_skew_trees", args=(1,)) == [False, True]
        capfd.readouterr()
        with pytest.raises(EngineDeadError):
            _greedy(llm, _prompts(tokenizer))
    finally:
        llm.llm_engine.engine_core.shutdown()
    logs = capfd.readouterr()
    logs = logs.out + logs.err
    for rank in (0, 1):
        assert f"tensor-parallel rank {rank} proposed different trees" in logs
