"""Cost curves for the adaptive node budget: seconds of a target / draft forward by query tokens.

`budget_cost_curves(runner, proposer, configured)` returns the curves given in the `gsd` block
(`cost_curve`), or measures them once, after the KV cache exists: each model runs forwards of
q tokens (weights, MLPs and the logits of every row; attention is skipped, as in vLLM's own
warm-up runs, since on the node budgets at stake the weights dominate) at a few q, and the best
time of each is kept. Beyond `MAX_MEASURED_TOKENS` the curve is extended linearly.

Tensor-parallel ranks time the same forwards (they must, for the collectives), and rank 0's
figures are broadcast, so every rank's policy takes the same decisions from the same curves.
"""

from __future__ import annotations

import logging
import time

import torch
from vllm.forward_context import set_forward_context

from vllm_gsd.engine import LOGGER_NAME
from vllm_gsd.graph.budget import CostCurve

logger = logging.getLogger(LOGGER_NAME)

MEASURED_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512)
MAX_MEASURED_TOKENS = MEASURED_TOKENS[-1]
REPEATS_BELOW = 64  # forwards this small are timed twice (noise matters more there)


def budget_cost_curves(runner, proposer, configured) -> tuple[CostCurve, CostCurve]:
    """(target curve, draft curve) from the config, else measured (and shared across TP ranks)."""
    if configured is not None:
        return CostCurve.from_points(configured.target), CostCurve.from_points(configured.draft)
    scheduler = runner.vllm_config.scheduler_config
    largest = min(scheduler.max_num_batched_tokens,
                  scheduler.max_num_seqs * (1 + proposer.node_budget), MAX_MEASURED_TOKENS)
    tokens = sorted({q for q in MEASURED_TOKENS if q <= largest} | {largest})
    started = time.perf_counter()
    target = _measure(runner.model, runner.vllm_config, runner.device, tokens)
    draft = _measure(proposer.model, proposer.vllm_config, proposer.device, tokens)
    target, draft = _from_rank_zero(runner, (target, draft))
    logger.info("gsd: adaptive node budget, measured in %.1f s: target forward %s, draft forward %s "
                "(seconds by query tokens)", time.perf_counter() - started,
                _describe(tokens, target), _describe(tokens, draft))
    return CostCurve(tuple(tokens), tuple(target)), CostCurve(tuple(tokens), tuple(draft))


def _measure(model, vllm_config, device, tokens: list[int]) -> list[float]:
    """Best wall time of one forward (with logits of every row) for each token count."""
    _time_forward(model, vllm_config, device, tokens[0])  # warm-up (allocator, lazy init)
    times = []
    for q in tokens:
        repeats = 2 if q < REPEATS_BELOW else 1
        times.append(min(_time_forward(model, vllm_config, device, q) for _ in range(repeats)))
    return times


@torch.inference_mode()
def _time_forward(model, vllm_config, device, num_tokens: int) -> float:
    input_ids = torch.zeros(num_tokens, dtype=torch.int32, device=device)
    positions = torch.arange(num_tokens, dtype=torch.int64, device=device)
    _synchronize(device)
    started = time.perf_counter()
    with set_forward_context(None, vllm_config, num_tokens=num_tokens):
        hidden_states = model(input_ids=input_ids, positions=positions)
        if isinstance(hidden_states, tuple):
            hidden_states = hidden_states[0]
        model.compute_logits(hidden_states)
    _synchronize(device)
    return time.perf_counter() - started


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _from_rank_zero(runner, values):
    if runner.vllm_config.parallel_config.tensor_parallel_size == 1:
        return values
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    shared = [values]
    torch.distributed.broadcast_object_list(shared, src=group.ranks[0], group=group.cpu_group)
    return shared[0]


def _describe(tokens: list[int], seconds: list[float]) -> str:
    return ", ".join(f"{q}: {s:.4f}" for q, s in zip(tokens, seconds))
