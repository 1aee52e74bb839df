"""How the V1 model runner runs GSD: the wrappers that engine/patches.py installs.

Per step of a gsd engine:
* `_prepare_inputs` (after vLLM's): the step's trees become one `TreeBatch`
  (engine/tree_batch.py): every request whose scheduled draft tokens are a proposed tree gets
  its node rows re-rotated to tree_base + depth (their KV slots stay tree_base + row); draft
  tokens that match no proposed tree (e.g. after a preemption) are verified as a chain, which is
  also a tree. The TreeBatch rides to the scorer in the spec-decode metadata
  (`TreeSpecDecodeMetadata`), and its attention inputs to the layers through the runner's
  `TreeSlot`, held while `_build_attention_metadata` builds this forward's metadata. A step
  without drafts drops the metadata (vLLM 0.32 builds it for every step of a speculative
  engine), so it is sampled as without speculation.
* `_sample`: the rejection sampler is GsdRejectionSampler (engine/scorer.py), which scores the
  trees; then the accepted nodes' KV moves to consecutive positions (`_compact_target_kv`) and
  GSD's counters are updated. The sampler is GsdSampler, told each step (in `_prepare_inputs`)
  which roots are drawn with keyed noise (engine/sampling.py); a partial prefill's discarded
  row leaves its request's generator alone.
* `_dummy_run` (vLLM's dummy, profile and warm-up runs): the draft model runs too, as vLLM runs
  its own draft_model drafter there; no tree, no request state.
* `propose_draft_token_ids`: GsdProposer.propose_tree on the sampled tokens (after bookkeeping);
* `initialize_kv_cache`: the live target caches are listed for compaction (a target with
  several KV-cache groups is refused), and the drafter's adaptive node budget gets its cost
  curves; `initialize_metadata_builders`: the attention builders get the runner's TreeSlot
  (target and draft layers).
* `execute_model`: the target forward is timed (synchronised on CUDA) for the cost scales.

All per-runner GSD state is one `GsdRunnerState`, the runner's `gsd` attribute.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_gsd.engine.config import is_gsd
from vllm_gsd.engine.cost_calibration import synchronize
from vllm_gsd.engine.eligibility import tree_refusal_reason
from vllm_gsd.engine.graph_attention_backend import install_tree_slot
from vllm_gsd.engine.metrics import GsdMetrics
from vllm_gsd.engine.node_processing import RequestOptions, options_of
from vllm_gsd.engine.sampling import is_sampled, noise_key
from vllm_gsd.engine.tree_batch import (
    TreeAttention,
    TreeBatch,
    TreeSlot,
    TreeSpecDecodeMetadata,
    build_tree_batch,
    chain_trees,
)
from vllm_gsd.kernels.paged_layout import CpuPacking, cpu_packing


@dataclass
class GsdRunnerState:
    """What a gsd runner keeps besides vLLM's state."""

    metrics: GsdMetrics = field(default_factory=GsdMetrics)
    tree_slot: TreeSlot = field(default_factory=TreeSlot)
    # The target forward's trees, from _prepare_inputs until its attention metadata is built.
    pending_attention: TreeAttention | None = None
    # Every target layer's live KV cache (one per distinct tensor), listed at KV-cache setup.
    target_kv_caches: list[torch.Tensor] = field(default_factory=list)
    # On the CPU: how the ISA vLLM picked for those caches packs a block (kernels/paged_layout.py).
    target_cache_packing: CpuPacking | None = None


def _gsd_runner(runner) -> bool:
    return is_gsd(runner.speculative_config) and hasattr(runner, "drafter")


