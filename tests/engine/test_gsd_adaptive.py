"""The load-adaptive node budget inside real vLLM: it drafts at low load, decodes plainly at high
load, catches the draft up when load drops, and never changes a token."""

from __future__ import annotations

import pytest

from vllm_gsd.testing.engines import GSD_KNOBS, gsd_config, make_llm

pytestmark = pytest.mark.engine

# A target whose forward costs the same up to 8 query tokens, then grows linearly (as on a CPU),
# and a draft at a tenth of it: speculation pays for a few requests, not for many.
CPU_LIKE_COSTS = {"target": [[1, 1.0], [8, 1.0], [16, 2.0]], "draft": [[1, 0.1]]}


def _knobs(**overrides):
    knobs = {key: value for key, value in GSD_KNOBS.items() if key != "cost_curve"}
    return {**knobs, **overrides}


@pytest.fixture(scope="module")
def costly_gsd(tiny_models):
    llm = make_llm(tiny_models["target"], gsd_config(tiny_models["perturbed"], **_knobs(cost_curve=CPU_LIKE_COSTS)))
    yield llm
    llm.llm_engine.engine_core.shutdown()


def _token_prompts(tokenizer, count):
    from vllm_gsd.testing.prompts import tiny_prompts

    texts = (tiny_prompts() * (count // 8 + 1))[:count]
    return [{"prompt_token_ids": tokenizer(t, add_special_tokens=False)["input_ids"]} for t in texts]


def _greedy(max_tokens):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _token_ids(llm, prompts, params):
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _run(llm, prompts, params):
    """Token ids, and the change of the engine's GSD figures while generating them."""
    from vllm_gsd.engine.metrics import gsd_stats

    before = gsd_stats(llm)
    token_ids = _token_ids(llm, prompts, params)
    after = gsd_stats(llm)
    return token_ids, {name: getattr(after, name) - getattr(before, name) for name in vars(after)}


def test_one_request_gets_trees(costly_gsd, engines, tokenizer):
    prompts = _token_prompts(tokenizer, 1)
    got, delta = _run(costly_gsd, prompts, _greedy(48))
    assert got == _token_ids(engines.get("target"), prompts, _greedy(48))
    assert delta["steps_speculated"] > 0 and delta["steps_not_speculated"] == 0
    # Verification beyond 8 tokens costs more: the policy keeps trees at <= 7 nodes.
    assert 0 < delta["nodes_proposed"] <= 7 * delta["steps_speculated"] < delta["nodes_offered"]
    assert delta["accepted_nodes"] > 0


def test_many_requests_decode_plainly_then_speculate_as_they_finish(costly_gsd, engines, tokenizer):
    """32 requests: no speculation while most run; as they finish (max_tokens 8..100) the few
    left draft again, with the draft caught up on everything it skipped."""
    prompts = _token_prompts(tokenizer, 32)
    params = [_greedy(8 + 3 * i) for i in range(32)]
    got, delta = _run(costly_gsd, prompts, params)
    assert got == _token_ids(engines.get("target"), prompts, params)
    assert delta["steps_not_speculated"] > 0
    assert delta["steps_speculated"] > 0
    # The draft's KV was caught up correctly: its trees are accepted about as well as those of
    # a request that was drafted for from its first token (at least half as many nodes per tree).
    _, alone = _run(costly_gsd, prompts[-1:], params[-1:])
    per_tree = delta["accepted_nodes"] / max(delta["trees_verified"], 1)
    per_tree_alone = alone["accepted_nodes"] / max(alone["trees_verified"], 1)
    assert per_tree >= 0.5 * per_tree_alone


def test_measured_cost_curves_serve_exactly(tiny_models, engines, tokenizer):
    """Without a cost_curve the engine times its forwards at start-up; whatever it then decides,
    the output is the target's."""
    llm = make_llm(tiny_models["target"], gsd_config(tiny_models["perturbed"], **_knobs()))
    try:
        prompts = _token_prompts(tokenizer, 6)
        got, delta = _run(llm, prompts, _greedy(32))
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert got == _token_ids(engines.get("target"), prompts, _greedy(32))
    assert delta["steps_speculated"] + delta["steps_not_speculated"] > 0
