"""A rank-local error in a gsd step stops the engine, instead of hanging it, at tensor parallelism.

vLLM 0.32's multiprocessing executor reads each step's reply from one worker only, its output
rank (tensor-parallel rank 0 of the last pipeline stage: `MultiprocExecutor._get_output_rank`).
Another rank's exception is logged in that rank's process and dropped
(`WorkerProc._execute_worker_rpc`); the rank goes back to wait for the next RPC, while the ranks
that did not fail go on to the step's next collective (the sharded draft's or target's
all-reduce, the trees' agreement check of engine/rank_consistency.py) and wait there for it. On
the CPU, vLLM's shared-memory all-reduce waits by spinning, without a timeout. Measured at tp 2
on the CPU (tiny pair), rank 1's draft forward raising: rank 0 spun at 100% of a core in the
draft's all-reduce and the engine core waited for its reply for VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
(300 s by default), then timed out, naming neither the rank nor the error; and rank 0, deaf to
SIGTERM inside the all-reduce, could outlive the engine, still spinning, until killed.

So gsd's own work in a step (the drafter with its trees: draft_hooks.py; the scoring walk and
the KV compaction: sampling_hooks.py) runs under a try whose handler, where more than one worker
serves the engine, logs the error naming the rank and then
* on the output rank raises `RankFailure` (the original error chained): the executor receives
  it, the engine stops with it, and its shutdown ends the other workers;
* on any other rank ends the worker process at once (os._exit, its logs flushed): vLLM's worker
  monitor sees the process die, shuts the executor down and fails the engine. (A SystemExit would
  run the interpreter's finalization first, which took 15 s to over a minute on a loaded 2-core
  machine beside a peer spinning in the all-reduce; the executor cleans up after dead workers.)
Either way every rank stops and the engine's requests fail (EngineDeadError) within seconds: the
ranks stuck in a collective ignore SIGTERM there, so the executor kills them after its grace
period (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, 5 s, then SIGTERM, then SIGKILL). Measured as
above: rank 1 failing, generate() raised after 9 s; rank 0 failing, at once.

Under Ray (distributed_executor_backend="ray", which in vLLM 0.32 is `RayExecutorV2`) the same
holds by the same two paths. That executor is the multiprocessing one with Ray actors for worker
processes: the same message queues, each step's reply read from the output rank only, so without
this module a rank's error hangs the engine there too (measured: the failing step had not
returned after a minute, when the test's timeout ended it). Its worker monitor waits on every
actor's `run()` call (`ray.wait`), which an actor's process ending (the os._exit above) resolves
at once; the monitor then force-kills every actor (`ray.kill`: no grace period for a rank
spinning in a collective) and fails the engine. Measured at tp 2 on the CPU (tiny pair, the test
platform of tests/engine/test_gsd_ray.py), rank 1's draft forward raising: generate() raised
EngineDeadError 0.2 to 0.8 s after it began (four runs). The rank's message reaches the user
through Ray, which relays an actor's output to its driver (the engine core), prefixed
"(RayWorkerProc pid=...)"; beside it vLLM logs "RayWorkerProc rank=[1] died unexpectedly", and
Ray's raylet that a worker "unexpectedly exits" with guesses at the cause (the OOM killer, a
SIGSEGV) that do not apply: the rank's own line names it. Ray's compiled-graph executor
(VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0) is not tested.

Not under it yet: the verification trees that step_hooks.py builds in `_prepare_inputs` (left to
that file's next change), and vLLM's own work (a rank's target forward running out of memory
hangs a plain vLLM engine the same way).

No agreement between the ranks is needed: a step that succeeds pays for a try block, nothing
else. An agreement point could not do this job: the draft runs sharded like the target, so its
forwards are collectives themselves, and a rank that fails before or inside one (an
out-of-memory error in a layer) leaves the others inside it, before any agreement point.
"""

from __future__ import annotations

import logging
import os
import sys

from vllm_gsd.engine import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)


class RankFailure(RuntimeError):
    """A gsd step failed on one rank of a multi-worker engine (the rank's own error chained)."""


def stop_on_rank_failure(runner, work: str, error: Exception) -> None:
    """Called from an `except` block around gsd's `work` on `runner`'s worker: re-raise `error`
    where this worker is the engine's only one; otherwise stop the engine as the module says."""
    parallel = runner.parallel_config
    if parallel.world_size == 1:
        raise error
    from vllm.distributed import get_pp_group, get_tp_group
    from vllm.distributed.parallel_state import get_pcp_group

    tp_rank = get_tp_group().rank_in_group
    message = (f"gsd: tensor-parallel rank {tp_rank} failed in its {work}: {type(error).__name__}: {error}; "
               "the engine stops (the other ranks would wait for this one in their next collective)")
    logger.error(message, exc_info=error)
    output_rank = (tp_rank == 0 and get_pp_group().is_last_rank
                   and (parallel.prefill_context_parallel_size == 1 or get_pcp_group().rank_in_group == 0))
    if output_rank:
        raise RankFailure(message) from error
    _flush_logs()
    os._exit(1)


def _flush_logs() -> None:
    for handler in [*logging.getLogger().handlers, *logger.handlers, *logging.getLogger("vllm").handlers]:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
