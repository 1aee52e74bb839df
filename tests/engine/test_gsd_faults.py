"""Faults inside real vLLM with GSD: stops inside an accepted path, aborts mid-tree, the context
limit at every room from 0 to past the node budget, n > 1, seeded prompts split by chunked
prefill. Each is served as the target alone would, and leaves the other requests untouched."""

from __future__ import annotations

import pytest

from vllm_gsd.testing.engines import MAX_MODEL_LEN, NODE_BUDGET, greedy_params, token_prompts

pytestmark = pytest.mark.engine

TEXTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n",
    "class Queue:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(",
    "    return self._data[key]\n",
    "try:\n    value = int(text)\nexcept ValueError:\n",
]


def _outputs(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _step_by_step(llm, prompts, params, abort_at: dict[int, int] | None = None):
    """Run through the engine's own step loop: {request: tokens after each step} and the outputs.

    abort_at: request index -> abort that request once it has this many tokens (mid-tree)."""
    engine = llm.llm_engine
    abort_at = abort_at or {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    lengths = {i: [] for i in range(len(prompts))}
    finished: dict = {}
    aborted: set[int] = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = int(out.request_id[1:])
            lengths[i].append(len(out.outputs[0].token_ids))
            if out.finished:
                finished[i] = out.outputs[0]
        aborting = [i for i, n in abort_at.items()
                    if i not in finished and i not in aborted and lengths[i] and lengths[i][-1] >= n]
        if aborting:
            engine.abort_request([f"r{i}" for i in aborting])
            aborted.update(aborting)
    return lengths, finished


def _inside_an_accepted_path(lengths: list[int]) -> list[int]:
    """Token indices that a step emitted with more tokens after them in the same step."""
    inside, start = [], 0
    for end in lengths:
        inside += range(start, end - 1)
        start = end
    return inside


def test_stops_inside_an_accepted_path_end_the_output_where_the_target_does(engines, tokenizer):
    """A stop string or a stop token (vLLM's EOS check; the tiny target never emits EOS greedily)
    completed by a token that is followed by more accepted tokens of the same step: the output
    ends exactly where the target's own does, tokens and text."""
    from vllm import SamplingParams

    llm = engines.get("gsd_same")  # draft == target: deep accepted paths
    prompts = token_prompts(tokenizer, TEXTS)
    lengths, full = _step_by_step(llm, prompts, greedy_params(40))
    cases = []  # (prompt, SamplingParams, the token index the stop falls on)
    for i, prompt in enumerate(prompts):
        ids, text = list(full[i].token_ids), full[i].text
        for t in _inside_an_accepted_path(lengths[i]):
            piece = tokenizer.decode(ids[t:t + 1])
            offset = len(tokenizer.decode(ids[:t]))
            if piece.strip() and text.find(piece) == offset and ids.index(ids[t]) == t:
                cases.append((prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=[piece]), t))
                cases.append((prompt, SamplingParams(temperature=0.0, max_tokens=40,
                                                     stop=[piece], include_stop_str_in_output=True), t))
                cases.append((prompt, SamplingParams(temperature=0.0, max_tokens=40,
                                                     stop_token_ids=[ids[t]]), t))
                break
    assert len(cases) >= 3 * (len(prompts) - 1), "too few stops inside accepted paths"
    got = _outputs(llm, [c[0] for c in cases], [c[1] for c in cases])
    want = _outputs(engines.get("target"), [c[0] for c in cases], [c[1] for c in cases])
    for (_, params, t), g, w in zip(cases, got, want):
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == \
               (w.token_ids, w.text, w.finish_reason, w.stop_reason), params
        assert g.finish_reason == "stop" and len(g.token_ids) == t + 1


def test_aborts_mid_tree_leave_the_other_requests_exact(engines, tokenizer):
    """Requests aborted while their trees are in flight are freed; the others' tokens are the
    target's own, and the engine serves new requests exactly afterwards."""
    llm = engines.get("gsd")
    prompts = token_prompts(tokenizer, TEXTS)
    params = greedy_params(48)
    lengths, finished = _step_by_step(llm, prompts, params, abort_at={0: 2, 3: 6, 5: 12})
    want = _outputs(engines.get("target"), prompts, params)
    assert sorted(finished) == [1, 2, 4]
    for i in (1, 2, 4):
        assert finished[i].token_ids == want[i].token_ids
    for i in (0, 3, 5):  # aborted mid-way, after at least one tree was verified
        assert lengths[i][-1] < 48
    assert not llm.llm_engine.has_unfinished_requests()
    assert [o.token_ids for o in _outputs(llm, prompts, params)] == [w.token_ids for w in want]


def test_every_room_from_zero_to_past_the_node_budget(engines, tokenizer):
    """Prompts that end exactly at the context limit, or leave room for 1..N+2 tokens (fewer
    nodes than the budget, down to none), in one batch: each request stops at the limit as the
    target's does."""
    base = token_prompts(tokenizer, [TEXTS[2]])[0]["prompt_token_ids"]
    rooms = list(range(1, NODE_BUDGET + 3))
    prompts = [{"prompt_token_ids": (base * 100)[:MAX_MODEL_LEN - room]} for room in rooms]
    params = greedy_params(NODE_BUDGET + 8)  # more than any room: the context limit stops them
    got = _outputs(engines.get("gsd"), prompts, params)
    want = _outputs(engines.get("target"), prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [len(g.token_ids) for g in got] == rooms
    assert all(g.finish_reason == "length" for g in got)
    # No room at all: vLLM refuses the prompt, as it does without speculation.
    from vllm.exceptions import VLLMValidationError

    full = [{"prompt_token_ids": (base * 100)[:MAX_MODEL_LEN]}]
    errors = []
    for name in ("gsd", "target"):
        with pytest.raises(VLLMValidationError) as err:
            engines.get(name).generate(full, params, use_tqdm=False)
        errors.append(str(err.value))
    assert errors[0] == errors[1] and "maximum model length of 512" in errors[0]


def test_n_greater_than_one_at_top_k_one_equals_greedy(engines, tokenizer):
    """n = 3 completions that can only follow the argmax (top_k = 1) are the target's greedy
    tokens, each of them; vLLM itself refuses n > 1 at temperature 0."""
    from vllm import SamplingParams

    prompts = token_prompts(tokenizer, TEXTS)[:3]
    params = SamplingParams(n=3, temperature=1.0, top_k=1, max_tokens=24, ignore_eos=True)
    got = engines.get("gsd").generate(prompts, params, use_tqdm=False)
    want = _outputs(engines.get("target"), prompts, greedy_params(24))
    for g, w in zip(got, want):
        assert [c.token_ids for c in g.outputs] == [w.token_ids] * 3


def test_seeded_prompts_split_by_chunked_prefill(engines, tokenizer):
    """Seeded requests whose prompts the scheduler splits over steps (more prompt tokens than the
    step's budget). vLLM rewinds the generator of a partial prefill by a CUDA Philox offset, which
    CPU generators lack: without GSD's parking the engine died here (RuntimeError). The seeded
    text equals the same request's text when it is prefilled at once."""
    from vllm import SamplingParams

    base = token_prompts(tokenizer, [TEXTS[2]])[0]["prompt_token_ids"]
    long = [{"prompt_token_ids": (base * 40)[k:k + 460]} for k in range(10)]  # 4600 > 4096 tokens
    params = [SamplingParams(temperature=0.8, seed=100 + k, max_tokens=12, ignore_eos=True)
              for k in range(10)]
    llm = engines.get("gsd")
    together = [o.token_ids for o in _outputs(llm, long, params)]
    alone = [_outputs(llm, [p], q)[0].token_ids for p, q in zip(long[-2:], params[-2:])]
    assert all(len(t) == 12 for t in together)
    assert together[-2:] == alone


def test_sampled_tokens_report_the_targets_raw_logprobs(engines, tokenizer):
    """Logprobs of sampled tokens (temperature 0.5, top_k 20) are the target's raw logprobs of
    the tokens emitted, as vLLM reports them without speculation; the tree path once reported
    them after temperature and top-k (it processed the float32 logits in place)."""
    from vllm import SamplingParams

    prompt = token_prompts(tokenizer, TEXTS)[2]
    params = SamplingParams(temperature=0.5, top_k=20, seed=3, max_tokens=16, ignore_eos=True, logprobs=2)
    got = _outputs(engines.get("gsd"), [prompt], params)[0]
    scored = engines.get("target").generate(
        [{"prompt_token_ids": prompt["prompt_token_ids"] + list(got.token_ids)}],
        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0].prompt_logprobs
    raw = [entry[token].logprob for entry, token in
           zip(scored[len(prompt["prompt_token_ids"]):], got.token_ids)]
    assert [entry[token].logprob for entry, token in zip(got.logprobs, got.token_ids)] == \
           pytest.approx(raw, abs=1e-4)


def test_the_widest_accepted_config_serves_exactly(tiny_models, engines, tokenizer):
    """The far corner of what the config accepts (node budget 128, top_k 16, depth 32, merge
    r = 8, no pruning, fixed budget) starts and serves exactly: no accepted config fails later."""
    from vllm_gsd.testing.engines import gsd_config, make_llm

    spec = gsd_config(tiny_models["perturbed"], 128, top_k=16, max_depth=32, merge_ngram=8,
                      min_child_ratio=0.0, leaf_prob=0.0, adaptive=False, cost_curve=None)
    prompts = token_prompts(tokenizer, TEXTS)[:2]
    llm = make_llm(tiny_models["target"], spec)
    try:
        got = [o.token_ids for o in _outputs(llm, prompts, greedy_params(24))]
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert got == [o.token_ids for o in _outputs(engines.get("target"), prompts, greedy_params(24))]
