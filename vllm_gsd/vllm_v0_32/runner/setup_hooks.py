"""How a gsd runner is set up: the wrappers of the V1 runner's construction and set-up that
vllm_v0_32/patches.py installs.

* `__init__`: vLLM's runner built as for draft_model, then GsdProposer (engine/proposer.py) and
  the tree scorer (vllm_v0_32/scorer.py) in its drafter and sampler slots; FULL CUDA graphs for
  decodes of one token per request, GSD's plain steps (vllm_v0_32/cuda_graphs.py);
* `build_logitsprocs`: a gsd engine keeps vLLM's built-in logits processors;
* `initialize_kv_cache`: the live target caches are listed for compaction (a target with
  several KV-cache groups is refused), and the drafter's adaptive node budget gets its cost
  curves; `initialize_metadata_builders`: the attention builders get the runner's TreeSlot
  (target and draft layers), the draft's CPU cache packing is pinned;
* `_dummy_run` (vLLM's dummy, profile, warm-up and capture runs): the draft model runs too, as
  vLLM runs its own draft_model drafter there, its piecewise CUDA graphs captured in the runner's
  piecewise pass; no tree, no request state; in the profile run (CUDA), a tree step's peak
  logits and noise (runner/profile_peak.py); `_check_and_update_cudagraph_mode`: the drafter's
  CUDA-graph keys (draft forwards replay piecewise graphs, vllm_v0_32/cuda_graphs.py); once the KV caches are bound,
  GSD's Triton kernels are launched once per launch bucket serving can use (kernel_warmup.py);
* `_input_fits_in_drafter`: the room for a tree is checked per request, by the drafter.
"""

from __future__ import annotations

import functools

import torch

from vllm_gsd.engine.config import is_gsd
from vllm_gsd.engine.metrics import GsdMetrics
from vllm_gsd.kernels.paged_layout import CpuPacking, cpu_packing
from vllm_gsd.vllm_v0_32.attention.graph_backend import install_tree_slot
from vllm_gsd.vllm_v0_32.cuda_graphs import decode_graphs_for_plain_steps
from vllm_gsd.vllm_v0_32.runner.state import GsdRunnerState, is_gsd_runner


def wrap_runner_init(original):
    """Build the runner as for draft_model, then swap in the GSD drafter and scorer."""

    @functools.wraps(original)
    def __init__(self, vllm_config, device, *args, **kwargs):
        spec = vllm_config.speculative_config
        if not is_gsd(spec):
            return original(self, vllm_config, device, *args, **kwargs)
        from vllm.distributed import get_tensor_model_parallel_rank

        from vllm_gsd.engine.proposer import GsdProposer
        from vllm_gsd.vllm_v0_32.draft_grammar import DraftGrammars
        from vllm_gsd.vllm_v0_32.scorer import GsdRejectionSampler, GsdSampler

        # vLLM's runner knows no "gsd"; its draft_model set-up (drafter slot, sampler, buffers
        # sized by num_speculative_tokens) is the one GSD needs, so it runs under that name.
        spec.method = "draft_model"
        try:
            original(self, vllm_config, device, *args, **kwargs)
        finally:
            spec.method = "gsd"
        decode_graphs_for_plain_steps(self)
        # Every tensor-parallel rank counts the same trees; one exports them to /metrics.
        self.gsd = GsdRunnerState(metrics=GsdMetrics(exports=get_tensor_model_parallel_rank() == 0))
        if hasattr(self, "drafter"):  # the last pipeline rank
            _check_vllm_attributes(self)
            self.drafter = GsdProposer(vllm_config, self.device, self, self.gsd.tree_slot)
            self.drafter.metrics = self.gsd.metrics
            self.drafter.chooser.grammars = DraftGrammars(vllm_config)
            self.sampler = GsdSampler(logprobs_mode=self.sampler.logprobs_mode,
                                      use_fp64_gumbel=self.sampler.use_fp64_gumbel)
            self.rejection_sampler = GsdRejectionSampler(self.sampler, spec, self.device)

    return __init__


