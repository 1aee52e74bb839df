"""Ray: gsd through vLLM's own Ray executor (RayExecutorV2, Ray actors as workers) on CPU, and
a rank whose drafter fails stopping the engine there as under multiprocessing.

vLLM's CPU platform declares no Ray device key, so on CPU vLLM refuses Ray ("current platform
cpu does not support ray."). The test-only platform plugin in tests/ray_cpu_platform (installed
by scripts/setup.sh, inert unless GSD_TEST_RAY_CPU=1) gives the CPU platform the key "GPU": a
Ray "GPU" is then a logical scheduling slot for one CPU worker (`ray.init(num_gpus=...)`
declares them; nothing probes for a device). Everything else is vLLM's and Ray's own code:
placement group, actors, plugin loading in the actors, gloo TP groups, the message queues.

Ray runs in this process on loopback only (Ray otherwise advertises the machine's outward
address), with no dashboard; the variables are set before `ray.init` so that the raylet, and
through it every Ray worker, inherits them, and the engine core (a spawned child) connects
to this cluster through RAY_ADDRESS.
"""

from __future__ import annotations

import os
import time
from importlib.metadata import entry_points

import pytest

from vllm_gsd.testing.engines import default_gsd_config, greedy_token_ids, gsd_config, make_llm, token_prompts
from vllm_gsd.testing.worker_probes import INJECTED_DRAFT_FAILURE, WORKER_PROBES, tree_counts_per_rank

pytestmark = pytest.mark.engine

TEXTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Queue:\n    def push(self, x):\n",
         "for i in range(10):\n"]
MAX_TOKENS = 40
# One Ray "GPU" slot per worker of every engine this module starts (tp 1, then tp 2), so the
# second engine never waits for Ray to release the first one's placement group.
RAY_WORKER_SLOTS = 3
RAY_ENV = {
    "GSD_TEST_RAY_CPU": "1",  # tests/ray_cpu_platform: the CPU platform with a Ray device key
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray's processes: node address = 127.0.0.1
    "RAY_USAGE_STATS_ENABLED": "0",
}


def test_test_platform_is_inert_without_its_variable():
    """The test plugin is installed in the test venv: this process (no GSD_TEST_RAY_CPU yet)
    got vLLM's own CPU platform, with no Ray device key; a process with the variable gets the
    test platform."""
    import subprocess
    import sys

    from vllm.platforms import current_platform

    assert "GSD_TEST_RAY_CPU" not in os.environ, "unset GSD_TEST_RAY_CPU to run the tests"
    assert (type(current_platform).__qualname__, current_platform.ray_device_key) == ("CpuPlatform", "")
    probe = ("from vllm.platforms import current_platform as p; "
             "print(type(p).__qualname__, repr(p.ray_device_key))")
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "GSD_TEST_RAY_CPU": "1"},
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip().splitlines()[-1] == "RayCpuPlatform 'GPU'"


@pytest.fixture(scope="module")
def ray_cluster():
    plugins = {ep.name for ep in entry_points(group="vllm.platform_plugins")}
    assert "gsd_test_ray_cpu" in plugins, (
        "the test-only platform plugin tests/ray_cpu_platform is not installed; run scripts/setup.sh")
    with pytest.MonkeyPatch.context() as patch:
        for key, value in RAY_ENV.items():
            patch.setenv(key, value)
        import ray
        import ray._private.ray_constants as ray_constants

        # This process may have imported Ray before the variable was set (vLLM imports it).
        patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        context = ray.init(num_cpus=1, num_gpus=RAY_WORKER_SLOTS, include_dashboard=False,
                           object_store_memory=128 * 1024**2)
        try:
            address = context.address_info["address"]
            assert address.startswith("127.0.0.1:"), address
            patch.setenv("RAY_ADDRESS", address)
            yield ray
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return token_prompts(tokenizer, TEXTS)


