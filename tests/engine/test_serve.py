"""`vllm serve ... --speculative-config '{"method": "gsd", ...}'`: the real server on 127.0.0.1."""

from __future__ import annotations

import json

import pytest
import requests

from scripts.tools import load
from scripts.tools.server import scrape_metrics, serve, wait_drained
from vllm_gsd.testing.engines import (
    TEST_REASONING,
    TEST_STRUCTURED_OUTPUTS,
    default_gsd_config,
    greedy_params,
    gsd_config,
)

pytestmark = [pytest.mark.engine, pytest.mark.serve]

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Stack:\n    def push(self, x):\n"]


@pytest.fixture(scope="module", params=["free_trees", "default_knobs"])
def gsd_server(request, tiny_models, tmp_path_factory):
    """The server with trees on every step (the tests' free cost curves), then with GSD's
    default knobs and CPU-like cost curves (the adaptive budget cuts trees under load)."""
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    speculative_config = (gsd_config(tiny_models["perturbed"]) if request.param == "free_trees"
                          else default_gsd_config(tiny_models["perturbed"]))
    with serve(tiny_models["target"], speculative_config, log_path,
               ["--chat-template", CHAT_TEMPLATE, "--structured-outputs-config", json.dumps(TEST_STRUCTURED_OUTPUTS),
                "--reasoning-config", json.dumps(TEST_REASONING),
                "--enable-auto-tool-choice", "--tool-call-parser", "pythonic", *load.SERVER_ARGS]) as server:
        yield server.url, log_path


def _offline_greedy(engines, prompts, max_tokens):
    outs = engines.get("target").generate(prompts, greedy_params(max_tokens), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_completions_equal_offline_target(gsd_server, engines, tiny_models):
    url, _ = gsd_server
    expected = _offline_greedy(engines, PROMPTS, 24)
    for prompt, want in zip(PROMPTS, expected):
        reply = requests.post(f"{url}/v1/completions", timeout=120, json={
            "model": tiny_models["target"], "prompt": prompt, "max_tokens": 24,
            "temperature": 0.0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == want


def test_chat_equals_offline_target(gsd_server, engines, tiny_models):
    url, _ = gsd_server
    messages = [{"role": "user", "content": "write a loop"}]
    want = engines.get("target").chat(
        messages, greedy_params(20), chat_template=CHAT_TEMPLATE, use_tqdm=False)[0].outputs[0].text
    reply = requests.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": tiny_models["target"], "messages": messages, "max_tokens": 20,
        "temperature": 0.0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == want


JSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["size", "ok"],
               "properties": {"size": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"}}}


def test_json_mode_through_the_openai_api(gsd_server, engines, tiny_models):
    """`response_format` with a JSON schema: the grammar runs over trees. The JSON is the
    target's and fits the schema."""
    from vllm.sampling_params import StructuredOutputsParams

    url, _ = gsd_server
    messages = [{"role": "user", "content": "describe the loop as json"}]
    reply = requests.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": tiny_models["target"], "messages": messages, "max_tokens": 48, "temperature": 0.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": JSON_SCHEMA}}})
    assert reply.status_code == 200, reply.text
    content = reply.json()["choices"][0]["message"]["content"]
    want = engines.get("target").chat(
        messages, greedy_params(48, ignore_eos=False, structured_outputs=StructuredOutputsParams(json=JSON_SCHEMA)),
        chat_template=CHAT_TEMPLATE, use_tqdm=False)[0].outputs[0].text
    assert content == want
    value = json.loads(content)
    assert set(value) == {"size", "ok"} and value["size"] in (1, 2, 3) and isinstance(value["ok"], bool)