def wrap_build_logitsprocs(original):
    """A gsd engine gets every built-in logits processor of a plain engine.

    vLLM builds only MinTokens for a speculative engine (min_p and logit_bias cannot be honoured
    on its drafts), so without this a min_p or logit_bias request would be served with the
    option silently ignored. A tree row gets them from the scorer's per-node processing
    (engine/node_processing.py); a request's row on a plain step from vLLM's Sampler, which
    applies these processors by batch row. Custom processors are refused at start (vllm_v0_32/patches.py), so none reaches here."""

    @functools.wraps(original)
    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=()):
        # Called while wrap_runner_init runs vLLM's runner under the method name "draft_model":
        # the gsd block tells a gsd engine (it is refused with any other method).
        spec = vllm_config.speculative_config
        if getattr(spec, "gsd", None) is None or is_pooling_model or custom_logitsprocs:
            return original(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
        from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors

        return LogitsProcessors(ctor(vllm_config, device, is_pin_memory) for ctor in BUILTIN_LOGITS_PROCESSORS)

    return build_logitsprocs


def wrap_dummy_run(original):
    """vLLM's dummy runs (profile, warm-up, compile) run the draft model as well; the first one
    after the KV caches are bound launches every Triton launch bucket serving can use, so that
    none compiles while serving (vllm_v0_32/kernel_warmup.py)."""

    @functools.wraps(original)
    def _dummy_run(self, num_tokens, *args, **kwargs):
        result = original(self, num_tokens, *args, **kwargs)
        if is_gsd_runner(self):
            from vllm.config.compilation import CUDAGraphMode

            # As vLLM's own drafter: the draft's piecewise graph of this size is captured in the
            # runner's piecewise capture pass (vllm_v0_32/cuda_graphs.py).
            capturing = kwargs.get("is_graph_capturing", False)
            self.drafter.dummy_run(
                num_tokens, is_graph_capturing=capturing,
                use_cudagraphs=(capturing and kwargs.get("cudagraph_runtime_mode") == CUDAGraphMode.PIECEWISE
                                and not self.speculative_config.enforce_eager))
            if kwargs.get("is_profile") and self.device.type == "cuda":
                _allocate_step_peak(self)
            from vllm_gsd.vllm_v0_32.kernel_warmup import warm_up_runner

            warm_up_runner(self)
        return result

    return _dummy_run


def _allocate_step_peak(runner) -> None:
    """In vLLM's profile run: the target logits of a step's every verified row, a scorer chunk
    and its Gumbel noise, at their largest (runner/profile_peak.py)."""
    from vllm_gsd.vllm_v0_32.runner.profile_peak import allocate_step_peak, verification_rows

    rows = verification_rows(runner.max_num_tokens, runner.max_num_reqs,
                             runner.speculative_config.num_speculative_tokens)
    allocate_step_peak(runner.model.compute_logits, runner.model_config.get_hidden_size(), runner.dtype,
                       runner.device, rows, runner.drafter.graph_params.top_k)


def wrap_check_and_update_cudagraph_mode(original):
    """The drafter's CUDA-graph keys, from the runner's resolved mode: vLLM sets them only for
    its own drafters (`uses_draft_model()` is false for gsd), so without this every draft forward
    would run eagerly, each layer's launches paid on the host (vllm_v0_32/cuda_graphs.py)."""

    @functools.wraps(original)
    def _check_and_update_cudagraph_mode(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if is_gsd_runner(self) and hasattr(self, "drafter"):
            self.drafter.initialize_cudagraph_keys(self.compilation_config.cudagraph_mode)
        return result

    return _check_and_update_cudagraph_mode


def wrap_initialize_kv_cache(original):
    """List the live target caches (one KV cache group only). Once the real KV cache exists, the
    adaptive node budget times forwards for its cost curves (engine/cost_calibration.py): here
    where vLLM captures no CUDA graph (the CPU, enforce_eager), else after the capture
    (`wrap_capture_model`), so that they time the graphs serving replays."""

    @functools.wraps(original)
    def initialize_kv_cache(self, kv_cache_config, is_profiling: bool = False, *args, **kwargs):
        if not is_gsd_runner(self):
            return original(self, kv_cache_config, is_profiling, *args, **kwargs)
        _refuse_several_kv_groups(kv_cache_config)
        result = original(self, kv_cache_config, is_profiling, *args, **kwargs)
        self.gsd.target_kv_caches, self.gsd.target_cache_packing = _target_kv_caches(self)
        if not is_profiling and not captures_graphs(self):
            self.drafter.prepare_policy(self)
        return result

    return initialize_kv_cache


def captures_graphs(runner) -> bool:
    """Whether vLLM's worker will call the runner's capture_model (vllm/v1/worker/gpu_worker.py:
    on CUDA unless enforce_eager; the CPU worker never does)."""
    return runner.device.type == "cuda" and not runner.model_config.enforce_eager


def wrap_capture_model(original):
    """After vLLM's CUDA-graph capture, the worker's last start-up step before serving: the
    adaptive node budget, its cost curves timed through the graphs just captured."""

    @functools.wraps(original)
    def capture_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if is_gsd_runner(self):
            self.drafter.prepare_policy(self)
        return result

    return capture_model


def wrap_input_fits_in_drafter(original):
    @functools.wraps(original)
    def _input_fits_in_drafter(self, common_attn_metadata):
        if is_gsd_runner(self):
            # GSD checks the room left per request (proposer._may_grow_tree); vLLM's check would
            # zero the drafts of the whole batch.
            return common_attn_metadata is not None
        return original(self, common_attn_metadata)

    return _input_fits_in_drafter


def wrap_initialize_metadata_builders(original):
    @functools.wraps(original)
    def initialize_metadata_builders(self, kv_cache_config, kernel_block_sizes):
        original(self, kv_cache_config, kernel_block_sizes)
        if is_gsd_runner(self):
            self.drafter.initialize_attn_backend(kv_cache_config, kernel_block_sizes)
            _check_vllm_attributes(self, loaded=True)
            install_tree_slot(self.attn_groups, self.gsd.tree_slot)
            install_tree_slot(self.drafter.draft_attn_groups, self.gsd.tree_slot)
            _pin_draft_cache_packing(self)

    return initialize_metadata_builders



def _pin_draft_cache_packing(runner) -> None:
    """On the CPU the draft's layers keep the portable "vec" cache packing, while the target's
    follow vLLM's pick ("amx" on CPUs with AMX tiles). The draft attends graph-masked at every
    level it drafts and runs vLLM's kernel only to catch up; the target runs vLLM's kernel for
    every row but the few of its trees, and all of them in a plain step.

    Only where the runner gave the draft's layers attention groups of their own: a builder sets
    the packing of its group's layers, and every builder of the draft's layers must read the one
    their cache is written in (a group shared with the target keeps vLLM's pick throughout)."""
    draft_layers = runner.drafter._draft_attn_layer_names
    runner_groups = [group for groups in runner.attn_groups for group in groups]
    owning = [group for group in runner_groups if draft_layers & set(group.layer_names)]
    if not owning or any(not set(group.layer_names) <= draft_layers for group in owning):
        return
    for group in owning + list(runner.drafter.draft_attn_groups):
        for builder in group.metadata_builders:
            if hasattr(builder, "pin_portable_packing"):
                builder.pin_portable_packing()


def _check_vllm_attributes(runner, loaded: bool = False) -> None:
    """The attributes of vLLM's runner, batch and drafter GSD reads (vllm_v0_32/patches.py): when the
    runner is built, and (loaded) once the draft model and its attention groups exist."""
    from vllm_gsd.vllm_v0_32 import patches
    from vllm_gsd.vllm_v0_32.registry import require_attributes

    if loaded:
        require_attributes(runner.drafter, patches.DRAFTER_LOADED_ATTRIBUTES, "DraftModelProposer")
        return
    require_attributes(runner, patches.RUNNER_ATTRIBUTES, "GPUModelRunner")
    require_attributes(runner.input_batch, patches.INPUT_BATCH_ATTRIBUTES, "InputBatch")
    require_attributes(runner.drafter, patches.DRAFTER_ATTRIBUTES, "DraftModelProposer")


def _refuse_several_kv_groups(kv_cache_config) -> None:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) > 1:
        raise NotImplementedError(
            "speculative method 'gsd' does not support models whose KV cache has several groups "
            f"({len(groups)}: e.g. hybrid attention, sliding-window and full layers): tree "
            "verification moves the accepted nodes' KV through one block table"
        )


def _target_kv_caches(runner) -> tuple[list[torch.Tensor], CpuPacking | None]:
    """The target layers' KV cache tensors, as bound now (KV-sharing layers alias one), and on
    the CPU their packing: CPU_ATTN's builders have set each layer's `isa` by now, one for all
    (a target has one KV-cache group). None where no layer has one (not CPU_ATTN)."""
    draft_layers = runner.drafter._draft_attn_layer_names
    caches, seen, isas = [], set(), set()
    for name, layer in runner.compilation_config.static_forward_context.items():
        kv_cache = getattr(layer, "kv_cache", None)  # not every context entry is an attention layer
        if name in draft_layers or not isinstance(kv_cache, torch.Tensor) or kv_cache.numel() == 0:
            continue
        if kv_cache.data_ptr() not in seen:
            seen.add(kv_cache.data_ptr())
            caches.append(kv_cache)
            if hasattr(layer, "isa"):
                isas.add(layer.isa)
    if not isas:
        return caches, None
    if len(isas) > 1:
        raise RuntimeError(f"gsd: the target's CPU attention layers report ISAs {sorted(isas)}; "
                           "KV compaction needs the one packing they share")
    _, _, block_size, two_head_size = caches[0].shape
    return caches, cpu_packing(isas.pop(), block_size, two_head_size // 2)
