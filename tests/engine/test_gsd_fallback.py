"""Request options with trees: each is honoured exactly, and a request carrying it is verified
as a tree (penalties, bad words, allowed token ids, logit bias, min_p, min_tokens, repetition
detection, logprobs and logprob token ids, extra_args, a grammar, the thinking budget). Sampled
options (min_p) are tested for their distribution in test_gsd_sampling.py.

Every option test compares a gsd engine with the target alone on the same batch, with the
option, AND checks that the option changes the target's output on that batch: an option the
engine ignored could not pass. The option's requests run beside plain requests that get trees.
Each runs on two gsd engines: trees on every step (the tests' free cost curves), where the
option's requests must have been verified as trees, and GSD's default knobs with CPU-like cost
curves (the adaptive budget cuts some requests' trees).
"""

from __future__ import annotations

import math

import pytest

from vllm_gsd.testing.engines import token_ids, token_prompts

pytestmark = pytest.mark.engine

TEXTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "for i in range(10):\n", "class A:\n    def f(self):\n"]
GSD_ENGINES = ["gsd", "gsd_defaults"]


def _params(**option):
    from vllm import SamplingParams
    from vllm.sampling_params import RepetitionDetectionParams

    if "repetition_detection" in option:
        option["repetition_detection"] = RepetitionDetectionParams(**option["repetition_detection"])
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 24, "ignore_eos": True, **option})


