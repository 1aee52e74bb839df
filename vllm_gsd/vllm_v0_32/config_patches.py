"""What the patches declared in vllm_v0_32/patches.py do, except the model runner's hooks
(vllm_v0_32/runner/) and the scheduler's (vllm_v0_32/scheduler_hooks.py).

* Config scope, applied when the plugin loads in a process: "method": "gsd" and the `gsd` block
  in vLLM's speculative config (the schema widening and the post-init wrappers), the refusal by
  name of what the tree path cannot run (CUDA graphs: vllm_v0_32/cuda_graphs.py, checked again
  after vLLM's post-init), the attention backend, the KV slots past the tree,
  min_p / logit_bias requests, and the hand-over to the engine and worker scopes. Each acts only
  on a config that asks for gsd.
* Engine scope, applied where a gsd engine's config is built and by a gsd worker: the kernel
  scan that numba's llvmlite trips (see `wrap_rebind_kernels`).
* Worker scope, applied by a gsd worker: the load of the compiled models vLLM saved (CPU), the
  graph-attention backends, the `gsd_stats` worker method.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Literal, get_args

from vllm_gsd.engine.config import GSD_METHOD, GsdConfig, finalize_gsd_speculative_config, is_gsd
from vllm_gsd.vllm_v0_32 import registry
from vllm_gsd.vllm_v0_32.cuda_graphs import refuse_after_post_init, refuse_full_graphs_for_trees

# ---------------------------------------------------------------------------------------------
# Config scope
# ---------------------------------------------------------------------------------------------


def add_gsd_to_speculative_schema(spec_cls: type) -> None:
    """Widen `method` with "gsd" and add the `gsd: GsdConfig | None` field, then rebuild.

    vLLM's config classes are pydantic dataclasses with extra="forbid"; their schema is compiled
    at class creation, so the dataclass fields themselves are changed and the schema rebuilt.
    """
    from pydantic.dataclasses import rebuild_dataclass

    fields = spec_cls.__dataclass_fields__
    method_field = fields["method"]
    if GSD_METHOD not in _literal_values(method_field.type):
        method_field.type = method_field.type | Literal["gsd"]  # type: ignore[operator]
        spec_cls.__annotations__["method"] = method_field.type
    if "gsd" not in fields:
        gsd_field = dataclasses.field(default=None)
        gsd_field.name, gsd_field.type = "gsd", GsdConfig | None
        gsd_field._field_type = dataclasses._FIELD  # type: ignore[attr-defined]
        fields["gsd"] = gsd_field
        spec_cls.__annotations__["gsd"] = GsdConfig | None
        spec_cls.gsd = None
    rebuild_dataclass(spec_cls, force=True)


def _literal_values(annotation: Any) -> set[Any]:
    values: set[Any] = set()
    for arg in get_args(annotation):
        values |= _literal_values(arg) if get_args(arg) else {arg}
    return values


def wrap_speculative_post_init(original):
    """Run vLLM's draft-model setup for "gsd", then validate what is specific to GSD.

    vLLM raises NotImplementedError for a model-based method it does not know, so the original
    runs with method "draft_model" (building draft_model_config, draft_parallel_config, the draft
    TP check and the max_model_len clamp) and "gsd" is restored after it.
    """

    @functools.wraps(original)
    def __post_init__(self):
        if self.method != GSD_METHOD:
            if getattr(self, "gsd", None) is not None:
                raise ValueError(
                    "speculative_config.gsd is only valid with method 'gsd', "
                    f"got method {self.method!r}"
                )
            return original(self)
        if self.model is None:
            raise ValueError(
                "speculative_config.model (the draft model) is required for method 'gsd'"
            )
        self.method = "draft_model"
        try:
            original(self)
        except ValueError as exc:
            # vLLM names the path it could not load (missing, not a model), not the field.
            if str(self.model) in str(exc) and "speculative_config.model" not in str(exc):
                raise ValueError(
                    f"speculative_config.model: the draft {self.model!r} cannot be loaded: {exc}"
                ) from exc
            raise
        finally:
            self.method = GSD_METHOD
        finalize_gsd_speculative_config(self)

    return __post_init__


def wrap_v2_unsupported(original):
    @functools.wraps(original)
    def _get_v2_model_runner_unsupported_features(self):
        unsupported = original(self)
        if is_gsd(self.speculative_config):
            unsupported.append("speculative method 'gsd'")
        return unsupported

    return _get_v2_model_runner_unsupported_features


def wrap_vllm_config_post_init(original):
    """Refuse, by name, the settings the GSD path cannot run under; settle the rest for gsd."""

    @functools.wraps(original)
    def __post_init__(self):
        if is_gsd(self.speculative_config):
            from vllm import envs

            if self.scheduler_config.async_scheduling:
                raise ValueError(
                    "async_scheduling=True is not supported with speculative method 'gsd' "
                    "(the verification tree is built on the host between steps); "
                    "leave async_scheduling unset or pass --no-async-scheduling"
                )
            if envs.VLLM_USE_V2_MODEL_RUNNER:
                raise ValueError(
                    "VLLM_USE_V2_MODEL_RUNNER=1 is not supported with speculative method 'gsd': "
                    "GSD runs on the V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER"
                )
            if self.parallel_config.pipeline_parallel_size > 1:
                raise ValueError(
                    "pipeline_parallel_size > 1 is not supported with speculative method 'gsd'"
                )
            _refuse_unsupported_features(self)
            _select_gsd_attention(self)
            _keep_the_targets_compile_key(self.parallel_config)
            registry.apply("engine")
        original(self)
        if is_gsd(self.speculative_config):
            from vllm.platforms import current_platform

            if current_platform.is_cuda():
                # vLLM's post-init can turn PIECEWISE into FULL (fuse_attn_quant): checked again.
                refuse_after_post_init(self)

    return __post_init__


def wrap_num_lookahead_tokens(original: property) -> property:
    """KV slots past the target's query that the drafter writes: its graph rows reach
    root_pos + N, and the root itself can sit one past the verified tree."""

    def num_lookahead_tokens(self) -> int:
        if is_gsd(self.speculative_config):
            return self.speculative_config.num_speculative_tokens + 1
        return original.fget(self)

    return property(num_lookahead_tokens, doc=original.__doc__)


def _keep_the_targets_compile_key(parallel_config) -> None:
    """Let gsd load the target that a plain or draft_model engine compiled, and vice versa.

    vLLM turns async scheduling off for gsd and, following it, sets
    disable_nccl_for_dp_synchronization=False where async scheduling would have set True. The
    flag is a factor of the compile-cache key but acts only in data-parallel synchronization, so
    with one data-parallel rank it is set as under vLLM's defaults: the target's key then differs
    from a draft_model engine's by nothing, and a first start loads the compiled model instead of
    compiling it again (about a minute of a 2-core start). A value the user set is kept.
    """
    if (parallel_config.data_parallel_size == 1
            and parallel_config.disable_nccl_for_dp_synchronization is None):
        parallel_config.disable_nccl_for_dp_synchronization = True


def _refuse_unsupported_features(vllm_config) -> None:
    """What the tree path cannot honour, refused by name before anything is built."""
    from vllm.utils.torch_utils import is_quantized_kv_cache

    spec = vllm_config.speculative_config
    refusals = []
    for role, model_config in (("target", vllm_config.model_config), ("draft", spec.draft_model_config)):
        if model_config is not None and model_config.uses_mrope:
            refusals.append(f"the {role} model's M-RoPE positions (multimodal rotary embedding): "
                            "tree rows are re-rotated through 1-D positions only")
    if is_quantized_kv_cache(vllm_config.cache_config.cache_dtype):
        refusals.append(f"kv_cache_dtype={vllm_config.cache_config.cache_dtype!r}: the graph mask "
                        "reads the cache unquantized; use kv_cache_dtype='auto'")
    if vllm_config.kv_transfer_config is not None:
        refusals.append("a KV connector (kv_transfer_config): it would save the verification tree's "
                        "KV layout before GSD compacts the accepted path")
    if vllm_config.model_config.logits_processors:
        refusals.append("custom logits processors (logits_processors): they act on whole batches of "
                        "rows that a verification tree lays out per node, as vLLM's own speculative "
                        "methods refuse them; serve them from an engine without speculation")
    if getattr(vllm_config.model_config, "rswa_window", None) is not None:
        refusals.append("the target model's R-SWA attention (rswa_window): the graph mask of tree "
                        "rows does not implement it")
    if vllm_config.parallel_config.decode_context_parallel_size > 1:
        refusals.append("decode context parallelism (decode_context_parallel_size > 1): the graph "
                        "mask reads each tree's whole KV on one rank")
    if vllm_config.cache_config.kv_offloading_size:
        refusals.append("KV offloading (kv_offloading_size): it would save the verification tree's "
                        "KV layout before GSD compacts the accepted path")
    if refusals:
        raise ValueError("speculative method 'gsd' does not support " + "; ".join(refusals))


def _select_gsd_attention(vllm_config) -> None:
    """The graph mask exists in two backends: CPU_ATTN (CPU) and TRITON_ATTN (CUDA)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if current_platform.is_cpu():
        return
    if not current_platform.is_cuda():
        raise ValueError(
            f"speculative method 'gsd' runs on CPU and CUDA only, not on {current_platform.device_name}"
        )
    triton = AttentionBackendEnum.TRITON_ATTN
    chosen = vllm_config.attention_config.backend
    if chosen not in (None, triton):
        raise ValueError(
            f"attention_config.backend={chosen.name} is not supported with speculative method "
            "'gsd' on CUDA: the graph mask lives in TRITON_ATTN; leave the backend unset"
        )
    vllm_config.attention_config.backend = triton
    vllm_config.speculative_config.attention_backend = triton
    refuse_full_graphs_for_trees(vllm_config.compilation_config)


