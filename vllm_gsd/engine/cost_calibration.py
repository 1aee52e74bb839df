"""Cost curves for the adaptive node budget: seconds of a target / draft forward by query tokens.

`budget_cost_curves(runner, proposer, configured)` returns the curves given in the `gsd` block
(`cost_curve`), or measures them once, after vLLM's warm-up (its CUDA graphs captured): each
model runs forwards of one request of q new tokens after `CONTEXT_TOKENS` cached ones (weights,
attention through the model's own backend, and the logits of every row), in scratch KV blocks
before any request exists, at a few q; the best time of each is kept. Beyond
`MAX_MEASURED_TOKENS` the curve is extended linearly. On CUDA every timed forward is
synchronized (start-up only).

Each timed forward runs as the step it stands for does (`Forwarder`): dispatched by the model's
own CUDA-graph dispatcher (the runner's for the target, as a tree step: never the FULL graph of
a uniform decode; the drafter's for the draft), padded to the captured size it picks, from the
persistent input buffers the graphs were captured on, its padding rows writing no KV. So on a
GPU the curves time piecewise graph replays, as serving runs them; on the CPU, where vLLM
captures none, the dispatchers run every forward eagerly at its own size.

`StepTimer` times each step's target forward while serving, without synchronizing.

Tensor-parallel ranks time the same forwards (they must, for the collectives), and rank 0's
figures are broadcast, so every rank's policy takes the same decisions from the same curves.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.utils import PADDING_SLOT_ID


from vllm_gsd.engine import LOGGER_NAME
from vllm_gsd.policy import CostCurve

logger = logging.getLogger(LOGGER_NAME)

# Dense where trees live: on a CPU a forward costs about the same up to a few query tokens, then
# grows with each (the weights stop dominating); a curve through 1 and 8 alone hides that knee.
MEASURED_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256, 512)
MAX_MEASURED_TOKENS = MEASURED_TOKENS[-1]
REPEATS_BELOW = 64  # forwards this small are timed twice (noise matters more there)
CONTEXT_TOKENS = 512  # cached tokens each timed forward attends to (fewer if max_model_len is short)


def budget_cost_curves(runner, proposer, configured) -> tuple[CostCurve, CostCurve]:
    """(target curve, draft curve) from the config, else measured (and shared across TP ranks)."""
    if configured is not None:
        return CostCurve.from_points(configured.target), CostCurve.from_points(configured.draft)
    scheduler = runner.vllm_config.scheduler_config
    largest = min(scheduler.max_num_batched_tokens,
                  scheduler.max_num_seqs * (1 + proposer.node_budget), MAX_MEASURED_TOKENS)
    tokens = sorted({q for q in MEASURED_TOKENS if q <= largest} | {largest})
    context = max(0, min(CONTEXT_TOKENS, runner.vllm_config.model_config.max_model_len - tokens[-1],
                         proposer.max_model_len - tokens[-1]))
    block_size = runner.input_batch.block_table[proposer.kv_cache_gid].block_size
    target_groups = [group for groups in runner.attn_groups for group in groups]
    started = time.perf_counter()
    target = _measure(Forwarder.of_runner(runner), tokens, _Scratch(target_groups, block_size, context))
    draft = _measure(Forwarder.of_drafter(proposer), tokens,
                     _Scratch(proposer.draft_attn_groups, block_size, context))
    target, draft = _from_rank_zero(runner, (target, draft))
    logger.info("gsd: adaptive node budget, measured in %.1f s: target forward %s, draft forward %s "
                "(seconds by query tokens)", time.perf_counter() - started,
                _describe(tokens, target), _describe(tokens, draft))
    return CostCurve(tuple(tokens), tuple(target)), CostCurve(tuple(tokens), tuple(draft))


@dataclass(frozen=True)
class Forwarder:
    """How a model's forwards run while serving: its CUDA-graph dispatch, and how a forward of a
    dispatched (padded) size gets its inputs into the persistent buffers its graphs were
    captured on, and its padding rows slots that write no KV."""

    model: Callable
    head: Callable  # the logits of hidden states [q, H] (the target's, or the draft's head)
    vllm_config: object
    device: torch.device
    dispatch: Callable  # num_tokens -> (CUDAGraphMode, BatchDescriptor): its padded size
    inputs: Callable  # (positions [q], padded size) -> (input_ids, positions) [padded]
    slots: Callable  # (padded size, slots [q]) -> {layer name: slots [padded]}

    @classmethod
    def of_runner(cls, runner) -> Forwarder:
        """The target as a tree step runs it: a batch that is not a uniform decode (PIECEWISE
        where vLLM captured graphs), its inputs in the runner's buffers."""
        layers = [name for group in runner.kv_cache_config.kv_cache_groups for name in group.layer_names]
        slot_buffer = runner.input_batch.block_table[0].slot_mapping.gpu

        def inputs(positions: torch.Tensor, padded: int):
            runner.input_ids.gpu[:padded].zero_()
            runner.positions[:positions.shape[0]].copy_(positions)
            runner.positions[positions.shape[0]:padded].zero_()
            return runner.input_ids.gpu[:padded], runner.positions[:padded]

        def slots(padded: int, slot_mapping: torch.Tensor):
            slot_buffer[:slot_mapping.shape[0]].copy_(slot_mapping)
            slot_buffer[slot_mapping.shape[0]:padded].fill_(PADDING_SLOT_ID)
            return {name: slot_buffer[:padded] for name in layers}

        return cls(runner.model, runner.model.compute_logits, runner.vllm_config, runner.device,
                   lambda n: runner.cudagraph_dispatcher.dispatch(n, uniform_decode=False), inputs, slots)

    @classmethod
    def of_drafter(cls, proposer) -> Forwarder:
        """The draft as the drafter's levels run it (engine/proposer.py `_forward`)."""
        def inputs(positions: torch.Tensor, padded: int):
            token_ids = torch.zeros(positions.shape[0], dtype=torch.int32, device=positions.device)
            return proposer._graph_inputs(token_ids, positions, padded)

        return cls(proposer.model, proposer.draft_head, proposer.vllm_config, proposer.device,
                   proposer.cudagraph_dispatcher.dispatch, inputs, proposer._get_slot_mapping)

    @torch.inference_mode()
    def time(self, num_tokens: int, scratch: _Scratch) -> float:
        """Seconds of one forward of `num_tokens` rows (and the head over them), synchronized."""
        mode, descriptor = self.dispatch(num_tokens)
        padded = descriptor.num_tokens
        metadata, positions = scratch.forward_inputs(num_tokens, self.device)
        slot_mapping = self.slots(padded, scratch.slots(positions))
        input_ids, padded_positions = self.inputs(positions, padded)
        synchronize(self.device)
        started = time.perf_counter()
        with set_forward_context(metadata, self.vllm_config, num_tokens=padded, cudagraph_runtime_mode=mode,
                                 batch_descriptor=descriptor, slot_mapping=slot_mapping):
            hidden_states = self.model(input_ids=input_ids, positions=padded_positions)
            if isinstance(hidden_states, tuple):
                hidden_states = hidden_states[0]
            self.head(hidden_states[:num_tokens])
        synchronize(self.device)
        return time.perf_counter() - started


