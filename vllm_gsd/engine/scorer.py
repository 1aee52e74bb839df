"""Tree verification in vLLM's rejection-sampler slot.

`GsdRejectionSampler.forward(metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput`
keeps vLLM's contract: `logits` holds, per request, its `n + 1` verification rows (root, then the
n tree nodes in breadth-first order), and the result's `sampled_token_ids` is
`[batch, max_spec_len + 1]`: the accepted path's tokens and then one token of the target, -1
padded. The scheduler's rollback and every speculative-decoding metric work unchanged.

The target's token at every row:
* row 0 (the root): vLLM's own Sampler, on the root rows of the whole batch, so requests without
  a tree (and their penalties, processors) are sampled exactly as without speculation; in a gsd
  engine that Sampler is `GsdSampler`, which draws the root of a seeded request that the tree
  path serves (engine/eligibility.py) keyed by position, tree or not (see below);
* rows >= 1 of a greedy request: the same greedy argmax vLLM uses;
* every row of a random request with a tree: a draw from the row's distribution after
  temperature, top-k and top-p (vLLM's `apply_top_k_top_p`); a seeded request's uniforms are keyed
  by the position of the token drawn, so its text is the same in any batch.
A seeded request thus draws every token, tree row or root, from u(seed, position): its text is
the same whether a step had a tree, a tree cut short by the token budget, or none (preemption,
the context limit, a batch of prefills), i.e. the same in any batch.
The walk (vllm_gsd.graph.walk_tree) follows the child equal to the row's token, or emits it and
stops. Every emitted token is thus the target's own choice (greedy) or a real draw from the
target's distribution (sampling) given its accepted prefix: exact, for any tree.

After the walk, the accepted nodes' KV in every target layer moves from KV position
tree_base + row to tree_base + k (vllm_gsd.kernels.kv_compaction), so the cache is linear again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler

from vllm_gsd.graph import AcceptedPaths, sample_rows, walk_tree
from vllm_gsd.graph.counter_rng import counter_uniforms

_SAMPLING_EPS = 1e-5


def draw_processed(row_logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                   top_p: torch.Tensor | None, uniforms: torch.Tensor) -> torch.Tensor:
    """int64 [R]: an inverse-CDF draw per row from its distribution after temperature, then
    top-k / top-p (vLLM's processing of draft rows).

    row_logits: float32 [R, V], processed in place; temperature float [R] (rows under epsilon are
    divided by 1: the caller takes their greedy token); top_k, top_p [R] or None; uniforms [R].
    """
    is_greedy = temperature < _SAMPLING_EPS
    processed = row_logits.div_(torch.where(is_greedy, 1.0, temperature).unsqueeze(-1))
    processed = apply_top_k_top_p(processed, top_k, top_p)
    return sample_rows(torch.softmax(processed, dim=-1), uniforms)


@dataclass
class KeyedRoots:
    """This step's root rows drawn from u(seed, position) (set by engine/runner_hooks.py)."""

    rows: list[int]  # batch index of each seeded, random request the tree path serves
    seeds: list[int]
    positions: list[int]  # absolute position of the token each row samples


class GsdSampler(Sampler):
    """vLLM's Sampler, except that the rows in `keyed` are drawn by `draw_processed` from
    u(seed, position), as tree rows are: a seeded request then samples the same token at a
    position whether a tree verified it or not. Logprobs follow the token drawn (vLLM gathers
    them after `sample`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.keyed: KeyedRoots | None = None

    def sample(self, logits, sampling_metadata, logprobs_mode_override=None):
        keyed = self.keyed
        if keyed is None or not keyed.rows or max(keyed.rows) >= logits.shape[0]:
            return super().sample(logits, sampling_metadata, logprobs_mode_override)
        rows = torch.tensor(keyed.rows, dtype=torch.int64, device=logits.device)
        keyed_logits = logits[rows].to(torch.float32)  # a copy: vLLM processes logits in place
        sampled, processed_logprobs = super().sample(logits, sampling_metadata, logprobs_mode_override)
        top_k, top_p = sampling_metadata.top_k, sampling_metadata.top_p
        uniforms = torch.from_numpy(counter_uniforms(np.asarray(keyed.seeds), np.asarray(keyed.positions)))
        sampled[rows] = draw_processed(
            keyed_logits, sampling_metadata.temperature[rows],
            None if top_k is None else top_k[rows], None if top_p is None else top_p[rows],
            uniforms.to(logits.device)).to(sampled.dtype)
        return sampled, processed_logprobs


class GsdRejectionSampler(RejectionSampler):
    """Set `verify_step` (engine/runner_hooks.py) and `compact_kv` before each forward."""

    def __init__(self, sampler, spec_config, device, **kwargs):
        super().__init__(sampler, spec_config, device, **kwargs)
        self.verify_step = None  # set by the runner hook for the step being verified
        self.compact_kv = None  # callable(tree_base, accepted_rows, num_accepted, batch_rows)
        self.last_accepted: AcceptedPaths | None = None
        self.metrics = None  # engine.metrics.GsdMetrics of the worker

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        started = time.perf_counter()
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
        else:  # a plain step (no trees): every request emits its root token
            accepted = AcceptedPaths(torch.zeros_like(row_target), row_target,
                                     torch.zeros(batch_size, dtype=torch.int64, device=device))
        self.last_accepted = accepted
        if self.metrics is not None and max_nodes > 0:
            self._count(num_draft, accepted)
        walked = time.perf_counter()
        if self.compact_kv is not None and max_nodes > 0:
            self.compact_kv(accepted)
        if self.metrics is not None:
            self.metrics.add(verify_us=int((walked - started) * 1e6),
                             kv_compaction_us=int((time.perf_counter() - walked) * 1e6))

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
        """The target's token at the rows of every request with a tree.

        Greedy: vLLM's greedy argmax at rows 1..n (row 0 came from vLLM's sampler). Random: every
        row 0..n draws from its processed distribution by inverse CDF; a seeded request's uniform
        is keyed by the absolute position of the token drawn (graph/counter_rng.py), so its text
        does not depend on the trees or the batch; others use the global generator.
        """
        device = logits.device
        batch_size = len(num_draft)
        total_rows = logits.shape[0]
        request_of_row = torch.repeat_interleave(
            torch.arange(batch_size), torch.tensor(num_draft) + 1).to(device)
        local_row = torch.arange(total_rows, device=device) - row_start.to(device)[request_of_row]
        has_tree = (torch.tensor(num_draft) > 0).to(device)[request_of_row]

        token = Sampler.greedy_sample(logits.to(torch.float32)).long()  # vLLM's greedy pick
        fill = has_tree & (local_row > 0)
        if not sampling_metadata.all_greedy:
            # vLLM's processing of draft rows (temperature, then top-k/top-p), with the per-row
            # expansion done here: vLLM's CPU expand kernel mishandles int32 inputs and its
            # Triton one stops at 128 rows per request.
            temperature = sampling_metadata.temperature.to(device)[request_of_row]
            is_greedy = temperature < _SAMPLING_EPS
            top_k = None if sampling_metadata.top_k is None else sampling_metadata.top_k[request_of_row]
            top_p = None if sampling_metadata.top_p is None else sampling_metadata.top_p[request_of_row]
            # A copy: `logits` stays raw for the logprobs of the accepted path.
            drawn = draw_processed(logits.to(torch.float32, copy=True), temperature, top_k, top_p,
                                   self._row_uniforms(num_draft, device))
            token = torch.where(is_greedy, token, drawn)
            fill = fill | (has_tree & ~is_greedy)
        row_target[request_of_row[fill], local_row[fill]] = token[fill]

    def _row_uniforms(self, num_draft, device) -> torch.Tensor:
        """float64 [total rows]: uniforms for every verification row of the batch."""
        step = self.verify_step
        uniforms = torch.rand(sum(n + 1 for n in num_draft), dtype=torch.float64)
        start = 0
        for b, n in enumerate(num_draft):
            seed = step.seed[b] if step is not None else None
            if n and seed is not None:
                # Row r samples the token at absolute position tree_base + depth(r) + 1.
                depth = np.concatenate([[0], step.depth[b][:n].numpy()])
                positions = step.tree_base[b] + depth + 1
                uniforms[start:start + n + 1] = torch.from_numpy(counter_uniforms(seed, positions))
            start += n + 1
        return uniforms.to(device)

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
