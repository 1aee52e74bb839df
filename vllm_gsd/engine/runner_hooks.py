"""How the V1 model runner runs GSD: the wrappers that engine/patches.py installs.

Per step of a gsd engine:
* `_prepare_inputs` (after vLLM's): every request whose scheduled draft tokens are a proposed tree
  gets its node rows re-rotated to tree_base + depth (their KV slots stay tree_base + row), and the
  forward gets the tree's graph mask (engine/tree_attention.py). Draft tokens that match no
  proposed tree (e.g. after a preemption) are verified as a chain, which is also a tree.
* `execute_model`: the graph mask lives for the target forward only.
* the rejection sampler is GsdRejectionSampler (engine/scorer.py), which also compacts the KV;
  the sampler is GsdSampler, told each step (in `_prepare_inputs`) which roots are drawn from
  u(seed, position), and a partial prefill's discarded row leaves its request's generator alone;
* `propose_draft_token_ids`: GsdProposer.propose_tree on the sampled tokens (after bookkeeping);
* `initialize_metadata_builders`: the draft layers get their attention groups, as for draft_model;
* `initialize_kv_cache`: then the drafter's adaptive node budget gets its cost curves.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import torch

from vllm_gsd.engine.config import is_gsd
from vllm_gsd.engine.eligibility import tree_refusal_reason
from vllm_gsd.engine.metrics import GsdMetrics
from vllm_gsd.engine.tree_attention import TreeMask, current_graph_mask, set_graph_mask
from vllm_gsd.graph import ancestor_words_from_parents


@dataclass
class VerifyStep:
    """The trees verified in this step, by runner batch index."""

    parent_row: list[torch.Tensor | None]  # per request: int64 [n] or None (no drafts)
    depth: list[torch.Tensor | None]  # per request: int64 [n]
    via_merge: list[torch.Tensor | None]
    tree_base: np.ndarray  # int64 [B]: KV position of row 0 (the root)
    seed: list[int | None]  # per request: sampling seed, if any


def _gsd_runner(runner) -> bool:
    return is_gsd(getattr(runner, "speculative_config", None))


def wrap_runner_init(original):
    """Build the runner as for draft_model, then swap in the GSD drafter and scorer."""

    @functools.wraps(original)
    def __init__(self, vllm_config, device, *args, **kwargs):
        spec = vllm_config.speculative_config
        if not is_gsd(spec):
            return original(self, vllm_config, device, *args, **kwargs)
        from vllm_gsd.engine.proposer import GsdProposer
        from vllm_gsd.engine.scorer import GsdRejectionSampler, GsdSampler

        # vLLM's runner knows no "gsd"; its draft_model set-up (drafter slot, sampler, buffers
        # sized by num_speculative_tokens) is the one GSD needs, so it runs under that name.
        spec.method = "draft_model"
        try:
            original(self, vllm_config, device, *args, **kwargs)
        finally:
            spec.method = "gsd"
        self._gsd_metrics = GsdMetrics()
        if hasattr(self, "drafter"):
            self.drafter = GsdProposer(vllm_config, self.device, self)
            self.drafter.metrics = self._gsd_metrics
            self.sampler = GsdSampler(logprobs_mode=self.sampler.logprobs_mode,
                                      use_fp64_gumbel=self.sampler.use_fp64_gumbel)
            self.rejection_sampler = GsdRejectionSampler(self.sampler, spec, self.device)
            self.rejection_sampler.compact_kv = functools.partial(_compact_target_kv, self)
            self.rejection_sampler.metrics = self._gsd_metrics
        self._gsd_target_kv_caches = None

    return __init__


def wrap_prepare_inputs(original):
    @functools.wraps(original)
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = original(self, scheduler_output, num_scheduled_tokens)
        if _gsd_runner(self) and hasattr(self, "drafter"):
            _prepare_tree_verification(self, scheduler_output, num_scheduled_tokens)
        return result

    return _prepare_inputs


def wrap_execute_model(original):
    @functools.wraps(original)
    def execute_model(self, *args, **kwargs):
        if not _gsd_runner(self):
            return original(self, *args, **kwargs)
        started = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            verified_trees = current_graph_mask() is not None
            set_graph_mask(None)
            seconds = time.perf_counter() - started
            self._gsd_metrics.add(target_forward_us=int(seconds * 1e6))
            scheduler_output = args[0] if args else kwargs.get("scheduler_output")
            if hasattr(self, "drafter") and scheduler_output is not None:
                self.drafter.record_target_forward(scheduler_output.total_num_scheduled_tokens,
                                                   seconds, verified_trees)

    return execute_model


def wrap_initialize_kv_cache(original):
    """Once the KV cache exists, the adaptive node budget may time forwards for its cost curves."""

    @functools.wraps(original)
    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        result = original(self, kv_cache_config, *args, **kwargs)
        is_profiling = kwargs.get("is_profiling", args[0] if args else False)
        if _gsd_runner(self) and hasattr(self, "drafter") and not is_profiling:
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
        if _gsd_runner(self) and hasattr(self, "drafter"):
            self.drafter.initialize_attn_backend(kv_cache_config, kernel_block_sizes)

    return initialize_metadata_builders


# ------------------------------------------------------------------------------------------


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
    """The rows GsdSampler draws from u(seed, position): seeded random requests that the tree
    path serves, sampling this step (not a partial prefill), whether they have a tree or not.

    Row 0 samples the token at position num_computed + num_scheduled - num_nodes (the root's
    position + 1), the position a tree's own row 0 is keyed by (engine/scorer.py)."""
    from vllm_gsd.engine.scorer import _SAMPLING_EPS, KeyedRoots

    batch = runner.input_batch
    discarded = runner.discard_request_mask.np[:batch.num_reqs]
    keyed = KeyedRoots(rows=[], seeds=[], positions=[])
    for i, req_id in enumerate(batch.req_ids[:batch.num_reqs]):
        state = runner.requests[req_id]
        params = state.sampling_params
        if (discarded[i] or params is None or params.seed is None or params.temperature < _SAMPLING_EPS
                or tree_refusal_reason(params, len(state.output_token_ids)) is not None):
            continue
        num_nodes = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
        keyed.rows.append(i)
        keyed.seeds.append(params.seed)
        keyed.positions.append(int(batch.num_computed_tokens_cpu[i]) + int(num_scheduled_tokens[i]) - num_nodes)
    return keyed


