"""One step of a gsd runner up to its target forward: the wrappers that vllm_v0_32/patches.py
installs.

* `_prepare_inputs` (after vLLM's): the step's trees become one `TreeBatch`
  (engine/tree_batch.py): every request whose scheduled draft tokens are a proposed tree gets
  its node rows re-rotated to tree_base + depth (their KV slots stay tree_base + row); draft
  tokens that match no proposed tree (e.g. after a preemption) are verified as a chain, which is
  also a tree. The TreeBatch rides to the scorer in the spec-decode metadata
  (`TreeSpecDecodeMetadata`, vllm_v0_32/spec_decode.py), and its attention inputs to the layers
  through the runner's `TreeSlot`, held while `_build_attention_metadata` builds this forward's
  metadata. A step without drafts drops the metadata (vLLM 0.32 builds it for every step of a
  speculative engine), so it is sampled as without speculation. The sampler is GsdSampler, told
  each step which roots are drawn with keyed noise (engine/sampling.py); a partial prefill's
  discarded row leaves its request's generator alone.
* `execute_model`: the target forward is timed for the cost scales and the metrics by a
  `StepTimer` (engine/cost_calibration.py): on the host as it ends; on CUDA by events read at
  the next step's start, when the stream has passed them, so that no step waits for the device
  to time it (the cost model's scales then learn each forward's time a step later).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from vllm_gsd.engine.cost_calibration import StepTimer
from vllm_gsd.engine.eligibility import tree_refusal_reason
from vllm_gsd.engine.node_processing import RequestOptions, options_of
from vllm_gsd.engine.sampling import is_sampled, noise_key
from vllm_gsd.engine.tree_batch import TreeBatch, build_tree_batch, chain_trees
from vllm_gsd.vllm_v0_32.runner.state import is_gsd_runner
from vllm_gsd.vllm_v0_32.spec_decode import TreeSpecDecodeMetadata
from vllm_gsd.vllm_v0_32.thinking_budget import PathThinking


def wrap_prepare_inputs(original):
    @functools.wraps(original)
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        logits_indices, spec_decode_metadata, *rest = original(self, scheduler_output, num_scheduled_tokens)
        if not is_gsd_runner(self):
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
        if not is_gsd_runner(self) or self.gsd.pending_attention is None:
            return original(self, *args, **kwargs)
        tree, self.gsd.pending_attention = self.gsd.pending_attention, None
        with self.gsd.tree_slot.holding(tree):
            return original(self, *args, **kwargs)

    return _build_attention_metadata


def wrap_execute_model(original):
    @functools.wraps(original)
    def execute_model(self, scheduler_output, *args, **kwargs):
        if not is_gsd_runner(self):
            return original(self, scheduler_output, *args, **kwargs)
        timer = _target_timer(self)
        self.gsd.metrics.begin_step(scheduler_output)
        timer.start()
        _record_target_forwards(self, timer)  # on CUDA: the last step's (its events passed by now)
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            self.gsd.pending_attention = None
            timer.stop(_TargetForward(scheduler_output.total_num_scheduled_tokens,
                                      bool(scheduler_output.scheduled_spec_decode_tokens),
                                      self.gsd.metrics.decode_step))
            _record_target_forwards(self, timer)  # on the host: this one's

    return execute_model


@dataclass(frozen=True)
class _TargetForward:
    num_tokens: int
    verified_trees: bool
    decode_step: bool


def _target_timer(runner) -> StepTimer:
    """The runner's StepTimer of its target forwards (made on first use)."""
    timer = runner.__dict__.get("_gsd_target_timer")
    if timer is None:
        timer = runner._gsd_target_timer = StepTimer.for_device(runner.device)
    return timer


def _record_target_forwards(runner, timer: StepTimer) -> None:
    """Feed the forwards whose time is known to the metrics and the adaptive budget."""
    for forward, seconds in timer.finished():
        runner.gsd.metrics.add(decode_step=forward.decode_step, target_forward_us=int(seconds * 1e6))
        runner.drafter.record_target_forward(forward.num_tokens, seconds, forward.verified_trees)


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
    draft_token_ids = torch.full(parent_row.shape, -1, dtype=torch.int64)
    tree_base = np.zeros(num_reqs, dtype=np.int64)
    keys: list[int | None] = [None] * num_reqs
    options: list[RequestOptions | None] = [None] * num_reqs
    rotated_rows, rotated_positions = [], []
    for req_id, draft_tokens in scheduler_output.scheduled_spec_decode_tokens.items():
        num_nodes = len(draft_tokens)
        if num_nodes == 0:
            continue
        i = batch.req_id_to_index[req_id]
        draft_token_ids[i, :num_nodes] = torch.as_tensor(list(draft_tokens), dtype=torch.int64)
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
        thinking = PathThinking.of(batch.thinking_budget_state_holder, i, state.output_token_ids)
        options[i] = options_of(params, state.prompt_token_ids, state.output_token_ids, thinking)
    if rotated_rows:  # one copy for the whole batch, rows and positions together
        rows_and_positions = np.stack([np.concatenate(rotated_rows), np.concatenate(rotated_positions)])
        rows, positions = _to_device(rows_and_positions, runner.positions.device)
        runner.positions[rows] = positions
    return build_tree_batch(parent_row, depth, torch.tensor(num_draft, dtype=torch.int64), tree_base,
                            via_merge, keys, query_start_loc, runner.device, options, draft_token_ids)


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device without making the host wait: on CUDA through pinned memory
    (PyTorch's host allocator keeps the block until the copy is done), non-blocking."""
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
