"""Tensor parallelism: gsd at tp=2 (vLLM's multiprocessing executor) equals tp=1 and the target,
every rank builds the same trees, a rank that builds different ones stops the engine, and so does
a rank whose drafter fails."""

from __future__ import annotations

import time

import pytest

from vllm_gsd.testing.engines import greedy_token_ids, gsd_config, make_llm, token_prompts
from vllm_gsd.testing.worker_probes import INJECTED_DRAFT_FAILURE, WORKER_PROBES, tree_counts_per_rank

pytestmark = pytest.mark.engine

TEXTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Queue:\n    def push(self, x):\n",
         "for i in range(10):\n"]
MAX_TOKENS = 40


def test_tp2_greedy_equals_tp1_and_target(engines, tokenizer):
    """At GSD's default knobs (engine "gsd_tp2"; the adaptive budget decides on every rank)."""
    prompts = token_prompts(tokenizer, TEXTS)
    tp2 = greedy_token_ids(engines.get("gsd_tp2"), prompts, MAX_TOKENS)
    assert (tp2 == greedy_token_ids(engines.get("gsd"), prompts, MAX_TOKENS)
            == greedy_token_ids(engines.get("target"), prompts, MAX_TOKENS))
    # Both ranks drafted and verified trees, the same ones (their agreement is also checked
    # every step, which the next test proves).
    counts = tree_counts_per_rank(engines.get("gsd_tp2"))
    assert len(counts) == 2 and counts[0]["trees_verified"] > 0
    assert counts[0] == counts[1], counts
    # Only rank 0 adds them to the vllm:gsd_* counters: /metrics sums every worker process.
    assert engines.get("gsd_tp2").collective_rpc("gsd_test_exports_metrics") == [True, False]


@pytest.mark.timeout(300)
def test_rank_that_builds_other_trees_stops_the_engine(tiny_models, engines, tokenizer, monkeypatch, capfd):
    from vllm.v1.engine.exceptions import EngineDeadError

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per CPU worker
    llm = make_llm(tiny_models["target"], gsd_config(tiny_models["perturbed"]), tensor_parallel_size=2,
                   worker_extension_cls=WORKER_PROBES)
    try:
        # Trees on every step (the tests' free cost curves) at tp 2: the target's tokens.
        prompts = token_prompts(tokenizer, TEXTS)
        got = greedy_token_ids(llm, prompts, MAX_TOKENS)
        assert got == greedy_token_ids(engines.get("target"), prompts, MAX_TOKENS)
        assert llm.collective_rpc("gsd_test_skew_trees", args=(1,)) == [False, True]
        capfd.readouterr()
        with pytest.raises(EngineDeadError):
            greedy_token_ids(llm, prompts, MAX_TOKENS)
    finally:
        llm.llm_engine.engine_core.shutdown()
    logs = capfd.readouterr()
    logs = logs.out + logs.err
    for rank in (0, 1):
        assert f"tensor-parallel rank {rank} proposed different trees" in logs


@pytest.mark.timeout(180)  # a hang fails here; without runner/rank_failure.py it lasts 300 s
def test_rank_whose_drafter_fails_stops_the_engine(tiny_models, tokenizer, monkeypatch, capfd):
    """Rank 1's draft forward raises (out of memory) before the draft's all-reduce: vLLM's
    executor hears only rank 0, which would wait for rank 1 in that all-reduce. Rank 1 names
    itself and the error and ends its worker; the engine stops within seconds."""
    from vllm.v1.engine.exceptions import EngineDeadError

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per CPU worker
    llm = make_llm(tiny_models["target"], gsd_config(tiny_models["perturbed"]), tensor_parallel_size=2,
                   worker_extension_cls=WORKER_PROBES)
    try:
        assert llm.collective_rpc("gsd_test_fail_draft", args=(1,)) == [False, True]
        capfd.readouterr()
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            greedy_token_ids(llm, token_prompts(tokenizer, TEXTS[:1]), 8)  # the first step drafts
        assert time.monotonic() - started < 60
    finally:
        llm.llm_engine.engine_core.shutdown()
    logs = capfd.readouterr()
    logs = logs.out + logs.err
    assert ("gsd: tensor-parallel rank 1 failed in its drafter: OutOfMemoryError: "
            f"{INJECTED_DRAFT_FAILURE} (tensor-parallel rank 1)") in logs
