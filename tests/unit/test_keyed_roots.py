"""An unseeded sampled request follows the target's distribution whether the budget gave it a
tree or not (vllm_v0_32/runner/step_hooks.py `_keyed_roots`, vllm_v0_32/scorer.py `GsdSampler`).

The case the adaptive budget makes: whether a request gets a tree depends on the draft's
children at the token's position, which that position's noise chose. A request with a tree draws
its token with that noise (the scorer's walk); were a request without one drawn afresh, each
token would be conditioned on its own noise: here trees are kept when the noise picked a likely
child, which favours likely tokens ([.5, .3, .15, .05] would come out near [.60, .36, .03, .01]).
The runner's own pieces decide the rows without a tree: `_keyed_roots` on a stand-in runner,
then GsdSampler on the batch's logits.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sampling_stand_ins import sampling_metadata

TARGET_PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
NUM_REQUESTS = 4000
NUM_COMPUTED = 17  # every request's tokens so far; its next token sits at position 18


def _runner(params_of_request):
    req_ids = [f"req-{i}" for i in range(len(params_of_request))]
    return SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=req_ids, num_reqs=len(req_ids),
                                    num_computed_tokens_cpu=np.full(len(req_ids), NUM_COMPUTED)),
        discard_request_mask=SimpleNamespace(np=np.zeros(len(req_ids), dtype=bool)),
        requests={r: SimpleNamespace(sampling_params=p, output_token_ids=[1, 2]) for r, p in zip(req_ids, params_of_request)},
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(seed=0)),
    )


def _draws_with_noise_dependent_trees(params_of_request) -> np.ndarray:
    """Each request's token at its next position, as a gsd step would emit it when the budget
    keeps a tree only where the draft's noisy top-1 child (draft = target) is likely."""
    from vllm_gsd.engine.sampling import noise_key
    from vllm_gsd.graph.gumbel import gumbel_argmax, gumbel_noise
    from vllm_gsd.vllm_v0_32.runner.step_hooks import _keyed_roots
    from vllm_gsd.vllm_v0_32.scorer import GsdSampler

    batch = len(params_of_request)
    runner = _runner(params_of_request)
    position = NUM_COMPUTED + 1
    keys = np.array([noise_key(r, p, 0) for r, p in zip(runner.input_batch.req_ids, params_of_request)])
    noise = gumbel_noise(keys, np.full(batch, position), len(TARGET_PROBS))
    log_probs = TARGET_PROBS.log().expand(batch, -1)
    child = gumbel_argmax(log_probs, noise)  # the draft's first child, chosen by the position's noise
    has_tree = TARGET_PROBS[child] >= 0.3
    walked = gumbel_argmax(log_probs, noise)  # a tree's row 0: the scorer's draw, same noise

    # The rows without a tree: a plain step of the runner, through its own sampler.
    scheduled = SimpleNamespace(scheduled_spec_decode_tokens={})
    sampler = GsdSampler(logprobs_mode="raw_logprobs")
    sampler.keyed = _keyed_roots(runner, scheduled, np.ones(batch, dtype=np.int64))
    plain, _ = sampler.sample(log_probs.to(torch.float32).clone(), sampling_metadata([1.0] * batch))
    return torch.where(has_tree, walked, plain.long()).numpy()


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
def test_tokens_follow_the_target_when_trees_depend_on_the_noise(seeded):
    from scipy.stats import chisquare
    from vllm import SamplingParams

    torch.manual_seed(0)  # vLLM's own draws (the bias's source) from a fixed global generator
    params = [SamplingParams(temperature=1.0, seed=1000 + i if seeded else None) for i in range(NUM_REQUESTS)]
    tokens = _draws_with_noise_dependent_trees(params)
    counts = np.bincount(tokens, minlength=len(TARGET_PROBS))
    p = chisquare(counts, TARGET_PROBS.numpy() * NUM_REQUESTS).pvalue
    assert p > 1e-3, f"counts {counts.tolist()}, p = {p:.2e}"


def test_the_check_sees_the_bias_of_fresh_draws_without_a_tree():
    """Power: the same check on the draws a runner made before every sampled root was keyed
    (rows without a tree drawn afresh) rejects the target's distribution."""
    from scipy.stats import chisquare

    from vllm_gsd.graph.gumbel import gumbel_argmax, gumbel_noise

    rng = np.random.default_rng(0)
    noise = gumbel_noise(rng.integers(0, 2**62, NUM_REQUESTS), np.full(NUM_REQUESTS, NUM_COMPUTED + 1),
                         len(TARGET_PROBS))
    log_probs = TARGET_PROBS.log().expand(NUM_REQUESTS, -1)
    keyed = gumbel_argmax(log_probs, noise)
    fresh = torch.from_numpy(rng.choice(len(TARGET_PROBS), NUM_REQUESTS, p=TARGET_PROBS.numpy()))
    tokens = torch.where(TARGET_PROBS[keyed] >= 0.3, keyed, fresh).numpy()
    counts = np.bincount(tokens, minlength=len(TARGET_PROBS))
    assert chisquare(counts, TARGET_PROBS.numpy() * NUM_REQUESTS).pvalue < 1e-6, counts.tolist()
