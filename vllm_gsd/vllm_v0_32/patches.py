"""Every change vllm-gsd makes to vLLM 0.32.0, declared in one list.

Read this file to know the whole surface we touch: each patch's target, reason and scope, what
GSD uses without patching, and the instance attributes it reads. The mechanism (version gate,
target resolution, idempotence) is in vllm_v0_32/registry.py. What a patch does is in
vllm_v0_32/config_patches.py (`impl.`), or, for the model runner's hooks, in vllm_v0_32/runner/,
named "module:function" here and imported when a gsd worker applies them: loading the plugin
imports no model-runner code, and the runner's hooks can read the attribute lists below without
an import cycle.
"""

from __future__ import annotations

from vllm_gsd.vllm_v0_32 import config_patches as impl
from vllm_gsd.vllm_v0_32 import registry
from vllm_gsd.vllm_v0_32.registry import Patch, Uses

# ---------------------------------------------------------------------------------------------
# Config layer (every process)
# ---------------------------------------------------------------------------------------------

CONFIG_PATCHES = [
    Patch(
        target="vllm.config.speculative:SpeculativeConfig",
        why='accept "method": "gsd" and the "gsd" block of graph knobs',
        scope="config",
        mutate=impl.add_gsd_to_speculative_schema,
    ),
    Patch(
        target="vllm.config.speculative:SpeculativeConfig.__post_init__",
        why="build the draft model config for gsd; validate budget, vocabulary, draft TP",
        scope="config",
        wrap=impl.wrap_speculative_post_init,
    ),
    Patch(
        target="vllm.config.vllm:VllmConfig._get_v2_model_runner_unsupported_features",
        why="gsd runs on the V1 model runner",
        scope="config",
        wrap=impl.wrap_v2_unsupported,
    ),
    Patch(
        target="vllm.config.vllm:VllmConfig.__post_init__",
        why="refuse async scheduling, MRV2 and pipeline parallelism with gsd, by name; pick the "
            "attention backend; key the target's compiled model as a draft_model engine's",
        scope="config",
        wrap=impl.wrap_vllm_config_post_init,
    ),
    Patch(
        target="vllm.config.vllm:VllmConfig.num_lookahead_tokens",
        why="reserve KV slots for the draft's graph rows past the verified tree",
        scope="config",
        wrap=impl.wrap_num_lookahead_tokens,
    ),
    Patch(
        target="vllm.sampling_params:SamplingParams._validate_spec_decode",
        why="serve min_p / logit_bias requests (honoured, without a tree) instead of refusing them",
        scope="config",
        wrap=impl.wrap_validate_spec_decode,
    ),
    Patch(
        target="vllm.v1.worker.worker_base:WorkerBase.__init__",
        why="apply engine- and worker-scope patches lazily, inside gsd worker processes",
        scope="config",
        wrap=impl.wrap_worker_init,
    ),
    Patch(
        target="vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids",
        why="a structured-output request's tree keeps the nodes its grammar allows along their own "
            "paths (vLLM checks drafts as a chain)",
        scope="config",
        wrap="vllm_gsd.vllm_v0_32.scheduler_hooks:wrap_update_draft_token_ids",
    ),
    Patch(
        target="vllm.v1.structured_output:StructuredOutputManager.grammar_bitmask",
        why="a grammar-bitmask row per tree row, the state after that row's path",
        scope="config",
        wrap="vllm_gsd.vllm_v0_32.scheduler_hooks:wrap_grammar_bitmask",
    ),
    Patch(
        target="vllm.v1.executor.ray_env_utils:_RAY_WORKER_PRE_IMPORT_ENV_VARS",
        why="Ray workers get PROMETHEUS_MULTIPROC_DIR when Ray starts them, before they import "
            "prometheus_client (which picks its multiprocess mode then): their vllm:gsd_* counters "
            "reach /metrics. Acts only where the driver has the variable, which vLLM's Ray executor "
            "hands its workers anyway, too late",
        scope="config",
        wrap="vllm_gsd.vllm_v0_32.ray_env:wrap_pre_import_env_vars",
    ),
]

# ---------------------------------------------------------------------------------------------
# Engine layer (a process that builds a gsd engine's config, and every gsd worker)
# ---------------------------------------------------------------------------------------------

