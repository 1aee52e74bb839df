"""The load-adaptive node budget inside real vLLM: it drafts at low load, decodes plainly at high
load, catches the draft up when load drops, and never changes a token."""

from __future__ import annotations

import pytest

from vllm_gsd.testing.engines import CPU_LIKE_COSTS, greedy_params, gsd_config, make_llm, token_ids, token_prompts

pytestmark = pytest.mark.engine


def _knobs(**overrides):
    """The tests' knobs without their free cost curves (measured at start-up unless given)."""
    return {"cost_curve": None, **overrides}


@pytest.fixture(scope="module")
def costly_gsd(tiny_models):
    llm = make_llm(tiny_models["target"], gsd_config(tiny_models["perturbed"], **_knobs(cost_curve=CPU_LIKE_COSTS)))
    yield llm
    llm.llm_engine.engine_core.shutdown()


def _tiny_token_prompts(tokenizer, count):
    """`count` prompts: the tiny prompts, repeated as needed, as token ids."""
    from vllm_gsd.testing.prompts import tiny_prompts

    return token_prompts(tokenizer, (tiny_prompts() * (count // 8 + 1))[:count])


def _run(llm, prompts, params, outputs: list | None = None):
    """Token ids, and the change of the engine's GSD figures while generating them (the
    RequestOutputs go to `outputs` if given)."""
    from vllm_gsd.engine.metrics import gsd_stats

    before = gsd_stats(llm)
    results = llm.generate(prompts, params, use_tqdm=False)
    after = gsd_stats(llm)
    if outputs is not None:
        outputs.extend(results)
    delta = {name: getattr(after, name) - getattr(before, name) for name in vars(after)}
    return [list(o.outputs[0].token_ids) for o in results], delta


def _first_node_acceptance(outputs) -> float:
    """Share of verified trees whose first level was accepted (vLLM's per-request histograms of
    accepted nodes per verify step). Every tree verifies its best depth-1 node, whatever its
    size, so this is the draft's next-token accuracy at the roots."""
    steps = missed = 0
    for out in outputs:
        histogram = out.outputs[0].spec_decode_metrics.histogram
        steps, missed = steps + sum(histogram), missed + histogram[0]
    return 1.0 - missed / max(steps, 1)


def test_one_request_gets_trees(costly_gsd, engines, tokenizer):
    prompts = _tiny_token_prompts(tokenizer, 1)
    got, delta = _run(costly_gsd, prompts, greedy_params(48))
    assert got == token_ids(engines.get("target"), prompts, greedy_params(48))
    assert delta["steps_speculated"] > 0 and delta["steps_not_speculated"] == 0
    # Verification beyond 8 tokens costs more (each further node an eighth of a step): the policy
    # keeps trees near the 7 free nodes, far below the budget of 24, cutting some of what it drafted.
    assert 0 < delta["nodes_proposed"] <= 8 * delta["steps_speculated"]
    assert delta["nodes_proposed"] < delta["nodes_offered"]
    assert delta["accepted_nodes"] > 0
    # A draft level costs a tenth of a target step: levels whose children are too unsure to pay
    # for it are left out, by the depth the policy allows the step (its expected rate by depth)
    # or within the step (next_level_pays, tests/unit/test_budget.py). Which of the two does it
    # depends on the tiny models, trained on each machine (testing/tiny_models.py).
    print(f"levels drafted {delta['levels_drafted']}, left out {delta['levels_not_paying']} "
          f"in {delta['steps_speculated']} drafted steps")
    assert delta["levels_drafted"] + delta["levels_not_paying"] <= 4 * delta["steps_speculated"]
    assert delta["levels_drafted"] < 4 * delta["steps_speculated"]


def test_many_requests_decode_plainly_then_speculate_as_they_finish(costly_gsd, engines, tokenizer):
    """32 requests: no speculation while most run; as they finish (max_tokens 8..100) the few
    left draft again, with the draft caught up on everything it skipped."""
    prompts = _tiny_token_prompts(tokenizer, 32)
    params = [greedy_params(8 + 3 * i) for i in range(32)]
    batched: list = []
    got, delta = _run(costly_gsd, prompts, params, batched)
    assert got == token_ids(engines.get("target"), prompts, params)
    assert delta["steps_not_speculated"] > 0
    assert delta["steps_speculated"] > 0
    # The draft's KV was caught up correctly after the plain steps: its roots' next tokens are
    # as often right as for the same requests drafted for from their first token (a draft
    # reading KV it never wrote guesses far worse). Trees are smaller under load, so the
    # first level's acceptance is compared, not the accepted nodes per tree.
    late = [out for out, p in zip(batched, params) if p.max_tokens > 60]
    drafted_throughout: list = []
    _run(costly_gsd, prompts[-8:], params[-8:], drafted_throughout)
    caught_up, throughout = _first_node_acceptance(late), _first_node_acceptance(drafted_throughout)
    print(f"first-level acceptance: after plain steps {caught_up:.2f}, drafted throughout {throughout:.2f}")
    assert caught_up >= 0.8 * throughout


def test_measured_cost_curves_serve_exactly(tiny_models, engines, tokenizer, capfd):
    """Without a cost_curve the engine times its forwards at start-up; whatever it then decides,
    the output is the target's. The timed forwards run as serving runs them: each dispatched by
    its model's CUDA-graph dispatcher (the runner's, as a tree step; the drafter's) and padded to
    the captured size it picks, the draft's through its persistent buffers (graph sizes as on
    CUDA, the padded batches run eagerly on the CPU)."""
    from vllm_gsd.testing.worker_probes import WORKER_PROBES

    llm = make_llm(tiny_models["target"], gsd_config(tiny_models["perturbed"], **_knobs()),
                   worker_extension_cls=WORKER_PROBES)
    sizes = [4, 8, 16, 48]
    try:
        prompts = _tiny_token_prompts(tokenizer, 6)
        got, _ = _run(llm, prompts, greedy_params(32))
        logs = capfd.readouterr()  # the start-up's
        (timed,) = llm.collective_rpc("gsd_test_time_cost_curves", args=(sizes,))  # serves nothing after
    finally:
        llm.llm_engine.engine_core.shutdown()
    for model in ("target", "draft"):
        tokens = [q for q, _ in timed[model]]
        assert all(seconds > 0 for _, seconds in timed[model]) and tokens[0] == 1 and tokens[-1] > max(sizes)
        dispatched = {q: (padded, mode) for q, padded, mode in timed["dispatches"][model]}
        assert set(dispatched) == set(tokens), (model, dispatched)
        for q, (padded, mode) in dispatched.items():  # the next captured size; past the largest, eager
            assert (padded, mode) == ((min(s for s in sizes if s >= q), "PIECEWISE") if q <= max(sizes)
                                      else (q, "NONE")), (model, q, padded, mode)
    assert {tuple(pair) for pair in timed["draft_inputs"]} == {(q, p) for q, p, _ in timed["dispatches"]["draft"]}
    assert got == token_ids(engines.get("target"), prompts, greedy_params(32))
    # The worker (one, at tp 1) timed the target's and the draft's forwards before serving, as
    # engine/cost_calibration.py logs it; an engine given its curves times nothing.
    measured = [line for line in (logs.out + logs.err).splitlines()
                if "gsd: adaptive node budget, measured in" in line]
    assert len(measured) == 1, measured
    assert "target forward 1: " in measured[0] and "draft forward 1: " in measured[0], measured[0]


def test_a_draft_too_slow_to_pay_stops_speculation_by_measured_step_times(tiny_models, engines, tokenizer):
    """A draft made 40 ms slower per forward after start-up (so its measured cost curve calls it
    cheap; a tiny target step takes a few ms): the measured whole-step times say plain decoding
    is faster, and speculation stops. Speculative steps cost at most 5% of the run beyond what
    plain steps would have taken for their tokens, and the output is the target's."""
    from vllm_gsd.testing.worker_probes import WORKER_PROBES

    llm = make_llm(tiny_models["target"], gsd_config(tiny_models["perturbed"], **_knobs()),
                   worker_extension_cls=WORKER_PROBES)
    try:
        # The default head on CPU (engine/draft_head.py), whose cost the slowed forwards include.
        assert [w["draft_head"] for w in llm.collective_rpc("gsd_test_worker_info")] == ["Int8DraftHead"]
        llm.collective_rpc("gsd_test_slow_draft", args=(0.04,))
        llm.collective_rpc("gsd_test_count_tree_scoring")
        prompts = _tiny_token_prompts(tokenizer, 16)
        got, delta = [], None
        for prompt in prompts:  # one request at a time: the load speculation is for
            ids, step = _run(llm, [prompt], greedy_params(128))
            got += ids
            delta = step if delta is None else {k: delta[k] + step[k] for k in step}
        [tree_scoring_calls] = llm.collective_rpc("gsd_test_tree_scoring_calls")
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert got == token_ids(engines.get("target"), prompts, greedy_params(128))
    assert delta["steps_not_speculated"] > 10 * delta["steps_speculated"]
    # Plain steps sample as without speculation: only a step that verifies trees is scored by
    # GSD's rejection sampler (vLLM would route every step through it).
    assert tree_scoring_calls <= delta["steps_speculated"]
    plain_rate = delta["plain_step_tokens"] / delta["plain_step_us"]
    lost = delta["speculative_step_us"] - delta["speculative_step_tokens"] / plain_rate
    total = delta["speculative_step_us"] + delta["plain_step_us"]
    print(f"speculative steps {delta['steps_speculated']}, vetoed {delta['steps_vetoed']}, "
          f"time lost to them {100 * lost / total:.1f}% of {total / 1e6:.1f} s")
    assert lost <= 0.05 * total
