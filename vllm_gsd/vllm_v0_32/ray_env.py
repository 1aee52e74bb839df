"""PROMETHEUS_MULTIPROC_DIR reaches vLLM's Ray workers when they start, so that their
`vllm:gsd_*` counters are written where the OpenAI server reads them.

The server shows worker processes' counters through prometheus_client's multiprocess mode: each
process writes its counters into files under PROMETHEUS_MULTIPROC_DIR and the server's
MultiProcessCollector sums them. prometheus_client picks that mode once, when it is imported,
from the process's environment. vLLM 0.32 hands the driver's environment to its Ray workers too
late for that: RayExecutorV2 (the default) applies every driver variable in `initialize_worker`
and the older RayDistributedExecutor copies a list (vllm.ray.ray_env.get_env_vars_to_copy, which
`VLLM_RAY_EXTRA_ENV_VARS_TO_COPY` extends) through `update_environment_variables`, both after the
actor's module, which imports prometheus_client, is loaded. A Ray worker started by a cluster
that does not have the variable itself (`ray start` without it, the usual way to run Ray) then
keeps its counters in its own memory, and /metrics never shows them.

vLLM has one list of variables a Ray worker needs before that import: `_RAY_WORKER_PRE_IMPORT_ENV_VARS`
in vllm/v1/executor/ray_env_utils.py, which `update_runtime_env_for_worker_import` puts into the
actors' Ray runtime_env (set in the worker process when Ray starts it), for both executors.
PROMETHEUS_MULTIPROC_DIR is such a variable; vllm_v0_32/patches.py adds it there.

The directory is the driver node's: workers on other nodes get a path that may not exist there
(engine/metrics.py then does not export), and the server reads the files of its own node only.
GSD exports from tensor-parallel rank 0, which vLLM's Ray executors place on the driver's node
where that node has a worker's device.
"""

from __future__ import annotations

PRE_IMPORT_ENV_VARS = frozenset({"PROMETHEUS_MULTIPROC_DIR"})


def wrap_pre_import_env_vars(original: frozenset[str]) -> frozenset[str]:
    """vLLM's variables a Ray worker needs before it imports vLLM, and PROMETHEUS_MULTIPROC_DIR."""
    return frozenset(original) | PRE_IMPORT_ENV_VARS