@dataclass
class _Scratch:
    """Where a timed forward's request lives: the model's attention groups, KV blocks 0.. (no
    request exists yet), and the context it attends to."""

    attn_groups: list
    block_size: int
    context: int

    def forward_inputs(self, num_tokens: int, device):
        """(per-layer attention metadata, positions [num_tokens]) of one request of num_tokens
        new tokens after `context` cached ones."""
        seq_len = self.context + num_tokens
        positions = torch.arange(self.context, seq_len, dtype=torch.int64, device=device)
        num_blocks = -(-seq_len // self.block_size)
        block_table = torch.arange(num_blocks, dtype=torch.int32, device=device).unsqueeze(0)
        query_start_loc = torch.tensor([0, num_tokens], dtype=torch.int32)
        seq_lens = torch.tensor([seq_len], dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc.to(device), query_start_loc_cpu=query_start_loc,
            seq_lens=seq_lens.to(device), num_reqs=1, num_actual_tokens=num_tokens, max_query_len=num_tokens,
            max_seq_len=seq_len, block_table_tensor=block_table, slot_mapping=self.slots(positions), causal=True,
            positions=positions, seq_lens_cpu_upper_bound=seq_lens)
        metadata = {}
        for group in self.attn_groups:
            built = group.get_metadata_builder().build(0, common)
            for name in group.layer_names:
                metadata[name] = built
        return metadata, positions

    @staticmethod
    def slots(positions: torch.Tensor) -> torch.Tensor:
        """The KV slots of the scratch request's positions: its block b is block b of the cache."""
        return positions


def _measure(forwarder: Forwarder, tokens: list[int], scratch: _Scratch) -> list[float]:
    """Best wall time of one forward (with its head's logits of every row) for each token count."""
    forwarder.time(tokens[0], scratch)  # warm-up (allocator, lazy init)
    times = []
    for q in tokens:
        repeats = 2 if q < REPEATS_BELOW else 1
        times.append(min(forwarder.time(q, scratch) for _ in range(repeats)))
    return times


# Called on every `synchronize` (any device): the host-read counter (testing/host_reads.py) counts
# the full stalls it would be on a GPU.
STALL_HOOKS: list = []


def synchronize(device) -> None:
    """Wait for the device's queued work (CUDA), so that a host clock times it."""
    for hook in STALL_HOOKS:
        hook()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Times a region of each step (the target forward) without making the host wait for it.

    `start()` and `stop(payload)` bracket the region; `finished()` returns, oldest first, the
    (payload, seconds) of the regions whose time is known, each once, the same regions on every
    tensor-parallel rank (the adaptive budget all-reduces the times it is given). On the host
    (`HostStepTimer`) a region is known at `stop` (wall time: the forward ran synchronously). On
    CUDA (`CudaStepTimer`) two events are recorded on the stream around it, and a region is
    given once a later region has started: by then the stream has long passed it (the step's
    sampled tokens were read), so reading its events waits for nothing. `for_device` picks the
    one the device needs.
    """

    @staticmethod
    def for_device(device) -> StepTimer:
        return CudaStepTimer() if torch.device(device).type == "cuda" else HostStepTimer()

    def start(self) -> None:
        raise NotImplementedError

    def stop(self, payload) -> None:
        raise NotImplementedError

    def finished(self) -> list[tuple[object, float]]:
        raise NotImplementedError


class HostStepTimer(StepTimer):
    def __init__(self, clock=time.perf_counter) -> None:
        self._clock = clock
        self._started: float | None = None
        self._done: list[tuple[object, float]] = []

    def start(self) -> None:
        self._started = self._clock()

    def stop(self, payload) -> None:
        if self._started is not None:
            self._done.append((payload, self._clock() - self._started))
            self._started = None

    def finished(self) -> list[tuple[object, float]]:
        done, self._done = self._done, []
        return done


class CudaStepTimer(StepTimer):
    """Event pairs on the current stream (`torch.cuda.Event(enable_timing=True)`, reused). A
    region is given by the first `finished()` after the next `start()`; should its end event not
    be done by then (the host a whole step ahead of the stream, as with vLLM's async
    scheduling), it is waited for (`waits` counts those), so that every rank gives the same."""

    def __init__(self, event_class=None) -> None:
        self._event_class = event_class or functools.partial(torch.cuda.Event, enable_timing=True)
        self._free: list = []
        self._open = None
        self._starts = 0
        self._pending: collections.deque = collections.deque()  # (begin, end, payload, started as)
        self.waits = 0

    def _event(self):
        return self._free.pop() if self._free else self._event_class()

    def start(self) -> None:
        self._starts += 1
        self._open = self._event()
        self._open.record()

    def stop(self, payload) -> None:
        if self._open is None:
            return
        end = self._event()
        end.record()
        self._pending.append((self._open, end, payload, self._starts))
        self._open = None

    def finished(self) -> list[tuple[object, float]]:
        done = []
        while self._pending and self._pending[0][3] < self._starts:
            begin, end, payload, _ = self._pending.popleft()
            if not end.query():
                self.waits += 1
                end.synchronize()
            done.append((payload, begin.elapsed_time(end) / 1e3))  # milliseconds
            self._free += (begin, end)
        return done


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
