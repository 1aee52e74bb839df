"""Gumbel-max sampling with noise keyed by (request key, position), shared by draft and target.

The target's token at a position is `argmax(scores + G)`, where `scores` are its processed
logits (temperature, top-k, top-p; -inf outside the support) and `G` is i.i.d. Gumbel noise, one
value per vocabulary entry, drawn from a generator keyed by (request key, absolute position):
the Gumbel-max trick, so the token is an exact draw from softmax(scores). The draft proposes, at
the same position, the top-k tokens of ITS processed logits plus the SAME noise (a draw of k
without replacement from its own distribution, by the Gumbel-top-k trick).

Why this is lossless and accepts much: the walk emits, at every position, the target's own
Gumbel-max token given the accepted prefix, i.e. exactly what sampling the target alone with this
noise would emit, whatever the tree; so the output distribution is the target's and a seeded
request's text does not depend on the batch or on the trees. The tree only decides how many of
those tokens one forward confirms: a child is accepted when the target's noisy argmax is among
the draft's noisy top-k, which for a draft close to the target is nearly always (the draft's
noisy top-1 is the target's token whenever the noise dominates their difference).

Noise is float64 (53-bit uniforms): a token is out of reach only if its log-probability trails
the best by more than about 40 nats (total mass below 1e-12 on a 152k vocabulary), unlike an
inverse-CDF draw whose float32 running sum makes every token below half an ulp unreachable.
"""

from __future__ import annotations

import numpy as np
import torch

from .counter_rng import counter_keys

_TINY = float(np.finfo(np.float64).tiny)


def gumbel_noise(keys: np.ndarray, positions: np.ndarray, vocab_size: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """float64 [R, V]: Gumbel noise of each (key, position) row, on `device`.

    Row r depends only on (keys[r], positions[r]) and the device type: one generator per
    distinct pair, so rows that share a pair share their noise, whatever else is in the batch.
    """
    keys = np.asarray(keys, dtype=np.int64).reshape(-1)
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    seeds = (counter_keys(keys, positions) >> np.uint64(1)).astype(np.int64)  # 63 bits
    generator = torch.Generator(device=device)
    noise = torch.empty((len(seeds), vocab_size), dtype=torch.float64, device=device)
    first_row: dict[int, int] = {}  # a pair's first row: later rows of the pair copy it on the device
    for row, seed in enumerate(seeds.tolist()):
        if seed in first_row:
            noise[row] = noise[first_row[seed]]
        else:
            first_row[seed] = row
            generator.manual_seed(seed)
            noise[row].uniform_(generator=generator)
    return noise.clamp_(min=_TINY).log_().neg_().log_().neg_()  # -log(-log u)


def gumbel_argmax(scores: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """int64 [R]: argmax(scores + noise) per row, an exact draw from softmax(scores)
    (scores [R, V] any float dtype, -inf = excluded; computed in float64)."""
    return (scores.to(torch.float64) + noise).argmax(dim=-1)


def gumbel_top_k(scores: torch.Tensor, noise: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k tokens of highest scores + noise: (tokens int64 [R, k], in that order, and their
    probabilities under softmax(scores + noise), float32 [R, k]).

    Row by row the tokens are k draws without replacement from softmax(scores); the first is
    gumbel_argmax. The returned probability is how sure the draft is of each token given the
    noise (a draft token the noise favours is likely the target's too): the graph's pruning and
    path probabilities read it.
    """
    noisy = scores.to(torch.float64) + noise
    top, tokens = noisy.topk(k, dim=-1)
    probs = (top - torch.logsumexp(noisy, dim=-1, keepdim=True)).exp()
    return tokens, probs.to(torch.float32)