def wrap_runner_init(original):
    """Build the runner as for draft_model, then swap in the GSD drafter and scorer."""

    @functools.wraps(original)
    def __init__(self, vllm_config, device, *args, **kwargs):
        spec = vllm_config.speculative_config
        if not is_gsd(spec):
            return original(self, vllm_config, device, *args, **kwargs)
        from vllm.distributed import get_tensor_model_parallel_rank

        from vllm_gsd.engine.proposer import GsdProposer
        from vllm_gsd.engine.scorer import GsdRejectionSampler, GsdSampler

        # vLLM's runner knows no "gsd"; its draft_model set-up (drafter slot, sampler, buffers
        # sized by num_speculative_tokens) is the one GSD needs, so it runs under that name.
        spec.method = "draft_model"
        try:
            original(self, vllm_config, device, *args, **kwargs)
        finally:
            spec.method = "gsd"
        # Every tensor-parallel rank counts the same trees; one exports them to /metrics.
        self.gsd = GsdRunnerState(metrics=GsdMetrics(exports=get_tensor_model_parallel_rank() == 0))
        if hasattr(self, "drafter"):  # the last pipeline rank
            _check_vllm_attributes(self)
            self.drafter = GsdProposer(vllm_config, self.device, self, self.gsd.tree_slot)
            self.drafter.metrics = self.gsd.metrics
            self.sampler = GsdSampler(logprobs_mode=self.sampler.logprobs_mode,
                                      use_fp64_gumbel=self.sampler.use_fp64_gumbel)
            self.rejection_sampler = GsdRejectionSampler(self.sampler, spec, self.device)

    return __init__


def wrap_build_logitsprocs(original):
    """A gsd engine gets every built-in logits processor of a plain engine.

    vLLM builds only MinTokens for a speculative engine (min_p and logit_bias cannot be honoured
    on its drafts), so without this a min_p or logit_bias request would be served with the
    option silently ignored. GSD serves such requests without a tree (engine/eligibility.py):
    their one row a step is vLLM's Sampler's, which applies these processors by batch row.
    Custom processors are refused at start (engine/patches.py), so none reaches here."""

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


def wrap_prepare_inputs(original):
    @functools.wraps(original)
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        logits_indices, spec_decode_metadata, *rest = original(self, scheduler_output, num_scheduled_tokens)
        if not _gsd_runner(self):
            return (logits_indices, spec_decode_metadata, *rest)
        _park_generators_of_discarded_rows(self)
        self.sampler.keyed = _keyed_roots(self, scheduler_output, num_scheduled_tokens)
        if not any(scheduler_output.scheduled_spec_decode_tokens.values()):
            # vLLM 0.32 builds speculative metadata for every step once a method is configured,
            # drafts or not. A step without trees (a plain step of the adaptive budget, a
            # prefill) is sampled as without speculation: vLLM's sampler and its logprobs, with
            # no gather of the logits' rows (32 x 152k floats at batch 32) and no tree walk.
            spec_decode_metadata = None
        else:
            tree = _verification_trees(self, scheduler_output, num_scheduled_tokens)
            self.gsd.pending_attention = tree.attention if tree.attention.request_index.numel() else None
            spec_decode_metadata = TreeSpecDecodeMetadata.wrap(spec_decode_metadata, tree)
        return (logits_indices, spec_decode_metadata, *rest)

    return _prepare_inputs


def wrap_build_attention_metadata(original):
    """The layers of the target forward being prepared see its trees in their metadata."""

    @functools.wraps(original)
    def _build_attention_metadata(self, *args, **kwargs):
        if not _gsd_runner(self) or self.gsd.pending_attention is None:
            return original(self, *args, **kwargs)
        tree, self.gsd.pending_attention = self.gsd.pending_attention, None
        with self.gsd.tree_slot.holding(tree):
            return original(self, *args, **kwargs)

    return _build_attention_metadata


def wrap_execute_model(original):
    @functools.wraps(original)
    def execute_model(self, scheduler_output, *args, **kwargs):
        if not _gsd_runner(self):
            return original(self, scheduler_output, *args, **kwargs)
        started = time.perf_counter()
        self.gsd.metrics.begin_step(scheduler_output)
        verified_trees = bool(scheduler_output.scheduled_spec_decode_tokens)
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            self.gsd.pending_attention = None
            synchronize(self.device)  # CUDA runs ahead of the host: time the forward, not its launch
            seconds = time.perf_counter() - started
            self.gsd.metrics.add(target_forward_us=int(seconds * 1e6))
            self.drafter.record_target_forward(scheduler_output.total_num_scheduled_tokens,
                                               seconds, verified_trees)

    return execute_model