def wrap_validate_spec_decode(original):
    """min_p and logit_bias requests are served under gsd: a gsd engine builds vLLM's logits
    processors for them (runner/setup_hooks.wrap_build_logitsprocs) and verifies them without a tree
    (engine/eligibility.py), so they need not be refused as vLLM does for linear drafts."""

    @functools.wraps(original)
    def _validate_spec_decode(self, speculative_config):
        if is_gsd(speculative_config):
            return None
        return original(self, speculative_config)

    return _validate_spec_decode


def wrap_worker_init(original):
    """Apply the engine- and worker-scope patches in a gsd worker's process, before its model
    runner exists."""

    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        if is_gsd(vllm_config.speculative_config):
            registry.apply("engine")
            registry.apply("worker")
        return original(self, vllm_config, *args, **kwargs)

    return __init__


def wrap_rebind_kernels(original):
    """Leave llvmlite's modules out of vLLM's scan for holders of the Triton kernels that the
    CPU platform replaces.

    The scan reads `vars(obj)` of every object in every loaded module. llvmlite's library
    object (`llvmlite.binding.ffi.lib`, loaded with numba, which compiles the graph core) answers
    any attribute it lacks, `__dict__` included, with a function wrapper, and the scan fails on
    it ("'_lib_fn_wrapper' object has no attribute 'get'"), so no worker starts. No llvmlite
    module holds a vLLM kernel.

    Where and when: the CPU platform (without Triton-CPU) runs the scan in
    `WorkerWrapperBase.init_worker`, in the process that hosts a worker, just after that call
    loads the plugins and before the worker exists (so before any worker-scope patch). It fails
    wherever llvmlite is loaded then. Loading the plugin loads no numba (engine/config.py imports
    the graph core only where a drafter is built), and on a CPU vLLM spawns its engine core and
    workers (fresh interpreters), so a spawned scan never meets llvmlite, gsd or not. It does in
    a process that already ran gsd code in itself: with VLLM_ENABLE_V1_MULTIPROCESSING=0 the
    engine core and the worker run in the caller's process, and after a gsd engine there (its
    drafter loaded numba) the next engine's scan, plain or gsd, fails. Hence engine scope: the
    wrapper is applied where a gsd engine's config is built (before its first scan in that
    process) and by every gsd worker, and a process that never asks for gsd keeps vLLM's scan.
    """

    @functools.wraps(original)
    def _rebind_kernels(overrides):
        hidden = {name: module for name, module in sys.modules.items()
                  if name == "llvmlite" or name.startswith("llvmlite.")}
        for name in hidden:
            del sys.modules[name]
        try:
            return original(overrides)
        finally:
            sys.modules.update(hidden)

    return _rebind_kernels


