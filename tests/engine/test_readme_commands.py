"""The README's two usage examples, run exactly as written (model paths aside), in vLLM's
default mode: `vllm serve TARGET --speculative-config '...'` and `LLM(TARGET, ...)`.

The commands are read from README.md's "Use" section, so a README edit is what gets tested.
Under vLLM's defaults a float32 checkpoint runs in bf16 on CPU, where vLLM's own greedy output
depends on the batch shape at near-ties (shared/reference/cpu-environment.md): the output is
compared with the target alone under the same defaults, request by request, and may leave it
only at a near-tie of the target's own logprobs (the exactness tests hold float32 to identity).
"""

from __future__ import annotations

import re
import shlex
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest
import requests

from scripts.tools.server import scrape_metrics, server_env, vllm_command, wait_healthy
from vllm_gsd.testing.engines import greedy_params

pytestmark = [pytest.mark.engine, pytest.mark.serve]

README = Path(__file__).resolve().parents[2] / "README.md"
PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Stack:\n    def push(self, x):\n"]
SERVE_PORT = 8000  # vllm serve's default: the README gives none


def readme_block(language: str, containing: str) -> str:
    """The README's fenced `language` block under "## Use" that contains `containing`."""
    use = README.read_text().split("\n## Use", 1)[1].split("\n## ", 1)[0]
    for block in re.findall(rf"```{language}\n(.*?)```", use, flags=re.S):
        if containing in block:
            return block
    raise AssertionError(f"README's Use section has no {language} block with {containing!r}")


def readme_serve_command(target: str, draft: str) -> list[str]:
    words = shlex.split(readme_block("bash", "vllm serve").replace("\\\n", " "))
    assert words[:3] == ["vllm", "serve", "TARGET"], words
    words = [target if w == "TARGET" else w.replace('"DRAFT"', f'"{draft}"') for w in words]
    return vllm_command() + words[1:]


MAX_TOKENS = 32
NEAR_TIE_NATS = 0.25  # the bf16 batch-dependence margins seen on Qwen2.5 were 0.002-0.24


def target_alone(engines, prompt: str):
    """The target under vLLM's defaults, this prompt alone: token ids, and the top-2 logprobs
    at every position."""
    out = engines.get("target_defaults").generate(
        [prompt], greedy_params(MAX_TOKENS, logprobs=2), use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), out.logprobs


def assert_target_up_to_near_ties(got: list[int], want: list[int], want_logprobs) -> None:
    """got == want, or the first difference is the target's runner-up within NEAR_TIE_NATS."""
    assert len(got) == len(want)
    for j, (g, w) in enumerate(zip(got, want)):
        if g != w:
            top = want_logprobs[j]
            assert g in top, f"position {j}: {g} is not among the target's top tokens {list(top)}"
            margin = top[w].logprob - top[g].logprob
            assert margin < NEAR_TIE_NATS, f"position {j}: {g} instead of {w}, margin {margin:.3f} nats"
            return


def test_vllm_serve_as_the_readme_writes_it(engines, tiny_models, tmp_path):
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", SERVE_PORT)) == 0:
            pytest.fail(f"port {SERVE_PORT} (vllm serve's default) is taken; this test needs it free")
    command = readme_serve_command(tiny_models["target"], tiny_models["perturbed"])
    log_path = tmp_path / "server.log"
    url = f"http://127.0.0.1:{SERVE_PORT}"
    with tempfile.TemporaryDirectory(prefix="vllm-gsd-prometheus-") as metrics_dir, open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=server_env(metrics_dir))
        try:
            wait_healthy(url, process, log_path)
            for prompt in PROMPTS:
                reply = requests.post(f"{url}/v1/completions", timeout=120, json={
                    "model": tiny_models["target"], "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
                assert reply.status_code == 200, reply.text
                assert_target_up_to_near_ties(reply.json()["choices"][0]["token_ids"],
                                              *target_alone(engines, prompt))
            metrics = scrape_metrics(url)
            log_text = log_path.read_text(errors="replace")  # before the shutdown's own noise
        finally:
            process.terminate()
            process.wait(timeout=60)
    assert "Traceback" not in log_text
    # vLLM's default mode: compiled, with the profile / warm-up run, and the tree path served.
    assert "Warming up model for the compilation" in log_text
    assert "[draft_model]" in log_text  # the draft is compiled and warmed in the same run
    # If no tree was verified, the cost curves and the adaptive budget's lines say why.
    why = "\n".join(line for line in log_text.splitlines() if "gsd" in line and "Route" not in line)[-6000:]
    assert metrics["vllm:spec_decode_num_drafts_total"] > 0, why
    assert metrics["vllm:gsd_trees_verified_total"] > 0, why


def test_llm_as_the_readme_writes_it(engines, tiny_models):
    from vllm_gsd.engine.metrics import gsd_stats

    scope = {"TARGET": tiny_models["target"], "DRAFT": tiny_models["perturbed"]}
    exec(readme_block("python", "LLM("), scope)  # noqa: S102 - the README's own example
    llm = scope["llm"]
    try:
        params = greedy_params(MAX_TOKENS)
        for prompt in PROMPTS:
            got = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
            assert_target_up_to_near_ties(got, *target_alone(engines, prompt))
        assert gsd_stats(llm).trees_verified > 0
        assert not llm.llm_engine.vllm_config.model_config.enforce_eager
    finally:
        llm.llm_engine.engine_core.shutdown()