def _served_exactly_beside_trees(engines, gsd_engine, prompts, option, **plain_option):
    """The option's requests, then plain ones, in one batch: gsd gives the target's tokens, and
    the option's requests differ from the same requests without it. With trees on every step,
    every request with the option was verified as a tree."""
    from vllm_gsd.testing.engines import acceptance_of

    with_option = [_params(**option)] * len(prompts) + [_params()] * len(prompts)
    without = [_params(**plain_option)] * len(prompts)
    outputs = engines.get(gsd_engine).generate(prompts + prompts, with_option, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    want = token_ids(engines.get("target"), prompts + prompts, with_option)
    assert got == want
    unchanged = token_ids(engines.get("target"), prompts, without)
    assert want[:len(prompts)] != unchanged, f"{option} does not change this batch's output: the test cannot fail"
    if gsd_engine == "gsd":
        verified = [acceptance_of([o]) for o in outputs[:len(prompts)]]
        # Verified as trees, and the draft, proposing under the option, had nodes accepted.
        assert all(steps for steps, _ in verified) and sum(a for _, a in verified) > 0, verified


@pytest.mark.parametrize("gsd_engine", GSD_ENGINES)
@pytest.mark.parametrize("option", [
    {"repetition_penalty": 1.3},
    {"presence_penalty": 0.8, "frequency_penalty": 0.4},
    {"logit_bias": {11: 3.0, 12: -3.0}},
    {"bad_words": ["#"]},
    {"allowed_token_ids": list(range(300, 700))},
    {"repetition_detection": {"max_pattern_size": 4, "min_count": 3}},
], ids=["repetition_penalty", "presence_frequency", "logit_bias", "bad_words", "allowed_token_ids",
        "repetition_detection"])
def test_greedy_option_is_served_exactly(engines, tokenizer, gsd_engine, option):
    _served_exactly_beside_trees(engines, gsd_engine, token_prompts(tokenizer, TEXTS), option)


def test_extra_args_keep_their_trees(engines, tokenizer):
    """extra_args (the OpenAI server's vllm_xargs) reach only custom logits processors, which a
    gsd engine refuses at start: a request carrying them is verified as a tree, exactly."""
    from vllm_gsd.testing.engines import acceptance_of

    prompts = token_prompts(tokenizer, TEXTS)
    params = _params(extra_args={"request_tag": "a"})
    got = engines.get("gsd").generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == token_ids(engines.get("target"), prompts, params)
    assert acceptance_of(got)[1] > 0


@pytest.mark.parametrize("gsd_engine", GSD_ENGINES)
def test_min_tokens_holds_back_a_stop_token(engines, tokenizer, gsd_engine):
    """A stop token the target emits early is held back until min_tokens."""
    prompts = token_prompts(tokenizer, TEXTS)
    stop = token_ids(engines.get("target"), prompts[:1], _params())[0][3]
    _served_exactly_beside_trees(engines, gsd_engine, prompts,
                                 {"min_tokens": 12, "stop_token_ids": [stop], "ignore_eos": False},
                                 stop_token_ids=[stop], ignore_eos=False)


@pytest.mark.parametrize("gsd_engine", GSD_ENGINES)
def test_thinking_budget_ends_thinking_on_the_budgeted_rows(engines, tokenizer, gsd_engine):
    """Requests that start inside a thinking section (the prompt ends with the start marker):
    the budgeted ones (3 and 6 tokens), at batch rows 1 and 3, are forced to the end marker, the
    others at rows 0 and 2 think on. The budgeted requests are verified as
    trees (of depth 4: the forced row falls inside one), each row with vLLM's thinking-budget
    state after its own path."""
    from vllm_gsd.testing.engines import TEST_REASONING, acceptance_of

    start = tokenizer(TEST_REASONING["reasoning_start_str"], add_special_tokens=False)["input_ids"]
    end = tokenizer(TEST_REASONING["reasoning_end_str"], add_special_tokens=False)["input_ids"]
    prompts = [{"prompt_token_ids": p["prompt_token_ids"] + start} for p in token_prompts(tokenizer, TEXTS)]
    plain = _params(max_tokens=16)
    params = [plain, _params(max_tokens=16, thinking_token_budget=3), plain,
              _params(max_tokens=16, thinking_token_budget=6)]
    outputs = engines.get(gsd_engine).generate(prompts, params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    want = token_ids(engines.get("target"), prompts, params)
    assert got == want
    if gsd_engine == "gsd":
        assert all(steps for steps, _ in (acceptance_of([o]) for o in outputs))
        assert acceptance_of([outputs[1], outputs[3]])[1] > 0
    unbudgeted = token_ids(engines.get("target"), prompts, plain)
    ends = {}
    for row in (1, 3):
        ends[row] = [i for i in range(len(want[row])) if want[row][i:i + len(end)] == end]
        assert want[row] != unbudgeted[row] and ends[row], (row, want[row], unbudgeted[row])
    # Sampled: the walk draws each row after the forcing, so the end marker comes where the
    # budget puts it (the count of thinking tokens, not their values), here as for greedy.
    sampled = _params(max_tokens=16, thinking_token_budget=3, temperature=0.8, seed=1)
    drawn = engines.get(gsd_engine).generate(prompts[1:2], sampled, use_tqdm=False)[0]
    tokens = list(drawn.outputs[0].token_ids)
    first_end = ends[1][0]
    assert tokens[first_end:first_end + len(end)] == end and tokens[:first_end] != want[1][:first_end], tokens
    if gsd_engine == "gsd":
        assert acceptance_of([drawn])[0] > 0


@pytest.mark.parametrize("gsd_engine", GSD_ENGINES)
def test_logprob_token_ids_beside_tree_requests(engines, tokenizer, gsd_engine):
    """Requests 1 and 3 ask the logprobs of given token ids: the target's, at every token, and
    the requests themselves are verified as trees."""
    from vllm_gsd.testing.engines import acceptance_of

    prompts = token_prompts(tokenizer, TEXTS)
    asking = _params(logprob_token_ids=[11, 12, 100])
    params = [_params(), asking, _params(), asking]
    got = engines.get(gsd_engine).generate(prompts, params, use_tqdm=False)
    want = engines.get("target").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in [(got[1], want[1]), (got[3], want[3])]:
        assert len(g.outputs[0].logprobs) == len(w.outputs[0].logprobs) == 24
        for step_g, step_w in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert set(step_g) == set(step_w) >= {11, 12, 100}
            for token, entry in step_w.items():
                assert math.isclose(step_g[token].logprob, entry.logprob, abs_tol=1e-4)
    if gsd_engine == "gsd":  # trees on every step: the asking requests are verified as trees
        assert acceptance_of([got[1], got[3]])[1] > 0


@pytest.mark.parametrize("gsd_engine", GSD_ENGINES)
def test_logprobs_along_accepted_paths(engines, tokenizer, gsd_engine):
    params = _params(max_tokens=20, logprobs=3)
    got = engines.get(gsd_engine).generate(token_prompts(tokenizer, TEXTS), params, use_tqdm=False)
    want = engines.get("target").generate(token_prompts(tokenizer, TEXTS), params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lp_g, lp_w in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert set(lp_g) == set(lp_w)
            for token, entry in lp_w.items():
                assert math.isclose(lp_g[token].logprob, entry.logprob, abs_tol=1e-4)


def test_n_greater_than_one(engines, tokenizer):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True, n=3)
    first = engines.get("gsd").generate(token_prompts(tokenizer, TEXTS)[:1], params, use_tqdm=False)[0]
    again = engines.get("gsd").generate(token_prompts(tokenizer, TEXTS)[:1], params, use_tqdm=False)[0]
    assert len(first.outputs) == 3 and all(len(c.token_ids) == 16 for c in first.outputs)
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1


# Bounded values: the tiny target would otherwise write one integer to max_tokens.
JSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["size", "ok", "kind"],
               "properties": {"size": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"},
                              "kind": {"enum": ["import", "def", "class"]}}}


def _structured(**kind):
    from vllm.sampling_params import StructuredOutputsParams

    return _params(max_tokens=96, ignore_eos=False, structured_outputs=StructuredOutputsParams(**kind))


@pytest.mark.parametrize("gsd_engine", GSD_ENGINES)
@pytest.mark.parametrize("kind", [
    {"choice": ["import os", "def f", "class A:\n    def f(self):\n        return 1"]},
    {"regex": r"(def [a-z]{1,8}\(\):|import [a-z]{2,6})\n"},
    {"json": JSON_SCHEMA},  # compact JSON (the engines' structured_outputs_config)
], ids=["choice", "regex", "json"])
def test_structured_output_is_served_exactly_with_trees(engines, tokenizer, gsd_engine, kind):
    """A grammar over trees: every tree row masked with the grammar's state after its own path.
    The target's tokens, output the grammar allows (JSON that parses and fits the schema), and
    on the free-tree engine the grammar requests were verified as trees (a tree whose nodes the
    grammar all refuses is cut to nothing, so a short output may run plain steps only)."""
    import json
    import re

    from vllm_gsd.testing.engines import acceptance_of

    prompts = token_prompts(tokenizer, TEXTS)
    params = [_structured(**kind)] * 4 + [_params()] * 4
    got = engines.get(gsd_engine).generate(prompts + prompts, params, use_tqdm=False)
    want = engines.get("target").generate(prompts + prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    texts = [o.outputs[0].text for o in got[:4]]
    if "choice" in kind:
        assert all(t in kind["choice"] for t in texts), texts
    elif "regex" in kind:
        assert all(re.fullmatch(kind["regex"], t) for t in texts), texts
    else:
        for text in texts:
            value = json.loads(text)
            assert set(value) == {"size", "ok", "kind"} and value["size"] in (1, 2, 3), value
            assert isinstance(value["ok"], bool) and value["kind"] in ("import", "def", "class"), value
    unconstrained = token_ids(engines.get("target"), prompts, _params(max_tokens=48))
    assert [list(o.outputs[0].token_ids) for o in want[:4]] != unconstrained  # the grammar is visible
    if gsd_engine == "gsd":
        verified = [acceptance_of([o]) for o in got]
        assert sum(steps for steps, _ in verified[:4]) > 0 and sum(a for _, a in verified[:4]) > 0, verified
        assert all(steps > 0 for steps, _ in verified[4:]), verified


def test_the_draft_proposes_under_the_grammar(engines, tokenizer):
    """The draft's children of a structured-output request are tokens its grammar allows after
    their path (the worker's copy of the grammar): more of its nodes are accepted than when it
    drafts without the grammar, and the output is the target's either way."""
    from vllm_gsd.testing.engines import acceptance_of

    prompts = token_prompts(tokenizer, TEXTS)
    params = [_structured(json=JSON_SCHEMA)] * 4
    want = token_ids(engines.get("target"), prompts, params)
    llm = engines.get("gsd")
    acceptance = {}
    try:
        for under_grammar in (False, True):
            llm.collective_rpc("gsd_test_draft_under_grammars", args=(under_grammar,))
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outputs] == want
            steps, accepted = acceptance_of(outputs)
            acceptance[under_grammar] = accepted / steps
    finally:
        llm.collective_rpc("gsd_test_draft_under_grammars", args=(True,))
    assert acceptance[True] > acceptance[False], acceptance
