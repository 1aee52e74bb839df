"""Every change vllm-gsd makes to vLLM 0.32.0, declared in one list.

Read this file to know the whole surface we touch. The mechanism (version gate, target
resolution, idempotence) is in engine/registry.py; the behaviour each patch installs lives in the
module named beside it.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Literal, get_args

from vllm_gsd.engine import registry, runner_hooks
from vllm_gsd.engine.config import GSD_METHOD, GsdConfig, finalize_gsd_speculative_config, is_gsd
from vllm_gsd.engine.registry import Patch, Uses

# ---------------------------------------------------------------------------------------------
# Config layer (every process)
# ---------------------------------------------------------------------------------------------


def _add_gsd_to_speculative_schema(spec_cls: type) -> None:
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


def _wrap_speculative_post_init(original):
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


def _wrap_v2_unsupported(original):
    @functools.wraps(original)
    def _get_v2_model_runner_unsupported_features(self):
        unsupported = original(self)
        if is_gsd(self.speculative_config):
            unsupported.append("speculative method 'gsd'")
        return unsupported

    return _get_v2_model_runner_unsupported_features


def _wrap_vllm_config_post_init(original):
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
        return original(self)

    return __post_init__


def _wrap_num_lookahead_tokens(original: property) -> property:
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
    if vllm_config.cache_config.kv_offloading_size:
        refusals.append("KV offloading (kv_offloading_size): it would save the verification tree's "
                        "KV layout before GSD compacts the accepted path")
    if refusals:
        raise ValueError("speculative method 'gsd' does not support " + "; ".join(refusals))


def _select_gsd_attention(vllm_config) -> None:
    """The graph mask exists in two backends: CPU_ATTN (CPU) and TRITON_ATTN (CUDA)."""
    from vllm.config.compilation import CUDAGraphMode
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
    _keep_attention_out_of_cuda_graphs(vllm_config.compilation_config)


def _keep_attention_out_of_cuda_graphs(compilation) -> None:
    """CUDA: attention of tree rows must run eagerly, between captured pieces."""
    from vllm.config.compilation import CUDAGraphMode

    if compilation.cudagraph_mode is None:
        # The mask changes every step: attention must run outside captured graphs.
        compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
    elif compilation.cudagraph_mode.has_full_cudagraphs():
        # A full graph is captured with the causal kernel for uniform batches (1 + N tokens per
        # request) and replayed without the graph mask: tree rows would see their siblings.
        raise ValueError(
            f"compilation_config.cudagraph_mode={compilation.cudagraph_mode.name} is not supported "
            "with speculative method 'gsd': attention of tree rows runs outside captured graphs; "
            "use PIECEWISE or NONE, or leave cudagraph_mode unset")


def _wrap_validate_spec_decode(original):
    """min_p and logit_bias requests are served under gsd: a gsd engine builds vLLM's logits
    processors for them (runner_hooks.wrap_build_logitsprocs) and verifies them without a tree
    (engine/eligibility.py), so they need not be refused as vLLM does for linear drafts."""

    @functools.wraps(original)
    def _validate_spec_decode(self, speculative_config):
        if is_gsd(speculative_config):
            return None
        return original(self, speculative_config)

    return _validate_spec_decode


def _wrap_worker_init(original):
    """Apply the worker-scope patches in the worker process, before its model runner exists."""

    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        if is_gsd(vllm_config.speculative_config):
            registry.apply("worker")
        return original(self, vllm_config, *args, **kwargs)

    return __init__


def _wrap_rebind_kernels(original):
    """Leave llvmlite's modules out of vLLM's scan for holders of the Triton kernels that the
    CPU platform replaces.

    The scan reads `vars(obj)` of every object in every loaded module. llvmlite's library
    object (`llvmlite.binding.ffi.lib`, loaded with numba, which compiles the graph core) answers
    any attribute it lacks, `__dict__` included, with a function wrapper, and the scan fails on
    it ("'_lib_fn_wrapper' object has no attribute 'get'"), so no worker starts. No llvmlite
    module holds a vLLM kernel.

    Where and when: the CPU platform (without Triton-CPU) runs the scan in
    `WorkerWrapperBase.init_worker`, in the process that hosts a worker, just after that call
    loads the plugins and before the worker exists (so before any worker-scope patch, and in a
    spawned worker before anything tells the plugin which engine it serves). It fails wherever
    llvmlite is loaded then, and the plugin loads it in every process: the config patches
    import engine/config.py, which imports the graph core (numba). Hence config scope. Where
    llvmlite is not loaded the wrapper hides nothing; once engine/config.py imports the graph
    core only where it is used, llvmlite is loaded only by gsd (the graph core in a gsd worker,
    inherited by the processes it forks) and the wrapper acts only there.
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


