"""The soak's own tools: the memory fit it passes or fails on, and the allocator it preloads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scripts.tools.memory import RssSample, growth_per_1k
from scripts.tools.server import jemalloc_library, server_env


def samples(points: list[tuple[int, float]]) -> list[RssSample]:
    return [RssSample(float(i), done, {"worker[1]": int(mib * 2**20)}) for i, (done, mib) in enumerate(points)]


def test_growth_fit_reads_a_leak_and_ignores_the_warm_up():
    warm_up = [(done, 1000 + 0.3 * done) for done in range(0, 1000, 100)]  # 300 MiB while warming up
    flat = [(done, 1300.0) for done in range(1000, 4000, 100)]
    assert growth_per_1k(samples(warm_up + flat), skip_requests=1000) == pytest.approx(0.0, abs=1e-9)
    assert growth_per_1k(samples(warm_up + flat), skip_requests=0) > 5.0  # the warm-up would fail it
    leak = [(done, 1300 + 0.012 * (done - 1000)) for done in range(1000, 4000, 100)]  # 12 MiB / 1000
    assert growth_per_1k(samples(warm_up + leak), skip_requests=1000) == pytest.approx(12.0, rel=1e-6)
    with pytest.raises(ValueError, match="two or more progress points"):
        growth_per_1k(samples([(10, 1.0), (10, 2.0)]), skip_requests=0)


def test_the_preload_is_put_first_in_ld_preload(monkeypatch):
    path = jemalloc_library()
    monkeypatch.setenv("LD_PRELOAD", "/lib/other.so")
    env = server_env("/tmp/metrics", preload=path)
    assert env["LD_PRELOAD"] == f"{path}:/lib/other.so"
    assert env["PROMETHEUS_MULTIPROC_DIR"] == "/tmp/metrics"
    monkeypatch.delenv("LD_PRELOAD")
    assert server_env("/tmp/metrics", preload=path)["LD_PRELOAD"] == path
    assert "LD_PRELOAD" not in server_env("/tmp/metrics")


def test_a_process_started_with_the_preload_allocates_with_jemalloc(monkeypatch):
    """jemalloc from the ray wheel can only be preloaded (dlopen-ing it later fails on its static
    TLS), so check in a child started with the server's environment: malloc resolves to jemalloc's
    library, which exports jemalloc's control call."""
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    script = ("import ctypes; libc = ctypes.CDLL(None); "
              "info = open('/proc/self/maps').read(); "
              "print('mallctl' if hasattr(libc, 'mallctl') else 'none', 'libjemalloc.so' in info)")
    out = subprocess.run([sys.executable, "-c", script], env=server_env("/tmp/metrics", preload=jemalloc_library()),
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["mallctl", "True"]
    plain = subprocess.run([sys.executable, "-c", script], env=server_env("/tmp/metrics"),
                           capture_output=True, text=True, check=True).stdout.split()
    assert plain == ["none", "False"]
