"""The memory a tree step needs beyond vLLM's own, allocated in vLLM's profile run.

vLLM sizes the KV cache from the peak memory of its profile run (`profile_run`: a dummy forward
over max_num_batched_tokens, then a dummy sampler run over one row per request). A gsd step
needs more than that run touches:
* the target's logits for every verified row, B x (1 + N) rows (up to max_num_batched_tokens)
  x the vocabulary, where vLLM's profile computes one row per request;
* the scorer's float32 copy of a chunk of those rows (engine/scorer.py `rows_per_chunk`);
* the float64 Gumbel noise of a chunk of sampled rows (graph/gumbel.py), with the noisy scores
  beside it (the scorer's walk and the drafter's sampled children).
Unaccounted, they land in memory vLLM has already given to the KV cache: an out-of-memory error
on the first large tree step under load (on a 128k vocabulary, 8192 logits rows are 2 GiB in
bf16 and one noise chunk about 1.5 GiB). `allocate_step_peak` allocates them together once, at
their largest, inside the profile run, so the profiler sees them; the KV cache is sized around
them. CUDA only: a CPU engine's KV cache size is set by the user (VLLM_CPU_KVCACHE_SPACE), not
profiled.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_gsd.engine.scorer import rows_per_chunk
from vllm_gsd.graph.gumbel import gumbel_noise, gumbel_top_k


def verification_rows(max_num_tokens: int, max_num_reqs: int, num_nodes: int) -> int:
    """The most target logits rows one step verifies: every request's root and N nodes, within
    the step's token budget."""
    return min(max_num_tokens, max_num_reqs * (1 + num_nodes))


@torch.inference_mode()
def allocate_step_peak(compute_logits, hidden_size: int, dtype: torch.dtype, device: torch.device,
                       rows: int, top_k: int) -> tuple[int, int]:
    """Allocate, together, what a tree step holds at its peak (see the module docstring):
    `compute_logits` (the target's LM head) over `rows` hidden states, and while those logits
    live, a float32 chunk of them and a chunk's Gumbel noise with its noisy top-k. Returns
    (logits rows, chunk rows)."""
    hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
    logits = compute_logits(hidden)
    del hidden
    vocab_size = logits.shape[-1]
    chunk = min(rows, rows_per_chunk(vocab_size))
    scores = logits[:chunk].to(torch.float32)
    noise = gumbel_noise(np.arange(chunk), np.zeros(chunk, dtype=np.int64), vocab_size, device)
    gumbel_top_k(scores, noise, top_k)
    return logits.shape[0], chunk