def test_streaming_and_metrics(gsd_server, tiny_models):
    url, _ = gsd_server
    reply = requests.post(f"{url}/v1/completions", timeout=120, stream=True, json={
        "model": tiny_models["target"], "prompt": PROMPTS[0], "max_tokens": 16,
        "temperature": 0.0, "ignore_eos": True, "stream": True})
    chunks = [line for line in reply.iter_lines() if line.startswith(b"data: ") and line != b"data: [DONE]"]
    assert len(chunks) >= 2
    metrics = requests.get(f"{url}/metrics", timeout=30).text
    assert "vllm:spec_decode_num_accepted_tokens" in metrics
    assert "vllm:gsd_trees_verified" in metrics and "vllm:gsd_merges" in metrics


def test_tool_calls_through_the_openai_api(gsd_server, engines, tiny_models):
    """A named tool choice: the arguments are JSON for the tool's parameters schema, written
    under that grammar over trees, the target's own. `tool_choice: required`: the target's call, a given tool's
    name with arguments for its schema."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    url, _ = gsd_server
    messages = [{"role": "user", "content": "set the loop size"}]
    tools = [{"type": "function", "function": {"name": "set_loop", "parameters": JSON_SCHEMA}},
             {"type": "function", "function": {"name": "stop_loop", "parameters": {
                 "type": "object", "additionalProperties": False, "required": ["now"],
                 "properties": {"now": {"type": "boolean"}}}}}]
    named = requests.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": tiny_models["target"], "messages": messages, "max_tokens": 48, "temperature": 0.0,
        "tools": tools, "tool_choice": {"type": "function", "function": {"name": "set_loop"}}})
    assert named.status_code == 200, named.text
    (call,) = named.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "set_loop"
    want = engines.get("target").chat(
        messages, greedy_params(48, ignore_eos=False, structured_outputs=StructuredOutputsParams(json=JSON_SCHEMA)),
        chat_template=CHAT_TEMPLATE, use_tqdm=False)[0].outputs[0].text
    assert call["function"]["arguments"] == want
    arguments = json.loads(want)
    assert set(arguments) == {"size", "ok"} and arguments["size"] in (1, 2, 3)

    # `required` constrains the reply to a JSON list of {"name", "parameters"} objects (one, as
    # parallel_tool_calls is false): vLLM's schema for it, applied to the target alone.
    required = requests.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": tiny_models["target"], "messages": messages, "max_tokens": 64, "temperature": 0.0,
        "tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
    assert required.status_code == 200, required.text
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in required.json()["choices"][0]["message"]["tool_calls"]]
    schema = get_json_schema_from_tools("required", [ChatCompletionToolsParam(**t) for t in tools],
                                        parallel_tool_calls=False)
    want = json.loads(engines.get("target").chat(
        messages, greedy_params(64, ignore_eos=False, structured_outputs=StructuredOutputsParams(json=schema)),
        chat_template=CHAT_TEMPLATE, use_tqdm=False)[0].outputs[0].text)
    assert calls == [(c["name"], c["parameters"]) for c in want] and len(calls) == 1


def test_request_options_over_the_api_are_served_exactly_with_no_fallback(gsd_server, engines, tiny_models):
    """A thinking budget, repetition detection, a penalty and a grammar over the completions
    API: the budgeted request gets the target's own tokens, repetition detection stops the
    request where the target alone stops, and no request is served without speculation (the
    server would log it, once per request, with why)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RepetitionDetectionParams

    url, log_path = gsd_server
    budget = {"model": tiny_models["target"], "prompt": PROMPTS[1], "max_tokens": 24,
              "temperature": 0.0, "ignore_eos": True, "thinking_token_budget": 4}
    replies = [requests.post(f"{url}/v1/completions", timeout=120, json=budget) for _ in range(2)]
    want = engines.get("target").generate(
        [PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, thinking_token_budget=4),
        use_tqdm=False)[0].outputs[0].text
    assert [r.json()["choices"][0]["text"] for r in replies] == [want, want]

    detection = {"max_pattern_size": 4, "min_count": 3}
    body = {"model": tiny_models["target"], "prompt": PROMPTS[1], "max_tokens": 24,
            "temperature": 0.0, "ignore_eos": True, "repetition_detection": detection}
    reply = requests.post(f"{url}/v1/completions", timeout=120, json=body).json()["choices"][0]
    want = engines.get("target").generate(
        [PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                     repetition_detection=RepetitionDetectionParams(**detection)),
        use_tqdm=False)[0].outputs[0]
    assert (reply["text"], reply["finish_reason"]) == (want.text, want.finish_reason)
    assert want.finish_reason == "repetition", "the detection must stop this prompt, or the test cannot fail"
    for option in ({"presence_penalty": 0.5}, {"structured_outputs": {"choice": ["import os", "def f"]}}):
        body = {"model": tiny_models["target"], "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0.0,
                **option}
        assert requests.post(f"{url}/v1/completions", timeout=120, json=body).status_code == 200
    log = log_path.read_text(errors="replace").splitlines()
    assert not [line for line in log if "is served without speculation" in line]