def wrap_sample(original):
    """Score (vLLM's sampler slots), then move the accepted nodes' KV and count the trees."""

    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        if not _gsd_runner(self) or not isinstance(spec_decode_metadata, TreeSpecDecodeMetadata):
            return original(self, logits, spec_decode_metadata)
        started = time.perf_counter()
        output = original(self, logits, spec_decode_metadata)
        scored = time.perf_counter()
        tree = spec_decode_metadata.tree
        _compact_target_kv(self, tree, output.accepted)
        self.gsd.metrics.add(verify_us=int((scored - started) * 1e6),
                             kv_compaction_us=int((time.perf_counter() - scored) * 1e6),
                             **_tree_counts(tree, output.accepted))
        return output

    return _sample


def wrap_dummy_run(original):
    """vLLM's dummy runs (profile, warm-up, compile) run the draft model as well."""

    @functools.wraps(original)
    def _dummy_run(self, num_tokens, *args, **kwargs):
        result = original(self, num_tokens, *args, **kwargs)
        if _gsd_runner(self):
            self.drafter.dummy_run(num_tokens)
        return result

    return _dummy_run


def wrap_initialize_kv_cache(original):
    """List the live target caches; once the real KV cache exists, the adaptive node budget
    may time forwards for its cost curves."""

    @functools.wraps(original)
    def initialize_kv_cache(self, kv_cache_config, is_profiling: bool = False, *args, **kwargs):
        if not _gsd_runner(self):
            return original(self, kv_cache_config, is_profiling, *args, **kwargs)
        _refuse_several_kv_groups(kv_cache_config)
        result = original(self, kv_cache_config, is_profiling, *args, **kwargs)
        self.gsd.target_kv_caches, self.gsd.target_cache_packing = _target_kv_caches(self)
        if not is_profiling:
            self.drafter.prepare_policy(self)
        return result

    return initialize_kv_cache


def wrap_propose_draft_token_ids(original):
    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        if not _gsd_runner(self):
            return original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        return self.drafter.propose_tree(self, scheduler_output, sampled_token_ids)

    return propose_draft_token_ids


def wrap_take_draft_token_ids(original):
    """The drafts as vLLM hands them to the scheduler, with the tree of every request that has a
    grammar: the scheduler checks a tree's nodes and fills its bitmask path by path
    (engine/scheduler_hooks.py)."""

    @functools.wraps(original)
    def take_draft_token_ids(self):
        drafts = original(self)
        if drafts is None or not _gsd_runner(self):
            return drafts
        from vllm_gsd.engine.scheduler_hooks import TreeDraftTokenIds

        parents = [_grammar_tree_parents(self, req_id, tokens)
                   for req_id, tokens in zip(drafts.req_ids, drafts.draft_token_ids)]
        if all(p is None for p in parents):
            return drafts
        return TreeDraftTokenIds(drafts.req_ids, drafts.draft_token_ids, parents)

    return take_draft_token_ids


def _grammar_tree_parents(runner, req_id: str, tokens: list[int]) -> list[int] | None:
    """The parent rows of a structured-output request's proposed tree (None: no grammar, no tree)."""
    state = runner.requests.get(req_id)
    tree = runner.drafter.trees.get(req_id)
    if (not tokens or tree is None or state is None or state.sampling_params is None
            or state.sampling_params.structured_outputs is None
            or tree.draft_token_ids[:len(tokens)].tolist() != list(tokens)):
        return None
    return tree.parent_row[:len(tokens)].tolist()


def wrap_input_fits_in_drafter(original):
    @functools.wraps(original)
    def _input_fits_in_drafter(self, common_attn_metadata):
        if _gsd_runner(self):
            # GSD checks the room left per request (proposer._may_grow_tree); vLLM's check would
            # zero the drafts of the whole batch.
            return common_attn_metadata is not None
        return original(self, common_attn_metadata)

    return _input_fits_in_drafter


