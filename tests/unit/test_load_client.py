"""The load client (scripts.tools.load) against a small ASGI server run by uvicorn, as vLLM's is.

A load test must fail for the server's faults only: these check that the client never sends on a
connection the server's keep-alive has closed, and that each health probe has its own connection.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest
import uvicorn

from scripts.tools import load
from scripts.tools.server import free_port


class FakeCompletionsServer:
    """/v1/completions answers one token; /health answers `health_status`; every request's path
    and client port (one port per TCP connection) are recorded."""

    def __init__(self, health_status: int = 200):
        self.health_status = health_status
        self.seen: list[tuple[str, int]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body", False):
            pass
        self.seen.append((scope["path"], scope["client"][1]))
        status, body, kind = 200, b"vllm:num_requests_running 0\n", b"text/plain"
        if scope["path"] == "/health":
            status, body = self.health_status, b""
        elif scope["path"] == "/v1/completions":
            choice = {"text": "a", "token_ids": [1], "finish_reason": "length"}
            body, kind = json.dumps({"choices": [choice]}).encode(), b"application/json"
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]})
        await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def running(app, keep_alive_s: int):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                           timeout_keep_alive=keep_alive_s))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _requests(count: int) -> list[load.LoadRequest]:
    return [load.LoadRequest(index=i, prompt_token_ids=(5, 6, 7), max_tokens=1, stream=False)
            for i in range(count)]


def test_no_request_on_a_connection_the_server_timed_out():
    """The client's loop is busy (here: blocked) while the server's keep-alive ends: the next
    POST must go on a new connection, not the one the server closed."""
    keep_alive_s = 2
    assert load.CLIENT_KEEPALIVE_S < keep_alive_s
    app = FakeCompletionsServer()

    def busy_client(result):
        time.sleep(keep_alive_s + 0.5)

    with running(app, keep_alive_s) as url:
        report = load.run_load(url, "m", _requests(2), concurrency=1, on_done=busy_client)
    assert load.problems(_requests(2), report) == []
    assert report.served == 2


def test_health_probes_each_on_their_own_connection():
    app = FakeCompletionsServer()
    with running(app, keep_alive_s=5) as url:
        report = load.run_load(url, "m", _requests(40), concurrency=4, health_interval_s=0.01)
    assert report.served == 40 and report.server.health_failures == []
    probe_ports = [port for path, port in app.seen if path in ("/health", "/metrics")]
    load_ports = {port for path, port in app.seen if path == "/v1/completions"}
    assert len(probe_ports) >= 2 and len(set(probe_ports)) == len(probe_ports)
    assert not load_ports & set(probe_ports)
    assert len(load_ports) <= 4  # the load itself keeps its connections alive


@pytest.mark.parametrize("status", [500, 503])
def test_failing_health_is_reported(status):
    app = FakeCompletionsServer(health_status=status)
    with running(app, keep_alive_s=5) as url:
        report = load.run_load(url, "m", _requests(3), concurrency=1, health_interval_s=0.01)
    assert report.server.health_failures
    assert all(f.startswith(f"/health {status} at check") for f in report.server.health_failures)
    assert load.problems(_requests(3), report)[-1].startswith(f"server: /health {status}")