# ------------------------------------------------------------------------------------ load

LOAD_REQUESTS = 320  # all sent at once: more than the server's 256 sequences, some wait
LOAD_PROMPT_LENGTHS = (4, 16, 48, 120, 250)


def test_load_of_mixed_concurrent_requests(request, gsd_server, engines, tokenizer, tiny_models):
    """320 requests at once (mixed prompt lengths up to the context limit, max_tokens 1..32,
    streaming and not, greedy and seeded sampling, clients hanging up mid-stream): every request
    that was not hung up completes, greedy ones exactly as the target alone, seeded ones as in a
    quiet batch, the server stays healthy and frees the aborted ones."""
    url, log_path = gsd_server
    mix = load.build_requests(load.prompt_pool(tokenizer, LOAD_PROMPT_LENGTHS), LOAD_REQUESTS, seed=7)
    before = scrape_metrics(url)
    report = load.run_load(url, tiny_models["target"], mix, concurrency=LOAD_REQUESTS)
    print(f"load: {report.served} served, {report.aborted} aborted, {report.peak_in_flight} in "
          f"flight at most (server running at most {report.server.peak_running}), "
          f"{report.wall_s:.1f} s")

    assert load.problems(mix, report) == []
    assert report.peak_in_flight == LOAD_REQUESTS and report.server.health_checks >= 2
    assert report.server.peak_running > load.MAX_NUM_SEQS // 2
    assert all(r.completed for r in report.results if not r.aborted)
    # Clients hang up after their first chunks; some requests finish before that.
    hung_up = sum(r.disconnects for r in mix)
    assert hung_up // 2 <= report.aborted <= hung_up
    greedy = [(r, x) for r, x in zip(mix, report.results) if r.greedy]
    seeded = [(r, x) for r, x in zip(mix, report.results) if not r.greedy]
    assert load.mismatches(*zip(*greedy), load.references(engines.get("target"), [r for r, _ in greedy])) == []
    # Seeded text is the quiet batch's, except where a draw lands within float32 rounding of a
    # token boundary of the CDF (the 16000-request soak saw two in 5673 seeded: docs/soak/long).
    assert len(load.mismatches(*zip(*seeded), load.references(engines.get("gsd"), [r for r, _ in seeded]))) <= 1

    after = wait_drained(url)
    assert requests.get(f"{url}/health", timeout=10).status_code == 200
    def added(counter):
        return after[f"vllm:gsd_{counter}_total"] - before.get(f"vllm:gsd_{counter}_total", 0)

    if request.node.callspec.params["gsd_server"] == "free_trees":
        assert added("trees_verified") > 0
    else:
        # At 200 running requests the default budget finds that trees do not pay and runs plain
        # steps (the load still goes through the gsd step: it counts them).
        assert added("steps_not_speculated") > 0
    assert after["vllm:request_success_total"] - before.get("vllm:request_success_total", 0) == report.served
    assert "Traceback" not in log_path.read_text(errors="replace")
