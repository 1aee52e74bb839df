"""What the drafter reads of the model runner's batch in one step, handed over as arrays.

`DraftBatch.of(runner, kv_cache_gid)` is where the drafter reads the runner's input batch and
request states; the jobs of a step take the DraftBatch, not the runner. The arrays are the
runner's own (no copies): valid for the step they were read in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class DraftBatch:
    """The runner's batch, B requests in its order."""

    req_ids: list[str]  # [B]
    num_computed_tokens: np.ndarray  # int32 [>= B]: tokens with KV before this step
    num_tokens_no_spec: np.ndarray  # int32 [>= B]: the request's tokens, drafts left out
    token_ids: np.ndarray  # int32 [>= B, max_model_len]: each request's tokens (columns past them stale)
    sampling_params: list[Any]  # [B] vLLM SamplingParams (None: a pooling request)
    num_output_tokens: list[int]  # [B]: tokens generated so far
    block_table: Any  # the vLLM BlockTable of the draft's KV cache group
    max_model_len: int  # the target's context limit

    @classmethod
    def of(cls, runner, kv_cache_gid: int) -> DraftBatch:
        batch = runner.input_batch
        req_ids = list(batch.req_ids[:batch.num_reqs])
        states = [runner.requests[req_id] for req_id in req_ids]
        return cls(req_ids, batch.num_computed_tokens_cpu, batch.num_tokens_no_spec, batch.token_ids_cpu,
                   [state.sampling_params for state in states], [len(state.output_token_ids) for state in states],
                   batch.block_table[kv_cache_gid], runner.max_model_len)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def prompt_and_output(self, batch_row: int) -> tuple[np.ndarray, np.ndarray]:
        """The request's prompt tokens and its committed output (views, drafts left out)."""
        num_tokens = int(self.num_tokens_no_spec[batch_row])
        num_prompt = num_tokens - self.num_output_tokens[batch_row]
        tokens = self.token_ids[batch_row]
        return tokens[:num_prompt], tokens[num_prompt:num_tokens]

    def block_ids(self, batch_row: int) -> np.ndarray:
        """int32 [num blocks]: the KV blocks allocated to the request at `batch_row`."""
        return self.block_table.block_table.np[batch_row, :self.block_table.num_blocks_per_row[batch_row]]
