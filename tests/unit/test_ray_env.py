"""The vllm:gsd_* counters of a Ray worker reach the server's /metrics (vllm_v0_32/ray_env.py)."""

from __future__ import annotations

import os
import subprocess
import sys

VAR = "PROMETHEUS_MULTIPROC_DIR"

# A worker process that gets the directory when it starts ("start", what a Ray runtime_env
# gives), after importing what vLLM's Ray actor imports ("late", what vLLM's executors give:
# RayWorkerProc's module is loaded, then initialize_worker / update_environment_variables), or
# a directory that does not exist on its node ("elsewhere"); then it exports as GSD's rank 0 does.
WORKER = """
import os, sys
mode, directory = sys.argv[1], sys.argv[2]
if mode == "late":
    import vllm.v1.executor.ray_executor_v2
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
from vllm_gsd.engine.metrics import GsdMetrics
metrics = GsdMetrics(exports=True)
metrics.add(trees_verified=5)
metrics.step_done()
print("TREES", metrics.stats.trees_verified)
"""


def _run_worker(mode: str, directory: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != VAR}
    if mode == "start":
        env[VAR] = directory
    elif mode == "elsewhere":
        env[VAR] = os.path.join(directory, "not-on-this-node")
    done = subprocess.run([sys.executable, "-c", WORKER, mode, directory], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _collected(directory: str) -> float:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=directory)
    return registry.get_sample_value("vllm:gsd_trees_verified_total") or 0.0


def test_the_ray_runtime_env_carries_the_prometheus_directory(monkeypatch):
    """With the patch, vLLM's own function that builds its Ray actors' runtime_env (both Ray
    executors call it) gives them the directory, beside the variables vLLM puts there itself."""
    from vllm.v1.executor import ray_env_utils

    from vllm_gsd.vllm_v0_32.ray_env import wrap_pre_import_env_vars

    monkeypatch.setattr(ray_env_utils, "_RAY_WORKER_PRE_IMPORT_ENV_VARS",
                        wrap_pre_import_env_vars(ray_env_utils._RAY_WORKER_PRE_IMPORT_ENV_VARS))
    monkeypatch.setenv(VAR, "/tmp/gsd-metrics")
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    runtime_env = ray_env_utils.update_runtime_env_for_worker_import({"env_vars": {"OTHER": "x"}})
    assert runtime_env["env_vars"] == {"OTHER": "x", VAR: "/tmp/gsd-metrics", "VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}


def test_a_worker_exports_only_with_the_directory_from_its_start(tmp_path):
    """Why the directory must be in the runtime_env: prometheus_client picks its multiprocess
    mode when imported. A worker that has the directory from its start writes counters the
    server's collector reads; one that gets it after importing vLLM's actor module (as vLLM's
    executors hand it over) keeps them in its own memory."""
    directory = str(tmp_path)
    assert "TREES 5" in _run_worker("start", directory)
    assert _collected(directory) == 5
    assert "TREES 5" in _run_worker("late", directory)
    assert _collected(directory) == 5


def test_a_worker_whose_node_lacks_the_directory_keeps_serving(tmp_path):
    """A worker on another node than the server gets the driver's path, which may not exist
    there: its counters are not exported (prometheus_client would fail writing them), its
    figures are kept."""
    assert "TREES 5" in _run_worker("elsewhere", str(tmp_path))
    assert _collected(str(tmp_path)) == 0


def test_the_plugin_declares_the_ray_env_patch():
    from vllm_gsd.plugin import register

    register()
    from vllm.v1.executor import ray_env_utils

    assert "PROMETHEUS_MULTIPROC_DIR" in ray_env_utils._RAY_WORKER_PRE_IMPORT_ENV_VARS