def _prepare_tree_verification(runner, scheduler_output, num_scheduled_tokens: np.ndarray) -> None:
    _park_generators_of_discarded_rows(runner)
    runner.sampler.keyed = _keyed_roots(runner, scheduler_output, num_scheduled_tokens)
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    proposed = runner.drafter.trees
    query_start = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(num_scheduled_tokens[:num_reqs], out=query_start[1:])
    parent_rows: list[torch.Tensor | None] = [None] * num_reqs
    depths: list[torch.Tensor | None] = [None] * num_reqs
    via_merge: list[torch.Tensor | None] = [None] * num_reqs
    seeds: list[int | None] = [None] * num_reqs
    tree_base = np.zeros(num_reqs, dtype=np.int64)
    query_tree_row = np.full(int(query_start[-1]), -1, dtype=np.int32)
    tree_requests = []
    positions = runner.positions
    for req_id, draft_tokens in scheduler_output.scheduled_spec_decode_tokens.items():
        num_nodes = len(draft_tokens)
        if num_nodes == 0:
            continue
        i = batch.req_id_to_index[req_id]
        tree = proposed.get(req_id)
        if (tree is not None and num_nodes <= tree.draft_token_ids.numel()
                and tree.draft_token_ids[:num_nodes].tolist() == list(draft_tokens)):
            parent, depth = tree.parent_row[:num_nodes], tree.depth[:num_nodes]
            via_merge[i] = tree.via_merge[:num_nodes]
        else:  # drafts we did not propose as a tree: a chain
            parent = torch.arange(num_nodes, dtype=torch.int64)
            depth = torch.arange(1, num_nodes + 1, dtype=torch.int64)
        root_offset = int(num_scheduled_tokens[i]) - num_nodes - 1
        base = int(batch.num_computed_tokens_cpu[i]) + root_offset
        first = int(query_start[i]) + root_offset
        positions[first + 1: first + 1 + num_nodes] = (base + depth).to(positions.device)
        query_tree_row[first: first + 1 + num_nodes] = np.arange(num_nodes + 1)
        parent_rows[i], depths[i], tree_base[i] = parent, depth, base
        params = runner.requests[req_id].sampling_params
        seeds[i] = None if params is None else params.seed
        tree_requests.append(i)

    step = VerifyStep(parent_row=parent_rows, depth=depths, via_merge=via_merge,
                      tree_base=tree_base, seed=seeds)
    runner.rejection_sampler.verify_step = step
    if not tree_requests:
        set_graph_mask(None)
        return
    tree_requests.sort()
    max_nodes = max(parent_rows[i].numel() for i in tree_requests)
    parent_padded = torch.full((len(tree_requests), max_nodes), -1, dtype=torch.int64)
    num_nodes = torch.zeros(len(tree_requests), dtype=torch.int64)
    for k, i in enumerate(tree_requests):
        n = parent_rows[i].numel()
        parent_padded[k, :n] = parent_rows[i]
        num_nodes[k] = n
    set_graph_mask(TreeMask(
        request_index=torch.tensor(tree_requests, dtype=torch.int64),
        tree_base=torch.from_numpy(tree_base[tree_requests].astype(np.int32)),
        ancestor_words=ancestor_words_from_parents(parent_padded, num_nodes),
        query_tree_row=torch.from_numpy(query_tree_row),
    ))


def _target_kv_caches(runner) -> list[torch.Tensor]:
    if runner._gsd_target_kv_caches is None:
        draft_layers = getattr(runner.drafter, "_draft_attn_layer_names", set())
        forward_context = runner.compilation_config.static_forward_context
        caches, seen = [], set()
        for name, layer in forward_context.items():
            kv_cache = getattr(layer, "kv_cache", None)
            if name in draft_layers or not isinstance(kv_cache, torch.Tensor) or kv_cache.numel() == 0:
                continue
            if kv_cache.data_ptr() not in seen:  # KV-sharing layers alias one tensor
                seen.add(kv_cache.data_ptr())
                caches.append(kv_cache)
        runner._gsd_target_kv_caches = caches
    return runner._gsd_target_kv_caches


def _compact_target_kv(runner, accepted) -> None:
    """Move each request's accepted nodes' KV to consecutive positions after its root."""
    from vllm_gsd.kernels.kv_compaction import compact_kv, compact_kv_ref

    step: VerifyStep = runner.rejection_sampler.verify_step
    num_accepted = accepted.num_accepted
    if int(num_accepted.max()) == 0:
        return
    gid = runner.drafter.kv_cache_gid if runner.drafter.kv_cache_gid >= 0 else 0
    block_table = runner.input_batch.block_table[gid]
    table = block_table.get_device_tensor(runner.input_batch.num_reqs)
    tree_base = torch.from_numpy(step.tree_base.astype(np.int32)).to(table.device)
    on_cpu = table.device.type == "cpu"
    compact = compact_kv_ref if on_cpu else compact_kv
    compact(_target_kv_caches(runner), table, block_table.block_size, tree_base,
            accepted.accepted_rows, num_accepted, layout="cpu" if on_cpu else "gpu_bhnc")