ENGINE_PATCHES = [
    Patch(
        target="vllm.triton_utils.dispatcher:_rebind_kernels",
        why="the CPU kernel-override scan, run before a worker exists, trips on llvmlite (numba), "
            "which gsd's graph core loads: an engine started after a gsd engine in the same "
            "process (VLLM_ENABLE_V1_MULTIPROCESSING=0) scans beside it",
        scope="engine",
        wrap=impl.wrap_rebind_kernels,
    ),
]

# ---------------------------------------------------------------------------------------------
# Worker layer (inside gsd workers, before the model runner is built)
# ---------------------------------------------------------------------------------------------

_SETUP = "vllm_gsd.vllm_v0_32.runner.setup_hooks:"
_STEP = "vllm_gsd.vllm_v0_32.runner.step_hooks:"
_SAMPLING = "vllm_gsd.vllm_v0_32.runner.sampling_hooks:"
_DRAFT = "vllm_gsd.vllm_v0_32.runner.draft_hooks:"
_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"

WORKER_PATCHES: list[Patch] = [
    Patch(
        # torch's class, not vLLM's: vLLM 0.32's loader expects a method that inductor's saved
        # functions lack; this is where that mismatch can be closed without copying vLLM's loader.
        target="torch._dynamo.aot_compile_types:BundledAOTAutogradSerializableCallable",
        why="a gsd worker on vLLM's CPU build loads the compiled models it saved instead of "
            "compiling at every start",
        scope="worker",
        mutate=impl.add_noop_finalize_loading,
    ),
    Patch(
        target="vllm.v1.attention.backends.registry:AttentionBackendEnum",
        why="CPU_ATTN and TRITON_ATTN with the graph mask for tree rows (vLLM's backend registry)",
        scope="worker",
        mutate=impl.install_graph_attention,
    ),
    Patch(
        target="vllm.v1.worker.worker_base:WorkerBase",
        why="a `gsd_stats` worker method, so LLM.collective_rpc can read GSD's figures",
        scope="worker",
        mutate=impl.add_gsd_stats_method,
    ),
    Patch(
        target=f"{_RUNNER}.__init__",
        why="GSD drafter and tree scorer in the draft_model slots of the V1 runner",
        scope="worker",
        wrap=_SETUP + "wrap_runner_init",
    ),
    Patch(
        target="vllm.v1.worker.gpu_model_runner:build_logitsprocs",
        why="a gsd engine keeps vLLM's min_p and logit_bias processors, which vLLM leaves out "
            "of every speculative engine (its drafts cannot honour them; gsd serves such requests "
            "without a tree)",
        scope="worker",
        wrap=_SETUP + "wrap_build_logitsprocs",
    ),
    Patch(
        target=f"{_RUNNER}._prepare_inputs",
        why="tree rows rotated at tree_base + depth; the graph mask for the target forward",
        scope="worker",
        wrap=_STEP + "wrap_prepare_inputs",
    ),
    Patch(
        target=f"{_RUNNER}._build_attention_metadata",
        why="the target forward's trees reach its layers through their attention metadata",
        scope="worker",
        wrap=_STEP + "wrap_build_attention_metadata",
    ),
    Patch(
        target=f"{_RUNNER}.execute_model",
        why="time the target forward for the adaptive budget; no trees outlive it",
        scope="worker",
        wrap=_STEP + "wrap_execute_model",
    ),
    Patch(
        target=f"{_RUNNER}._sample",
        why="after the tree scorer: move the accepted nodes' KV, count the trees",
        scope="worker",
        wrap=_SAMPLING + "wrap_sample",
    ),
    Patch(
        target=f"{_RUNNER}._dummy_run",
        why="vLLM's dummy, profile and warm-up runs run the draft model too",
        scope="worker",
        wrap=_SETUP + "wrap_dummy_run",
    ),
    Patch(
        target=f"{_RUNNER}.propose_draft_token_ids",
        why="draft the graph after bookkeeping, from the sampled tokens",
        scope="worker",
        wrap=_DRAFT + "wrap_propose_draft_token_ids",
    ),
    Patch(
        target=f"{_RUNNER}.take_draft_token_ids",
        why="the scheduler gets each structured-output request's tree with its drafts",
        scope="worker",
        wrap=_DRAFT + "wrap_take_draft_token_ids",
    ),
    Patch(
        target=f"{_RUNNER}._input_fits_in_drafter",
        why="room for the tree is checked per request, not for the whole batch",
        scope="worker",
        wrap=_SETUP + "wrap_input_fits_in_drafter",
    ),
    Patch(
        target=f"{_RUNNER}._check_and_update_cudagraph_mode",
        why="the drafter's CUDA-graph keys (vLLM sets them for its own drafters only)",
        scope="worker",
        wrap=_SETUP + "wrap_check_and_update_cudagraph_mode",
    ),
    Patch(
        target=f"{_RUNNER}.initialize_kv_cache",
        why="live target caches for compaction; one KV group only; the adaptive budget's cost "
            "curves where no CUDA graph is captured (CPU, enforce_eager)",
        scope="worker",
        wrap=_SETUP + "wrap_initialize_kv_cache",
    ),
    Patch(
        target=f"{_RUNNER}.capture_model",
        why="the adaptive budget's cost curves, timed through the CUDA graphs just captured",
        scope="worker",
        wrap=_SETUP + "wrap_capture_model",
    ),
    Patch(
        target=f"{_RUNNER}.initialize_metadata_builders",
        why="attention groups for the draft's layers; the runner's TreeSlot for every graph builder",
        scope="worker",
        wrap=_SETUP + "wrap_initialize_metadata_builders",
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
    Uses("vllm.v1.spec_decode.draft_model:DraftModelProposer._set_positions",
         "draft forwards in CUDA graphs read positions from the drafter's buffer", "worker"),
    Uses("vllm.v1.spec_decode.draft_model:DraftModelProposer.initialize_cudagraph_keys",
         "the drafter's piecewise CUDA-graph keys", "worker"),
    Uses("vllm.v1.cudagraph_dispatcher:CudagraphDispatcher.dispatch",
         "draft forwards padded to a captured CUDA-graph size", "worker"),
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
    Uses("vllm.v1.executor.ray_env_utils:update_runtime_env_for_worker_import",
         "puts _RAY_WORKER_PRE_IMPORT_ENV_VARS into the Ray actors' runtime_env (vllm_v0_32/ray_env.py)", "config"),
    Uses("vllm.v1.structured_output:StructuredOutputManager._get_constraint_bounds",
         "whether a request's grammar applies from its next token (vllm_v0_32/scheduler_hooks.py)", "config"),
    Uses("vllm.v1.structured_output:StructuredOutputManager._fill_bitmasks",
         "fills a tree row's grammar bitmask (vllm_v0_32/scheduler_hooks.py)", "config"),
    Uses("vllm.v1.structured_output:ConstraintBounds", "a grammar that applies from the next token", "config"),
    Uses("vllm.v1.outputs:DraftTokenIds", "TreeDraftTokenIds's base", "config"),
]

# Attributes of vLLM's instances that GSD reads (set in their constructors, so checked on the
# instance: vllm_v0_32/runner/setup_hooks.py, when the runner is built).
RUNNER_ATTRIBUTES = ("input_batch", "requests", "discard_request_mask", "positions", "compilation_config", "max_model_len",
                     "attn_groups", "device", "vllm_config", "sampler", "rejection_sampler", "drafter",
                     "cudagraph_dispatcher", "uniform_decode_query_len")
INPUT_BATCH_ATTRIBUTES = ("req_ids", "req_id_to_index", "num_reqs", "num_computed_tokens_cpu",
                          "num_tokens_no_spec", "token_ids_cpu", "block_table", "generators")
DRAFTER_ATTRIBUTES = ("kv_cache_gid", "input_ids", "positions", "max_num_tokens", "draft_model_config",
                      "speculative_config", "cudagraph_dispatcher")
DRAFTER_LOADED_ATTRIBUTES = ("_draft_attn_layer_names", "model", "draft_attn_groups")  # once loaded and built


def declare_all() -> None:
    """Put every patch and use above into the registry (once)."""
    if not registry.registered():
        for entry in CONFIG_PATCHES + ENGINE_PATCHES + WORKER_PATCHES + USES:
            registry.register(entry)