# ---------------------------------------------------------------------------------------------
# Worker scope (the model runner's hooks are in vllm_v0_32/runner/)
# ---------------------------------------------------------------------------------------------


def add_noop_finalize_loading(bundled_callable_cls: type) -> None:
    """Let vLLM load the compiled models it saved when the compiled function is inductor's own.

    vLLM 0.32 saves every compiled model (VLLM_USE_AOT_COMPILE, on by default with torch >=
    2.10) and on a later start loads it and calls `compiled_fn.finalize_loading(vllm_config)`,
    a method of its own `VllmSerializableFunction` (which builds vLLM's piecewise backend). The
    CPU build compiles in DYNAMO_TRACE_ONCE mode with inductor as the backend, so the saved
    function is torch's `BundledAOTAutogradSerializableCallable`, which has no such method: the
    load fails ("'function' object has no attribute 'finalize_loading'") and every start compiles
    again (about 70-90 s for a 1.5B model on 2 cores). Inductor's callable is complete once
    deserialized, so there is nothing to finalize.

    The load runs in the process that hosts the worker (the engine core under the CPU's
    one-process executor, each worker process otherwise), in `load_model`, after the worker is
    constructed: a worker-scope patch, so only a gsd worker's process gets it. An engine
    without gsd loads and compiles as vLLM alone does.
    """
    if "finalize_loading" not in vars(bundled_callable_cls):
        bundled_callable_cls.finalize_loading = _nothing_to_finalize


def _nothing_to_finalize(self, vllm_config) -> None:
    return None


def install_graph_attention(backend_enum) -> None:
    from vllm.v1.attention.backends.registry import register_backend

    backends = "vllm_gsd.vllm_v0_32.attention."
    register_backend(backend_enum.CPU_ATTN, backends + "cpu_backend.GsdCpuAttentionBackend")
    register_backend(backend_enum.TRITON_ATTN, backends + "triton_backend.GsdTritonAttentionBackend")


def add_gsd_stats_method(worker_cls) -> None:
    from vllm_gsd.engine.metrics import worker_gsd_stats

    worker_cls.gsd_stats = worker_gsd_stats