def wrap_initialize_metadata_builders(original):
    @functools.wraps(original)
    def initialize_metadata_builders(self, kv_cache_config, kernel_block_sizes):
        original(self, kv_cache_config, kernel_block_sizes)
        if _gsd_runner(self):
            self.drafter.initialize_attn_backend(kv_cache_config, kernel_block_sizes)
            _check_vllm_attributes(self, loaded=True)
            install_tree_slot(self.attn_groups, self.gsd.tree_slot)
            install_tree_slot(self.drafter.draft_attn_groups, self.gsd.tree_slot)
            _pin_draft_cache_packing(self)

    return initialize_metadata_builders


# ------------------------------------------------------------------------------------------


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
    """The attributes of vLLM's runner, batch and drafter GSD reads (engine/patches.py): when the
    runner is built, and (loaded) once the draft model and its attention groups exist."""
    from vllm_gsd.engine import patches
    from vllm_gsd.engine.registry import require_attributes

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


def _park_generators_of_discarded_rows(runner) -> None:
    """Keep a seeded request's generator out of a step whose sampled token is discarded.

    A partial prefill samples a token that is thrown away; vLLM then rewinds the request's
    generator by its Philox offset (`_bookkeeping_sync`), which a CPU generator does not have:
    RuntimeError, and the engine dies. Sampling that row from the global generator instead leaves
    the request's own generator untouched, which is what the rewind means, on any device. The
    generators dict is vLLM's own (the sampling metadata holds it), so it is changed in place, and
    each step rebuilds it from the request states.
    """
    batch = runner.input_batch
    discarded = runner.discard_request_mask.np[:batch.num_reqs]
    for i, req_id in enumerate(batch.req_ids[:batch.num_reqs]):
        generator = runner.requests[req_id].generator
        if generator is None:
            continue
        if discarded[i]:
            batch.generators.pop(i, None)
        else:
            batch.generators[i] = generator


def _keyed_roots(runner, scheduler_output, num_scheduled_tokens: np.ndarray):
    """The rows GsdSampler draws with keyed noise: sampled requests that the tree path serves,
    sampling this step (not a partial prefill), whether they have a tree or not, seeded or not.

    Unseeded requests too: whether a request gets a tree depends on the draft's children, which
    the noise of the token's position chose. Were a request without a tree drawn afresh and one
    with a tree by that noise, the draw would be conditioned on its own noise (the adaptive
    budget keeps trees whose chosen children are likely, so likely tokens would be favoured).
    Drawn by the same noise either way, each token is the target's draw, tree or not.

    Row 0 samples the token at position num_computed + num_scheduled - num_nodes (the root's
    position + 1), the position a tree's own row 0 is keyed by (engine/scorer.py)."""
    from vllm_gsd.engine.scorer import KeyedRoots

    batch = runner.input_batch
    discarded = runner.discard_request_mask.np[:batch.num_reqs]
    keyed = KeyedRoots(rows=[], keys=[], positions=[])
    for i, req_id in enumerate(batch.req_ids[:batch.num_reqs]):
        state = runner.requests[req_id]
        params = state.sampling_params
        if (discarded[i] or not is_sampled(params)
                or tree_refusal_reason(params, len(state.output_token_ids)) is not None):
            continue
        num_nodes = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
        keyed.rows.append(i)
        keyed.keys.append(noise_key(req_id, params, runner.vllm_config.model_config.seed))
        keyed.min_p.append(params.min_p)
        keyed.positions.append(int(batch.num_computed_tokens_cpu[i]) + int(num_scheduled_tokens[i]) - num_nodes)
    return keyed


