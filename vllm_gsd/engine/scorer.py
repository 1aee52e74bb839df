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

The result carries the accepted rows too (`TreeSamplerOutput.accepted`): the runner hook moves
the accepted nodes' KV to consecutive positions (engine/runner_hooks.py). Vocabulary-sized float
copies are made in row chunks of at most MAX_CHUNK_BYTES.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler

from vllm_gsd.engine.tree_batch import TreeSpecDecodeMetadata, chain_trees
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


@dataclass
class TreeSamplerOutput(SamplerOutput):
    """vLLM's SamplerOutput plus the accepted paths (rows), which the runner hook needs to
    compact the KV cache and count what was accepted."""

    accepted: AcceptedPaths | None = None


# The most bytes one float32 copy of vocabulary-sized rows may take in the scorer: rows are
# processed in chunks of at most this size (vLLM's memory profile runs the largest chunk).
MAX_CHUNK_BYTES = 256 << 20


def rows_per_chunk(vocab_size: int) -> int:
    return max(1, MAX_CHUNK_BYTES // (4 * vocab_size))


class GsdRejectionSampler(RejectionSampler):
    """Scores the step's trees; nothing else (the runner hook compacts the KV cache).

    `metadata` is a TreeSpecDecodeMetadata carrying the step's TreeBatch (engine/tree_batch.py);
    vLLM's own SpecDecodeMetadata (its dummy sampler runs) is scored as chains of its draft
    tokens, with unseeded draws.
    """

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> TreeSamplerOutput:
        tree = metadata.tree if isinstance(metadata, TreeSpecDecodeMetadata) else None
        num_draft = list(metadata.num_draft_tokens)
        batch_size = len(num_draft)
        max_nodes = max(num_draft)
        rows_per_request = torch.tensor(num_draft, dtype=torch.int64) + 1
        row_start = torch.cumsum(rows_per_request, 0) - rows_per_request
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
            if tree is not None:
                parent_row, depth = tree.parent_row[:, :max_nodes], tree.depth[:, :max_nodes]
            else:
                parent_row, depth = chain_trees(num_draft)
            self._fill_node_rows(row_target, logits, num_draft, row_start, depth, tree, sampling_metadata)
            draft_token_ids = torch.full((batch_size, max_nodes), -1, dtype=torch.int64, device=device)
            valid = torch.arange(max_nodes)[None, :] < rows_per_request[:, None] - 1
            draft_token_ids[valid.to(device)] = metadata.draft_token_ids.to(device, torch.int64)
            accepted = walk_tree(draft_token_ids, parent_row.to(device),
                                 torch.tensor(num_draft, dtype=torch.int64, device=device), row_target)
        else:  # a plain step (no trees): every request emits its root token
            accepted = AcceptedPaths(torch.zeros_like(row_target), row_target,
                                     torch.zeros(batch_size, dtype=torch.int64, device=device))
        logprobs_tensors = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs_tensors = self._path_logprobs(logits, row_start, accepted,
                                                   sampling_metadata.max_num_logprobs)
        return TreeSamplerOutput(
            sampled_token_ids=accepted.output_token_ids.to(torch.int32),
            logprobs_tensors=logprobs_tensors,
            accepted=accepted,
        )

    # --------------------------------------------------------------------------------------

    def _fill_node_rows(self, row_target, logits, num_draft, row_start, depth, tree, sampling_metadata):
        """The target's token at rows 1..n of every request with a tree.

        Greedy: vLLM's greedy argmax. Random: every row draws from its processed distribution
        by inverse CDF; a seeded request's uniform is keyed by the absolute position of the
        token drawn (graph/counter_rng.py), so its text does not depend on the trees or the
        batch; others use the global generator. Rows are processed in chunks (MAX_CHUNK_BYTES).
        """
        device = logits.device
        counts = torch.tensor(num_draft, dtype=torch.int64)
        request_of_row = torch.repeat_interleave(torch.arange(len(num_draft)), counts + 1)
        local_row = torch.arange(logits.shape[0]) - row_start[request_of_row]
        has_tree = counts[request_of_row] > 0
        if sampling_metadata.all_greedy:
            is_random = torch.zeros_like(has_tree)
        else:
            is_random = (sampling_metadata.temperature.cpu() >= _SAMPLING_EPS)[request_of_row]
        greedy_rows = torch.nonzero(has_tree & ~is_random & (local_row > 0)).squeeze(1)
        random_rows = torch.nonzero(has_tree & is_random).squeeze(1)  # row 0 included: it is keyed too
        if greedy_rows.numel():
            tokens = logits[greedy_rows.to(device)].argmax(dim=-1)  # vLLM's greedy pick, no fp32 copy
            row_target[request_of_row[greedy_rows].to(device), local_row[greedy_rows].to(device)] = tokens
        if not random_rows.numel():
            return
        uniforms = self._row_uniforms(random_rows, request_of_row, local_row, depth, tree)
        requests = request_of_row[random_rows]
        top_k, top_p = sampling_metadata.top_k, sampling_metadata.top_p
        chunk = rows_per_chunk(logits.shape[-1])
        for lo in range(0, random_rows.numel(), chunk):
            rows, req = random_rows[lo:lo + chunk].to(device), requests[lo:lo + chunk].to(device)
            # A copy: `logits` stays raw for the logprobs of the accepted path.
            drawn = draw_processed(
                logits[rows].to(torch.float32), sampling_metadata.temperature[req],
                None if top_k is None else top_k[req], None if top_p is None else top_p[req],
                uniforms[lo:lo + chunk].to(device))
            row_target[req, local_row[random_rows[lo:lo + chunk]].to(device)] = drawn

    @staticmethod
    def _row_uniforms(rows, request_of_row, local_row, depth, tree) -> torch.Tensor:
        """float64 [len(rows)]: a seeded request's row r samples the token at absolute
        position tree_base + depth(r) + 1 with u(seed, position); other rows draw fresh."""
        uniforms = torch.rand(rows.numel(), dtype=torch.float64)
        if tree is None:
            return uniforms
        request, local = request_of_row[rows], local_row[rows]
        row_depth = torch.where(local > 0, depth[request, (local - 1).clamp(min=0)], 0)
        seeded = [b for b in range(len(tree.seed)) if tree.seed[b] is not None]
        for b in seeded:
            mine = torch.nonzero(request == b).squeeze(1)
            positions = tree.tree_base[b] + row_depth[mine].numpy() + 1
            uniforms[mine] = torch.from_numpy(counter_uniforms(tree.seed[b], positions))
        return uniforms

    def _path_logprobs(self, logits, row_start, accepted: AcceptedPaths, max_num_logprobs):
        """Raw logprobs of every emitted token, from the row that predicted it."""
        rows = accepted.accepted_rows.clamp(min=0) + row_start.to(logits.device)[:, None]
        row_logits = logits[rows.flatten()].to(torch.float32)
        tokens = accepted.output_token_ids.flatten().clamp(min=0)
        logprobs = self.sampler.compute_logprobs(row_logits)
        if max_num_logprobs == -1:
            return LogprobsTensors(torch.empty(0), logprobs, torch.empty(0))
        return self.sampler.gather_logprobs(logprobs, max_num_logprobs, tokens)