def _add_noop_finalize_loading(bundled_callable_cls: type) -> None:
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


CONFIG_PATCHES = [
    Patch(
        target="vllm.config.speculative:SpeculativeConfig",
        why='accept "method": "gsd" and the "gsd" block of graph knobs',
        scope="config",
        mutate=_add_gsd_to_speculative_schema,
    ),
    Patch(
        target="vllm.config.speculative:SpeculativeConfig.__post_init__",
        why="build the draft model config for gsd; validate budget, vocabulary, draft TP",
        scope="config",
        wrap=_wrap_speculative_post_init,
    ),
    Patch(
        target="vllm.config.vllm:VllmConfig._get_v2_model_runner_unsupported_features",
        why="gsd runs on the V1 model runner",
        scope="config",
        wrap=_wrap_v2_unsupported,
    ),
    Patch(
        target="vllm.config.vllm:VllmConfig.__post_init__",
        why="refuse async scheduling, MRV2 and pipeline parallelism with gsd, by name; pick the "
            "attention backend; key the target's compiled model as a draft_model engine's",
        scope="config",
        wrap=_wrap_vllm_config_post_init,
    ),
    Patch(
        target="vllm.config.vllm:VllmConfig.num_lookahead_tokens",
        why="reserve KV slots for the draft's graph rows past the verified tree",
        scope="config",
        wrap=_wrap_num_lookahead_tokens,
    ),
    Patch(
        target="vllm.sampling_params:SamplingParams._validate_spec_decode",
        why="serve min_p / logit_bias requests (honoured, without a tree) instead of refusing them",
        scope="config",
        wrap=_wrap_validate_spec_decode,
    ),
    Patch(
        target="vllm.v1.worker.worker_base:WorkerBase.__init__",
        why="apply worker-scope patches lazily, inside worker processes",
        scope="config",
        wrap=_wrap_worker_init,
    ),
    Patch(
        target="vllm.triton_utils.dispatcher:_rebind_kernels",
        why="the CPU kernel-override scan, run before any worker exists, trips on llvmlite (numba), "
            "which the plugin's own config patches load",
        scope="config",
        wrap=_wrap_rebind_kernels,
    ),
]

# ---------------------------------------------------------------------------------------------
# Worker layer (inside vLLM workers, before the model runner is built)
# ---------------------------------------------------------------------------------------------


def _install_graph_attention(backend_enum) -> None:
    from vllm.v1.attention.backends.registry import register_backend

    register_backend(backend_enum.CPU_ATTN, "vllm_gsd.engine.cpu_attention.GsdCpuAttentionBackend")
    register_backend(backend_enum.TRITON_ATTN, "vllm_gsd.engine.gpu_attention.GsdTritonAttentionBackend")


def _add_gsd_stats_method(worker_cls) -> None:
    from vllm_gsd.engine.metrics import worker_gsd_stats

    worker_cls.gsd_stats = worker_gsd_stats


_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"