@pytest.fixture(scope="module")
def target_outputs(engines, prompts):
    """The target alone (multiprocessing executor), started before Ray's variables are set."""
    return greedy_token_ids(engines.get("target"), prompts, MAX_TOKENS)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("tp", [1, 2])
def test_ray_executor_gsd_equals_target(target_outputs, ray_cluster, tiny_models, prompts, tp):
    """tp 1 with trees on every step (the tests' free cost curves), tp 2 with GSD's default
    knobs and CPU-like cost curves (the adaptive budget deciding on every rank)."""
    speculative_config = (gsd_config(tiny_models["perturbed"]) if tp == 1
                          else default_gsd_config(tiny_models["perturbed"]))
    llm = make_llm(tiny_models["target"], speculative_config, tensor_parallel_size=tp,
                   distributed_executor_backend="ray", worker_extension_cls=WORKER_PROBES)
    try:
        assert greedy_token_ids(llm, prompts, MAX_TOKENS) == target_outputs
        workers = llm.collective_rpc("gsd_test_worker_info")
        counts = tree_counts_per_rank(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()

    # Each worker is a Ray actor that vLLM's executor created, on the test platform, with the
    # plugin loaded and the gsd drafter built from the gsd config it received.
    assert sorted(w["tp_rank"] for w in workers) == list(range(tp))
    assert len({w["ray_actor_id"] for w in workers}) == tp and None not in {w["ray_actor_id"] for w in workers}
    assert len({w["pid"] for w in workers} | {os.getpid()}) == tp + 1
    for w in workers:
        assert (w["platform"], w["plugin_registered"], w["method"], w["drafter"]) == (
            "RayCpuPlatform", True, "gsd", "GsdProposer"), w
        # One rank runs the draft's LM head from its int8 copy; split across ranks, as loaded.
        assert w["draft_head"] == ("Int8DraftHead" if tp == 1 else "method"), w
    # GSD verified trees in every Ray worker, and every rank built and verified the same trees
    # (the timing figures differ per rank, the counts must not).
    assert counts[0]["trees_verified"] > 0
    assert all(c == counts[0] for c in counts), counts


# A hang fails here: without runner/rank_failure.py the engine waits for rank 0's reply for
# VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 s); the limit covers the engine's start on Ray.
@pytest.mark.timeout(240)
def test_ray_rank_whose_drafter_fails_stops_the_engine(ray_cluster, tiny_models, prompts, capfd):
    """Rank 1's draft forward raises (out of memory) before the draft's all-reduce: Ray's
    executor, like the multiprocessing one, hears only rank 0. Rank 1 names itself and the error
    and ends its actor's process; the executor's worker monitor sees the actor die, kills the
    other actors and fails the engine within seconds."""
    from vllm.v1.engine.exceptions import EngineDeadError

    llm = make_llm(tiny_models["target"], gsd_config(tiny_models["perturbed"]), tensor_parallel_size=2,
                   distributed_executor_backend="ray", worker_extension_cls=WORKER_PROBES)
    named = ("gsd: tensor-parallel rank 1 failed in its drafter: OutOfMemoryError: "
             f"{INJECTED_DRAFT_FAILURE} (tensor-parallel rank 1)")
    try:
        assert llm.collective_rpc("gsd_test_fail_draft", args=(1,)) == [False, True]
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            greedy_token_ids(llm, prompts[:1], 8)  # trees on every step: the first step drafts
        assert time.monotonic() - started < 30
        # Ray relays an actor's output to its driver (the engine core) a moment after it is written.
        deadline = time.monotonic() + 10
        logs = ""
        while named not in logs and time.monotonic() < deadline:
            time.sleep(0.5)
            captured = capfd.readouterr()
            logs += captured.out + captured.err
    finally:
        llm.llm_engine.engine_core.shutdown()
    captured = capfd.readouterr()
    logs += captured.out + captured.err
    assert named in logs
    # vLLM's executor names the dead rank too: its monitor saw the actor die; no timeout ran.
    assert "RayWorkerProc rank=[1] died unexpectedly" in logs
