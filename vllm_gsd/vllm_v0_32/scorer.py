"""Tree verification in vLLM 0.32's rejection-sampler and sampler slots.

`GsdRejectionSampler.forward(metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput`
keeps vLLM's contract: `logits` holds, per request, its `n + 1` verification rows (root, then the
n tree nodes in breadth-first order), and the result's `sampled_token_ids` is
`[batch, max_spec_len + 1]`: the accepted path's tokens and then one token of the target, -1
padded. The scheduler's rollback and every speculative-decoding metric work unchanged.

Row 0 of every request is vLLM's own Sampler on the root rows of the whole batch (in a gsd engine
`GsdSampler`, below); the walk over the other rows is engine/scorer.py's (`score_trees`), and the
logprobs along the accepted path are vLLM's Sampler's.

The result carries the accepted rows too (`TreeSamplerOutput.accepted`): the runner hook moves
the accepted nodes' KV to consecutive positions (vllm_v0_32/runner/sampling_hooks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from vllm.utils.platform_utils import is_pin_memory_available
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler

from vllm_gsd.engine.sampling import processed_scores
from vllm_gsd.engine.scorer import KeyedRoots, score_trees
from vllm_gsd.engine.staging import HostStaging
from vllm_gsd.graph import AcceptedPaths
from vllm_gsd.graph.gumbel import gumbel_argmax, gumbel_noise
from vllm_gsd.vllm_v0_32.spec_decode import TreeSpecDecodeMetadata
from vllm_gsd.vllm_v0_32.thinking_budget import as_next_token_rows


class _Staged:
    """A sampler's host arrays reach the logits' device through one pinned staging
    (engine/staging.py), made for the first device it sees."""

    _staging: HostStaging | None = None

    def staging(self, device: torch.device) -> HostStaging:
        if self._staging is None or self._staging.device != device:
            self._staging = HostStaging(device, is_pin_memory_available())
        return self._staging


class GsdSampler(_Staged, Sampler):
    """vLLM's Sampler, except that the rows in `keyed` are the Gumbel-max draws of
    engine/sampling.py, as tree rows are: a sampled request draws the same token at a position
    whether a tree verified it or not. Logprobs follow the token drawn (vLLM gathers them after
    `sample`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.keyed: KeyedRoots | None = None

    def forward(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
        # Every row this sampler sees is one request's next token (a plain step's rows, or the
        # roots of a tree step), as without speculation; the thinking budget's state is told so.
        if sampling_metadata.thinking_budget_state_holder is not None:
            as_next_token_rows(sampling_metadata.thinking_budget_state_holder)
        return super().forward(logits, sampling_metadata, predict_bonus_token=False,
                               logprobs_mode_override=logprobs_mode_override)

    def sample(self, logits, sampling_metadata, logprobs_mode_override=None):
        keyed = self.keyed
        if keyed is None or not keyed.rows or max(keyed.rows) >= logits.shape[0]:
            return super().sample(logits, sampling_metadata, logprobs_mode_override)
        min_p = np.asarray(keyed.min_p, dtype=np.float64)
        rows, min_p_rows = self.staging(logits.device).stage([np.asarray(keyed.rows), min_p])
        top_k, top_p = sampling_metadata.top_k, sampling_metadata.top_p
        # Before vLLM's sampler, which processes the logits in place.
        min_p = min_p_rows.to(torch.float32) if min_p.any() else None
        scores = processed_scores(logits[rows], sampling_metadata.temperature[rows],
                                  None if top_k is None else top_k[rows], None if top_p is None else top_p[rows],
                                  min_p)
        sampled, processed_logprobs = super().sample(logits, sampling_metadata, logprobs_mode_override)
        noise = gumbel_noise(np.asarray(keyed.keys), np.asarray(keyed.positions), logits.shape[-1], logits.device)
        sampled[rows] = gumbel_argmax(scores, noise).to(sampled.dtype)
        return sampled, processed_logprobs


@dataclass
class TreeSamplerOutput(SamplerOutput):
    """vLLM's SamplerOutput plus the accepted paths (rows), which the runner hook needs to
    compact the KV cache and count what was accepted."""

    accepted: AcceptedPaths | None = None


class GsdRejectionSampler(_Staged, RejectionSampler):
    """Scores the step's trees; nothing else (the runner hook compacts the KV cache).

    `metadata` is a TreeSpecDecodeMetadata (spec_decode.py) carrying the step's TreeBatch
    (engine/tree_batch.py); vLLM's own SpecDecodeMetadata (its dummy sampler runs) is scored as
    chains of its draft tokens, with fresh noise.
    """

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> TreeSamplerOutput:
        tree = metadata.tree if isinstance(metadata, TreeSpecDecodeMetadata) else None
        num_draft = list(metadata.num_draft_tokens)
        rows_per_request = torch.tensor(num_draft, dtype=torch.int64) + 1
        row_start = torch.cumsum(rows_per_request, 0) - rows_per_request
        device = logits.device
        staging = self.staging(device)
        (root_rows,) = staging.stage([row_start.numpy()])  # row_start on the device

        # Row 0 of every request: vLLM's sampler, exactly as without speculation. Its history is
        # the committed output: vLLM would append the step's draft tokens for penalties and bad
        # words (its bonus row comes after a chain), which the root precedes.
        root_output = self.sampler(
            logits=logits[root_rows],
            sampling_metadata=replace(sampling_metadata, max_num_logprobs=None,
                                      logprob_token_ids=None, spec_token_ids=None),
        )
        accepted = score_trees(root_output.sampled_token_ids[:, 0].long(), logits, num_draft, row_start, tree,
                               metadata.draft_token_ids, sampling_metadata, staging)
        logprobs_tensors = None
        if sampling_metadata.max_num_logprobs is not None or sampling_metadata.logprob_token_ids:
            logprobs_tensors = self._path_logprobs(logits, root_rows, accepted, sampling_metadata)
        return TreeSamplerOutput(
            sampled_token_ids=accepted.output_token_ids.to(torch.int32),
            logprobs_tensors=logprobs_tensors,
            accepted=accepted,
        )

    def _path_logprobs(self, logits, root_rows, accepted: AcceptedPaths, sampling_metadata):
        """Raw logprobs of every emitted token, from the row that predicted it, as vLLM's Sampler
        reports them: the top `max_num_logprobs`, or, where any request names
        `logprob_token_ids`, those ids (vLLM prefers them over top-k for the whole batch)."""
        rows = accepted.accepted_rows.clamp(min=0) + root_rows[:, None]
        row_logits = logits[rows.flatten()].to(torch.float32)
        tokens = accepted.output_token_ids.flatten().clamp(min=0)
        logprobs = self.sampler.compute_logprobs(row_logits)
        if sampling_metadata.logprob_token_ids:
            # Output rows are [batch, 1 + max_nodes], flattened: request b's at b * width + j.
            width = accepted.output_token_ids.shape[1]
            ids_of_row = {b * width + j: ids for b, ids in sampling_metadata.logprob_token_ids.items()
                          for j in range(width)}
            return self.sampler.gather_specific_token_logprobs(logprobs, ids_of_row, tokens)
        if sampling_metadata.max_num_logprobs == -1:
            return LogprobsTensors(torch.empty(0), logprobs, torch.empty(0))
        return self.sampler.gather_logprobs(logprobs, sampling_metadata.max_num_logprobs, tokens)