WORKER_PATCHES: list[Patch] = [
    Patch(
        # torch's class, not vLLM's: vLLM 0.32's loader expects a method that inductor's saved
        # functions lack; this is where that mismatch can be closed without copying vLLM's loader.
        target="torch._dynamo.aot_compile_types:BundledAOTAutogradSerializableCallable",
        why="a gsd worker on vLLM's CPU build loads the compiled models it saved instead of "
            "compiling at every start",
        scope="worker",
        mutate=_add_noop_finalize_loading,
    ),
    Patch(
        target="vllm.v1.attention.backends.registry:AttentionBackendEnum",
        why="CPU_ATTN and TRITON_ATTN with the graph mask for tree rows (vLLM's backend registry)",
        scope="worker",
        mutate=_install_graph_attention,
    ),
    Patch(
        target="vllm.v1.worker.worker_base:WorkerBase",
        why="a `gsd_stats` worker method, so LLM.collective_rpc can read GSD's figures",
        scope="worker",
        mutate=_add_gsd_stats_method,
    ),
    Patch(
        target=f"{_RUNNER}.__init__",
        why="GSD drafter and tree scorer in the draft_model slots of the V1 runner",
        scope="worker",
        wrap=runner_hooks.wrap_runner_init,
    ),
    Patch(
        target="vllm.v1.worker.gpu_model_runner:build_logitsprocs",
        why="a gsd engine keeps vLLM's min_p and logit_bias processors, which vLLM leaves out "
            "of every speculative engine (its drafts cannot honour them; gsd serves such requests "
            "without a tree)",
        scope="worker",
        wrap=runner_hooks.wrap_build_logitsprocs,
    ),
    Patch(
        target=f"{_RUNNER}._prepare_inputs",
        why="tree rows rotated at tree_base + depth; the graph mask for the target forward",
        scope="worker",
        wrap=runner_hooks.wrap_prepare_inputs,
    ),
    Patch(
        target=f"{_RUNNER}._build_attention_metadata",
        why="the target forward's trees reach its layers through their attention metadata",
        scope="worker",
        wrap=runner_hooks.wrap_build_attention_metadata,
    ),
    Patch(
        target=f"{_RUNNER}.execute_model",
        why="time the target forward for the adaptive budget; no trees outlive it",
        scope="worker",
        wrap=runner_hooks.wrap_execute_model,
    ),
    Patch(
        target=f"{_RUNNER}._sample",
        why="after the tree scorer: move the accepted nodes' KV, count the trees",
        scope="worker",
        wrap=runner_hooks.wrap_sample,
    ),
    Patch(
        target=f"{_RUNNER}._dummy_run",
        why="vLLM's dummy, profile and warm-up runs run the draft model too",
        scope="worker",
        wrap=runner_hooks.wrap_dummy_run,
    ),
    Patch(
        target=f"{_RUNNER}.propose_draft_token_ids",
        why="draft the graph after bookkeeping, from the sampled tokens",
        scope="worker",
        wrap=runner_hooks.wrap_propose_draft_token_ids,
    ),
    Patch(
        target=f"{_RUNNER}._input_fits_in_drafter",
        why="room for the tree is checked per request, not for the whole batch",
        scope="worker",
        wrap=runner_hooks.wrap_input_fits_in_drafter,
    ),
    Patch(
        target=f"{_RUNNER}.initialize_kv_cache",
        why="live target caches for compaction; one KV group only; the adaptive budget's cost curves",
        scope="worker",
        wrap=runner_hooks.wrap_initialize_kv_cache,
    ),
    Patch(
        target=f"{_RUNNER}.initialize_metadata_builders",
        why="attention groups for the draft's layers; the runner's TreeSlot for every graph builder",
        scope="worker",
        wrap=runner_hooks.wrap_initialize_metadata_builders,
    ),
]


# ---------------------------------------------------------------------------------------------
# What GSD relies on without patching it (checked with the patches of the same scope)
# ---------------------------------------------------------------------------------------------

_BACKENDS = "vllm.v1.attention.backends"

