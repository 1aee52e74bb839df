"""Tree verification in vLLM's rejection-sampler slot.

`GsdRejectionSampler.forward(metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput`
keeps vLLM's contract: `logits` holds, per request, its `n + 1` verification rows (root, then the
n tree nodes in breadth-first order), and the result's `sampled_token_ids` is
`[batch, max_spec_len + 1]`: the accepted path's tokens and then one token of the target, -1
padded. The scheduler's rollback and every speculative-decoding metric work unchanged.

The target's token at every row:
* row 0 (the root): vLLM's own Sampler, on the root rows of the whole batch, so requests without
  a tree (and their penalties, processors, seeds) are sampled exactly as without speculation;
* rows >= 1 of a greedy request: the same greedy argmax vLLM uses;
* rows >= 1 of a random request: a draw from the row's distribution after temperature, top-k and
  top-p (vLLM's `apply_sampling_constraints`), with uniforms from the request's own generator.
The walk (vllm_gsd.graph.walk_tree) follows the child equal to the row's token, or emits it and
stops. Every emitted token is thus the target's own choice (greedy) or a real draw from the
target's distribution (sampling) given its accepted prefix: exact, for any tree.

After the walk, the accepted nodes' KV in every target layer moves from KV position
tree_base + row to tree_base + k (vllm_gsd.kernels.kv_compaction), so the cache is linear again.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.rejection_sampler import (
    RejectionSampler,
    apply_sampling_constraints,
    generate_uniform_probs,
)
from vllm.v1.sample.sampler import Sampler

from vllm_gsd.graph import AcceptedPaths, sample_rows, walk_tree

_SAMPLING_EPS = 1e-5


class GsdRejectionSampler(RejectionSampler):
    """Set `verify_step` (engine/runner_hooks.py) and `compact_kv` before each forward."""

    def __init__(self, sampler, spec_config, device, **kwargs):
        super().__init__(sampler, spec_config, device, **kwargs)
        self.verify_step = None  # set by the runner hook for the step being verified
        self.compact_kv = None  # callable(tree_base, accepted_rows, num_accepted, batch_rows)
        self.last_accepted: AcceptedPaths | None = None
        self.metrics = None  # engine.metrics.GsdMetrics of the worker

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        num_draft = list(metadata.num_draft_tokens)
        batch_size = len(num_draft)
        max_nodes = max(num_draft)
        rows_per_request = torch.tensor(num_draft, dtype=torch.int64) + 1
        row_end = torch.cumsum(rows_per_request, 0)
        row_start = row_end - rows_per_request
        device = logits.device

        # Row 0 of every request: vLLM's sampler, exactly as without speculation.
        root_output = self.sampler(
            logits=logits[row_start.to(device)],
            sampling_metadata=replace(sampling_metadata, max_num_logprobs=None,
                                      logprob_token_ids=None),
        )
        row_target = torch.full((batch_size, max_nodes + 1), -1, dtype=torch.int64, device=device)
        row_target[:, 0] = root_output.sampled_token_ids[:, 0].long()

        if max_nodes > 0:
            self._fill_node_rows(row_target, logits, num_draft, row_start, sampling_metadata)

        draft_token_ids, parent_row = self._tree_tensors(metadata, num_draft, max_nodes, device)
        accepted = walk_tree(draft_token_ids, parent_row,
                             torch.tensor(num_draft, dtype=torch.int64, device=device), row_target)
        self.last_accepted = accepted
        if self.metrics is not None and max_nodes > 0:
            self._count(num_draft, accepted)
        if self.compact_kv is not None and max_nodes > 0:
            self.compact_kv(accepted)

        logprobs_tensors = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs_tensors = self._path_logprobs(logits, row_start, accepted,
                                                   sampling_metadata.max_num_logprobs)
        return SamplerOutput(
            sampled_token_ids=accepted.output_token_ids.to(torch.int32),
            logprobs_tensors=logprobs_tensors,
        )

    # --------------------------------------------------------------------------------------

    def _fill_node_rows(self, row_target, logits, num_draft, row_start, sampling_metadata):
        """Target token at rows 1..n of every request (greedy argmax, or a seeded draw)."""
        device = logits.device
        batch_size = len(num_draft)
        total_rows = logits.shape[0]
        request_of_row = torch.repeat_interleave(
            torch.arange(batch_size), torch.tensor(num_draft) + 1).to(device)
        local_row = torch.arange(total_rows, device=device) - row_start.to(device)[request_of_row]
        node_rows = local_row > 0

        row_logits = logits.to(torch.float32)
        token = Sampler.greedy_sample(row_logits.clone())  # what vLLM's greedy sampler picks
        if not sampling_metadata.all_greedy:
            cu_rows = torch.cumsum(torch.tensor(num_draft, device=device) + 1, 0)
            processed = apply_sampling_constraints(row_logits.clone(), cu_rows, sampling_metadata)
            uniforms = generate_uniform_probs(total_rows, [n + 1 for n in num_draft],
                                              sampling_metadata.generators, device)
            drawn = sample_rows(torch.softmax(processed, dim=-1), uniforms)
            temperature = sampling_metadata.temperature.to(device)[request_of_row]
            token = torch.where(temperature < _SAMPLING_EPS, token.long(), drawn)
        row_target[request_of_row[node_rows], local_row[node_rows]] = token[node_rows].long()

    def _count(self, num_draft, accepted: AcceptedPaths) -> None:
        step = self.verify_step
        num_accepted = accepted.num_accepted.tolist()
        trees = [b for b, n in enumerate(num_draft) if n]
        through_merge = 0
        for b in trees:
            via_merge = step.via_merge[b] if step is not None else None
            a = num_accepted[b]
            if via_merge is not None and a:
                path = accepted.accepted_rows[b, 1:a + 1].cpu() - 1
                through_merge += bool(via_merge[path].any())
        self.metrics.add(trees_verified=len(trees), nodes_verified=sum(num_draft),
                         accepted_nodes=sum(num_accepted[b] for b in trees),
                         paths_through_merge=through_merge)

    def _tree_tensors(self, metadata, num_draft, max_nodes, device):
        """Padded [B, max_nodes] node tokens and parent rows of this step's trees."""
        batch_size = len(num_draft)
        draft_token_ids = torch.full((batch_size, max_nodes), -1, dtype=torch.int64, device=device)
        parent_row = torch.full((batch_size, max_nodes), -1, dtype=torch.int64, device=device)
        if max_nodes == 0:
            return draft_token_ids, parent_row
        counts = torch.tensor(num_draft, device=device)
        valid = torch.arange(max_nodes, device=device)[None, :] < counts[:, None]
        draft_token_ids[valid] = metadata.draft_token_ids.to(device, torch.int64)
        step = self.verify_step
        for b, n in enumerate(num_draft):
            if n:
                parent_row[b, :n] = step.parent_row[b][:n].to(device)
        return draft_token_ids, parent_row

    def _path_logprobs(self, logits, row_start, accepted: AcceptedPaths, max_num_logprobs):
        """Raw logprobs of every emitted token, from the row that predicted it."""
        rows = accepted.accepted_rows.clamp(min=0) + row_start.to(logits.device)[:, None]
        row_logits = logits[rows.flatten()].to(torch.float32)
        tokens = accepted.output_token_ids.flatten().clamp(min=0)
        logprobs = self.sampler.compute_logprobs(row_logits)
        if max_num_logprobs == -1:
            return LogprobsTensors(torch.empty(0), logprobs, torch.empty(0))
        return self.sampler.gather_logprobs(logprobs, max_num_logprobs, tokens)
