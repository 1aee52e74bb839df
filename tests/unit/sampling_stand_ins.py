"""vLLM sampling inputs built by hand, for unit tests of the scorer and sampler with fake logits
(as vLLM tests its own rejection sampler)."""

from __future__ import annotations

import torch


def sampling_metadata(temperature: list[float], **fields):
    """vLLM's SamplingMetadata for len(temperature) requests: no penalties, processors or
    logprobs unless `fields` set them (temperature 0 = greedy)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    batch_size = len(temperature)
    greedy = [t < 1e-5 for t in temperature]
    zeros = torch.zeros(batch_size)
    defaults = dict(
        temperature=torch.tensor(temperature, dtype=torch.float32), all_greedy=all(greedy),
        all_random=not any(greedy), top_p=None, top_k=None, generators={}, max_num_logprobs=None,
        no_penalties=True, prompt_token_ids=None, frequency_penalties=zeros, presence_penalties=zeros,
        repetition_penalties=torch.ones(batch_size), output_token_ids=[[] for _ in range(batch_size)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    return SamplingMetadata(**{**defaults, **fields})