USES: list[Uses] = [
    Uses(f"{_RUNNER}._update_states", "scripts/profile_step.py times it", "worker"),
    Uses(f"{_RUNNER}._model_forward", "scripts/profile_step.py times it", "worker"),
    Uses(f"{_RUNNER}._bookkeeping_sync", "the drafter runs after it, on the sampled tokens", "worker"),
    Uses("vllm.v1.spec_decode.draft_model:DraftModelProposer", "GsdProposer's base: draft model, KV layers",
         "worker"),
    Uses("vllm.v1.spec_decode.draft_model:DraftModelProposer.build_per_group_and_layer_attn_metadata",
         "draft forwards' attention metadata", "worker"),
    Uses("vllm.v1.spec_decode.draft_model:DraftModelProposer._get_slot_mapping", "draft forwards' KV slots",
         "worker"),
    Uses("vllm.v1.spec_decode.draft_model:DraftModelProposer._get_positions", "the draft's dummy runs", "worker"),
    Uses("vllm.v1.spec_decode.draft_model:DraftModelProposer.initialize_attn_backend",
         "the draft layers' attention groups", "worker"),
    Uses(f"{_BACKENDS}.cpu_attn:CPUAttentionBackend", "the CPU graph-attention backend's base", "worker"),
    Uses(f"{_BACKENDS}.cpu_attn:CPUAttentionBackendImpl", "its impl's base", "worker"),
    Uses(f"{_BACKENDS}.cpu_attn:CPUAttentionMetadata", "its metadata's base", "worker"),
    Uses(f"{_BACKENDS}.cpu_attn:CPUAttentionMetadataBuilder._set_isa_to_layers", "pinning the cache packing",
         "worker"),
    Uses("vllm.v1.worker.utils:AttentionGroup", "the draft layers' groups and builders (their cache packing)",
         "worker"),
    Uses(f"{_BACKENDS}.triton_attn:TritonAttentionBackend", "the CUDA graph-attention backend's base", "worker"),
    Uses(f"{_BACKENDS}.triton_attn:TritonAttentionImpl", "its impl's base", "worker"),
    Uses(f"{_BACKENDS}.triton_attn:TritonAttentionMetadata", "its metadata's base", "worker"),
    Uses(f"{_BACKENDS}.triton_attn:TritonAttentionMetadataBuilder", "its builder's base", "worker"),
    Uses("vllm.v1.attention.backend:CommonAttentionMetadata", "draft forwards' attention inputs", "worker"),
    Uses("vllm.v1.sample.rejection_sampler:RejectionSampler", "GsdRejectionSampler's base", "worker"),
    Uses("vllm.v1.sample.sampler:Sampler.sample", "GsdSampler draws keyed rows after it", "worker"),
    Uses("vllm.v1.sample.sampler:Sampler.compute_logprobs", "logprobs along the accepted path", "worker"),
    Uses("vllm.v1.sample.sampler:Sampler.gather_logprobs", "logprobs along the accepted path", "worker"),
    Uses("vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_top_p", "vLLM's processing of sampled rows", "worker"),
    Uses("vllm.v1.spec_decode.metadata:SpecDecodeMetadata", "TreeSpecDecodeMetadata's base", "worker"),
    Uses("vllm.v1.outputs:SamplerOutput", "TreeSamplerOutput's base", "worker"),
    Uses("vllm.forward_context:set_forward_context", "draft forwards", "worker"),
    Uses("vllm.v1.spec_decode.ngram_proposer:_find_longest_matched_ngram_and_propose_tokens",
         "context-lookup nodes (engine/lookup.py)", "worker"),
]

# Attributes of vLLM's instances that GSD reads (set in their constructors, so checked on the
# instance: engine/runner_hooks.py, when the runner is built).
RUNNER_ATTRIBUTES = ("input_batch", "requests", "discard_request_mask", "positions", "compilation_config", "max_model_len",
                     "attn_groups", "device", "vllm_config", "sampler", "rejection_sampler", "drafter")
INPUT_BATCH_ATTRIBUTES = ("req_ids", "req_id_to_index", "num_reqs", "num_computed_tokens_cpu",
                          "num_tokens_no_spec", "token_ids_cpu", "block_table", "generators")
DRAFTER_ATTRIBUTES = ("kv_cache_gid", "input_ids", "max_num_tokens", "draft_model_config", "speculative_config")
DRAFTER_LOADED_ATTRIBUTES = ("_draft_attn_layer_names", "model", "draft_attn_groups")  # once loaded and built


def declare_all() -> None:
    """Put every patch and use above into the registry (once)."""
    if not registry.registered():
        for entry in CONFIG_PATCHES + WORKER_PATCHES + USES:
            registry.register(entry)
