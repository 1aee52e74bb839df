"""Host reads per step (issue 39, proxy 1): the calls that would make the host wait for a GPU's
stream, counted on the CPU by provenance (vllm_gsd/testing/host_reads.py). Figures and sites:
docs/results/host-reads.md.

One engine at a time, each for a few steps: a target without speculation, then a gsd engine
with trees forced (its plain steps from prompts at the context limit, where no tree fits, so
that both engines run the same requests).
"""

from __future__ import annotations

import gc

import pytest

from vllm_gsd.testing.engines import MAX_MODEL_LEN, NODE_BUDGET, gsd_config, greedy_params, make_llm, token_prompts
from vllm_gsd.testing.host_reads import HOST_READ_PROBES, step_reads
from vllm_gsd.testing.prompts import tiny_prompts

pytestmark = pytest.mark.engine

MAX_TOKENS = 12
# Measured on the tiny pair with these requests (docs/results/host-reads.md), as a bound on
# each drafted step of L draft forwards (catch-up included): reads <= a L + b and every call that
# would wait (reads, pageable host-to-device copies, stalls) <= c L + d. A drafted step, greedy or
# sampled, reads once per draft level (its children) plus twice (the accepted paths, vLLM's
# output), whatever it accepts, and waits for nothing else: its host arrays reach the device
# through pinned staging (engine/staging.py) and the sampled walk runs on the device. So the
# bound is the goal, L + 2, exactly: any new read or pageable copy fails.
DRAFTED_STEP_BOUNDS = {  # workload: ((a, b), (c, d))
    "greedy": ((1, 2), (1, 2)),  # seen: L 3: 5 reads, 5 calls; L 4: 6, 6
    "sampled": ((1, 2), (1, 2)),  # seen: L 3: 5 reads, 5 calls; L 4: 6, 6
    # Requests with options (penalties, min_p, logit bias, bad words; sampled and greedy): their
    # rows, the target's and the draft's, are processed with each row's path, from staged arrays.
    "options": ((1, 2), (1, 2)),
}


def _options_params():
    """Sampled and greedy requests whose options change their rows along each path."""
    from vllm import SamplingParams

    common = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [SamplingParams(temperature=0.8, seed=0, repetition_penalty=1.3, min_p=0.05, **common),
            SamplingParams(temperature=0.7, seed=1, presence_penalty=0.8, logit_bias={30: 1.5}, **common),
            SamplingParams(temperature=0.0, frequency_penalty=0.5, bad_words=[" self"], **common),
            SamplingParams(temperature=0.0, repetition_penalty=1.2, logit_bias={11: -2.0}, **common)]


def _sampled_params():
    from vllm import SamplingParams

    return [SamplingParams(temperature=0.8, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True) for i in range(4)]


def _run(llm, prompts, params):
    """(token ids, StepReads of the steps) of one generate call."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], step_reads(llm.collective_rpc("gsd_test_host_reads")[0])


def _at_context_limit(prompts):
    """The prompts, repeated up to where no tree of NODE_BUDGET nodes fits before the context
    limit at any of their MAX_TOKENS steps: a gsd engine decodes them plainly."""
    length = MAX_MODEL_LEN - NODE_BUDGET + 1  # a root at length - 1 or later: its last node at the limit
    return [{"prompt_token_ids": (p["prompt_token_ids"] * length)[:length]} for p in prompts]


@pytest.fixture(scope="module")
def counted(tiny_models, tokenizer):
    """{engine: {workload: (token ids, steps)}}: each engine started, counted, shut down."""
    prompts = token_prompts(tokenizer, tiny_prompts(4))
    workloads = {"at_context_limit": (_at_context_limit(prompts), greedy_params(MAX_TOKENS)),
                 "greedy": (prompts, greedy_params(MAX_TOKENS)), "sampled": (prompts, _sampled_params()),
                 "options": (prompts, _options_params())}
    results = {}
    for name, spec in (("plain", None), ("gsd", gsd_config(tiny_models["perturbed"]))):
        llm = make_llm(tiny_models["target"], spec, worker_extension_cls=HOST_READ_PROBES)
        try:
            llm.collective_rpc("gsd_test_count_host_reads")
            chosen = workloads if spec is not None else {k: workloads[k] for k in ("at_context_limit", "greedy")}
            results[name] = {w: _run(llm, *workload) for w, workload in chosen.items()}
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
    return results


def _decode(steps, drafted: bool):
    return [s for s in steps if s.decode and s.drafted == drafted and s.verified == drafted]


def test_plain_steps_of_a_gsd_engine_add_no_reads(counted):
    """A step the tree path does not serve costs what vLLM's own step costs: no synchronize to
    time the forward (a StepTimer reads CUDA events a step late), no read of our own."""
    plain = _decode(counted["plain"]["at_context_limit"][1], drafted=False)
    gsd = _decode(counted["gsd"]["at_context_limit"][1], drafted=False)
    assert len(plain) >= MAX_TOKENS - 2 and len(gsd) >= MAX_TOKENS - 2
    baseline = max(s.total for s in plain)
    assert all(s.total <= baseline for s in gsd), [(s.reads, s.h2d, s.stalls) for s in gsd]
    assert all(not s.stalls for s in gsd)
    # The tree path's engine gives the target's tokens, plain steps or drafted ones.
    assert counted["gsd"]["at_context_limit"][0] == counted["plain"]["at_context_limit"][0]
    assert counted["gsd"]["greedy"][0] == counted["plain"]["greedy"][0]


@pytest.mark.parametrize("workload", ["greedy", "sampled", "options"])
def test_drafted_steps_stay_within_the_recorded_reads(counted, workload):
    drafted = [s for s in counted["gsd"][workload][1] if s.decode and s.drafted]
    assert drafted, "no drafted step: the tree path did not run"
    (a, b), (c, d) = DRAFTED_STEP_BOUNDS[workload]
    for step in drafted:
        assert step.num_reads <= a * step.levels + b, (step.levels, step.reads)
        assert step.total <= c * step.levels + d, (step.levels, step.reads, step.h2d, step.stalls)
        assert not step.stalls