def _verification_trees(runner, scheduler_output, num_scheduled_tokens: np.ndarray) -> TreeBatch:
    """This step's TreeBatch; tree rows re-rotated at tree_base + depth in runner.positions."""
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    proposed = runner.drafter.trees
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(num_scheduled_tokens[:num_reqs], out=query_start_loc[1:])
    num_draft = [0] * num_reqs
    for req_id, draft_tokens in scheduler_output.scheduled_spec_decode_tokens.items():
        num_draft[batch.req_id_to_index[req_id]] = len(draft_tokens)
    # Drafts we did not propose as a tree are verified as a chain.
    parent_row, depth = chain_trees(num_draft)
    via_merge = torch.zeros(parent_row.shape, dtype=torch.bool)
    tree_base = np.zeros(num_reqs, dtype=np.int64)
    keys: list[int | None] = [None] * num_reqs
    options: list[RequestOptions | None] = [None] * num_reqs
    rotated_rows, rotated_positions = [], []
    for req_id, draft_tokens in scheduler_output.scheduled_spec_decode_tokens.items():
        num_nodes = len(draft_tokens)
        if num_nodes == 0:
            continue
        i = batch.req_id_to_index[req_id]
        tree = proposed.get(req_id)
        if (tree is not None and num_nodes <= tree.draft_token_ids.numel()
                and tree.draft_token_ids[:num_nodes].tolist() == list(draft_tokens)):
            parent_row[i, :num_nodes] = tree.parent_row[:num_nodes]
            depth[i, :num_nodes] = tree.depth[:num_nodes]
            via_merge[i, :num_nodes] = tree.via_merge[:num_nodes]
        root_offset = int(num_scheduled_tokens[i]) - num_nodes - 1
        tree_base[i] = int(batch.num_computed_tokens_cpu[i]) + root_offset
        first = int(query_start_loc[i]) + root_offset
        rotated_rows.append(np.arange(first + 1, first + 1 + num_nodes))
        rotated_positions.append(tree_base[i] + depth[i, :num_nodes].numpy())
        state = runner.requests[req_id]
        params = state.sampling_params
        if is_sampled(params):
            keys[i] = noise_key(req_id, params, runner.vllm_config.model_config.seed)
        options[i] = options_of(params, state.prompt_token_ids, state.output_token_ids)
    if rotated_rows:  # one copy for the whole batch
        rows = torch.from_numpy(np.concatenate(rotated_rows)).to(runner.positions.device)
        runner.positions[rows] = torch.from_numpy(np.concatenate(rotated_positions)).to(runner.positions.device)
    return build_tree_batch(parent_row, depth, torch.tensor(num_draft, dtype=torch.int64), tree_base,
                            via_merge, keys, query_start_loc, runner.device, options)


def _tree_counts(tree: TreeBatch, accepted) -> dict[str, int]:
    """GSD's verification counters for one step."""
    num_nodes = tree.num_nodes.tolist()
    num_accepted = accepted.num_accepted.tolist()
    trees = [b for b, n in enumerate(num_nodes) if n]
    through_merge = 0
    for b in trees:
        a = num_accepted[b]
        if a:
            path = accepted.accepted_rows[b, 1:a + 1].cpu() - 1
            through_merge += bool(tree.via_merge[b, path].any())
    return {"trees_verified": len(trees), "nodes_verified": sum(num_nodes),
            "accepted_nodes": sum(num_accepted[b] for b in trees), "paths_through_merge": through_merge}


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


def _compact_target_kv(runner, tree: TreeBatch, accepted) -> None:
    """Move each request's accepted nodes' KV to consecutive positions after its root."""
    from vllm_gsd.kernels.kv_compaction import compact_kv, compact_kv_cpu

    num_accepted = accepted.num_accepted
    if int(num_accepted.max()) == 0:
        return
    block_table = runner.input_batch.block_table[runner.drafter.kv_cache_gid]
    table = block_table.get_device_tensor(runner.input_batch.num_reqs)
    tree_base = torch.from_numpy(tree.tree_base.astype(np.int32)).to(table.device)
    on_cpu = table.device.type == "cpu"
    if on_cpu:
        compact_kv_cpu(runner.gsd.target_kv_caches, table, block_table.block_size, tree_base,
                       accepted.accepted_rows, num_accepted, runner.gsd.target_cache_packing)
    else:
        compact_kv(runner.gsd.target_kv_caches, table, block_table.block_size, tree_base,
                   accepted.accepted_rows, num_accepted, layout="gpu_bhnc")
