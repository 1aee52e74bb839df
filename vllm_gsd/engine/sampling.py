"""How sampled (temperature > 0) requests are drafted and verified: coupled Gumbel-max.

Every token of a sampled request that the tree path serves is drawn as
`argmax(scores + G(key, position))` (vllm_gsd.graph.gumbel): `scores` are the logits after the
request's temperature, top-k and top-p (vLLM's own processing, `processed_scores`), `G` Gumbel
noise keyed by the request's `noise_key` and the absolute position of the token. The draft
proposes at that position the top-k of its own processed scores plus the same noise, and the
scorer walks the tree with the target's noisy argmax. So:

* the output follows the target's distribution exactly, for any tree (each emitted token is the
  target's Gumbel-max draw given the accepted prefix);
* a seeded request's text depends only on its seed, prompt and the target, never on the batch,
  the trees or whether a step speculated (its key is its seed, and plain steps draw the root
  the same way: vllm_v0_32/scorer.py's GsdSampler);
* a child is accepted when the target's noisy argmax is among the draft's noisy top-k: for a
  draft near the target almost always, at any temperature (a deterministic top-k would cover
  only the target's top-k mass, little at high temperature).

Unseeded requests get a key from their request id and the engine's seed (the same on every
tensor-parallel rank), and are drawn the same way at every position, tree or not: whether a
step has a tree depends on the noise that chose the draft's children, so a token drawn with
that noise only when there is a tree would be biased (`_keyed_roots` in
vllm_v0_32/runner/step_hooks.py).
"""

from __future__ import annotations

import hashlib

import torch
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

SAMPLING_EPS = 1e-5  # vLLM's: below it a temperature means greedy


def is_sampled(params) -> bool:
    return params is not None and params.temperature >= SAMPLING_EPS


def noise_key(req_id: str, params, engine_seed: int | None) -> int:
    """63-bit key of a sampled request's noise: its seed, else its id mixed with the engine seed."""
    if params.seed is not None:
        return int(params.seed) & (2**63 - 1)
    digest = hashlib.blake2b(f"{engine_seed}/{req_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def processed_scores(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                     top_p: torch.Tensor | None, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [R, V]: logits / temperature, then min_p, then vLLM's top-k / top-p (-inf
    outside), as vLLM's Sampler processes a sampled row. A copy: `logits` is left as it is."""
    scores = logits.to(torch.float32, copy=True).div_(temperature.to(torch.float32).unsqueeze(-1))
    if min_p is not None:  # vLLM's min_p: tokens below min_p x the most likely one's probability
        probs = scores.softmax(dim=-1)
        scores.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(-1), float("-inf"))
    return apply_top_k_top_p(scores, top_k, top_p)
