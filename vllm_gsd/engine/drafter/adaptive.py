"""The adaptive budget's feed: what each step measured, and what the next step may draft.

`AdaptiveBudget` holds the cost model (vllm_gsd.policy.NodeBudgetPolicy) and, where whole steps
are measured, the wall-clock referee, and feeds them:

* `learn_step`, at the start of each drafter call: the step that just finished ran from the last
  call to now; its wall time goes to the referee (against what the model predicted for it, both
  less the draft's catch-up on tokens decoded plainly, which is the plain streak's cost, not the
  depth's), the times of its forwards to the cost model's scales (the slowest tensor-parallel
  rank's, so that every rank decides the same);
* `decide`: at this load, which depth (or plain decoding) the step drafts, and for how many of
  its tree requests;
* `record`, the StepRecord of the step now running: what it was allowed, predicted and spent.

Everything is deterministic given the batch and the measured times, so every rank decides alike.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from vllm_gsd.engine import LOGGER_NAME
from vllm_gsd.engine.drafter.choose import Candidate
from vllm_gsd.engine.metrics import GsdStats, decodes_only
from vllm_gsd.policy import CostCurve, Decision, NodeBudgetPolicy, StepKind, WallClockReferee

logger = logging.getLogger(LOGGER_NAME)


@dataclass(frozen=True)
class ForwardTime:
    """One forward's measured time, and the cost curves' prediction of it."""

    kind: StepKind
    predicted_seconds: float
    measured_seconds: float


@dataclass
class StepRecord:
    """The step now running, as the drafter decided and drafted it; the next call measures it."""

    depth: int = 0  # the depth it was allowed to draft (0: plain): the referee's arm
    drafted_partially: bool = False  # it drafted for only some of its tree requests (exploring): no arm
    predicted_tokens: float = 0.0  # the model's prediction of the step
    predicted_seconds: float = 0.0
    # The draft's catch-up on tokens decoded plainly before the step, by the draft's curve: a
    # cost of the plain streak, not of the depth the step drafted.
    catch_up_excess: float = 0.0
    draft_curve_seconds: float = 0.0  # the step's draft forwards, by the draft's cost curve


@dataclass(frozen=True)
class StepDecision:
    """`AdaptiveBudget.decide`'s answer."""

    depth: int  # draft forwards at most (the catch-up included); 0: a plain step
    explorers: int | None  # the step drafts for only this many of its tree requests (None: all)
    rate_to_beat: float | None  # the model's tokens/s of a step that deep, which each further level must beat
    why: str


@dataclass
class AdaptiveBudget:
    """The cost model, the referee (None where the user gave the cost curves) and their feed."""

    policy: NodeBudgetPolicy
    referee: WallClockReferee | None
    tensor_parallel_size: int
    record: StepRecord = field(default_factory=StepRecord)
    _pending_times: list[ForwardTime] = field(default_factory=list)  # forwards not given to the policy yet
    _last_call: float | None = None  # when the last call's drafting began
    _drafted_before: bool = False  # whether a step of this process has drafted

    @classmethod
    def build(cls, target_cost: CostCurve, draft_cost: CostCurve, node_budget: int, knobs,
              tensor_parallel_size: int) -> AdaptiveBudget:
        # Curves measured at start time bare forwards: real step times refine them, and whole
        # steps as they run decide in the end; curves a user gave are taken as they are.
        measured = knobs.cost_curve is None
        policy = NodeBudgetPolicy(target_cost, draft_cost, node_budget, knobs.max_depth, learn_scales=measured,
                                  min_child_ratio=knobs.min_child_ratio)
        return cls(policy, WallClockReferee(knobs.max_depth) if measured else None, tensor_parallel_size)

    def record_target_forward(self, num_tokens: int, seconds: float, verified_trees: bool) -> None:
        if self.policy.learn_scales:
            self._pending_times.append(ForwardTime(StepKind.TREE if verified_trees else StepKind.PLAIN,
                                                   float(self.policy.target_cost(num_tokens)), seconds))

    def record_draft_step(self, seconds: float) -> None:
        if self.policy.learn_scales:
            self._pending_times.append(ForwardTime(StepKind.DRAFT, self.record.draft_curve_seconds, seconds))

    def learn_step(self, scheduler_output, valid_sampled_token_ids: list[list[int]], stats: GsdStats) -> None:
        """Give the policy the measured times of the step that just finished (see the module
        docstring); it was speculative if this step's scheduler output verified drafts."""
        now = time.perf_counter()
        last, self._last_call = self._last_call, now
        if last is None:
            return
        measured = torch.tensor([now - last] + [t.measured_seconds for t in self._pending_times], dtype=torch.float64)
        if self.tensor_parallel_size > 1:
            from vllm.distributed import get_tp_group

            torch.distributed.all_reduce(measured, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().cpu_group)
        step_seconds, *forward_seconds = measured.tolist()
        for forward, seconds in zip(self._pending_times, forward_seconds):
            self.policy.observe_time(forward.kind, forward.predicted_seconds, seconds)
        self._pending_times.clear()
        record, self.record = self.record, StepRecord()
        speculative = bool(scheduler_output.scheduled_spec_decode_tokens)
        # A prefill would skew the rate, and a step that drafted for some of its requests only
        # (exploring) measures neither plain nor speculative decoding. The draft's catch-up on
        # tokens decoded plainly is left out of both the measured and the predicted seconds (a
        # quarter of each is kept at least, in case the draft's curve overrates it). The
        # process's first drafted step pays one-time costs (numba's cache loads, the first calls
        # of the tree path): it measures no arm.
        first_draft = record.depth > 0 and not self._drafted_before
        self._drafted_before |= record.depth > 0
        if self.referee is None or not decodes_only(scheduler_output) or record.drafted_partially or first_draft:
            return
        tokens = sum(len(t) for t in valid_sampled_token_ids)
        excess = record.catch_up_excess
        self.referee.observe(record.depth, len(valid_sampled_token_ids), tokens,
                             max(step_seconds - excess, 0.25 * step_seconds), record.predicted_tokens,
                             max(record.predicted_seconds - excess, 0.25 * record.predicted_seconds))
        logger.debug("gsd: step of depth %d measured: %d tokens in %.3f s (catch-up on the plain streak %.3f s); "
                     "the model expected %.2f tokens in %.3f s", record.depth, tokens, step_seconds, excess,
                     record.predicted_tokens, record.predicted_seconds)
        us = int(step_seconds * 1e6)
        if speculative:
            stats.speculative_step_us, stats.speculative_step_tokens = us, tokens
            stats.speculative_steps_timed = 1
        else:
            stats.plain_step_us, stats.plain_step_tokens = us, tokens
            stats.plain_steps_timed = 1

    def catch_up_excess(self, candidates: list[Candidate], valid_sampled_token_ids: list[list[int]]) -> float:
        """Seconds (by the draft's curve and scale) the draft's catch-up spends on tokens the
        target decoded plainly, beyond what a step right after a drafted one catches up."""
        behind = [c.root_pos + 1 - c.catch_up_from for c in candidates]
        steady = [min(b, len(valid_sampled_token_ids[c.batch_row])) for b, c in zip(behind, candidates)]
        return self.policy.scale[StepKind.DRAFT] * float(self.policy.draft_cost(sum(behind))
                                                         - self.policy.draft_cost(sum(steady)))

    def decide(self, num_requests: int, num_candidates: int, num_plain: int, stats: GsdStats,
               catch_up_seconds: float, tokens_left: float | None) -> StepDecision:
        """The cost model proposes a depth, or plain decoding (its first tree, and with curves
        the user gave now and then a few exploring trees to refresh its estimates); where whole
        steps are measured, the referee picks the arm that measures fastest (the model's depth
        while that is not measured yet) and does the exploring itself, at a bounded cost."""
        decision = self.policy.should_draft(num_candidates, num_plain)
        explorers = decision.num_requests if decision.explore else None
        if self.referee is None:
            depth = decision.depth if decision else 0
            return StepDecision(depth, explorers, _predicted_rate(decision, depth), decision.why)
        if decision.forecast is None:  # nothing to predict from yet: the model's first tree
            depth, why = (decision.depth, "") if self.referee.plain_measured(num_requests) else (
                0, "measuring plain steps first")
        else:
            choice = self.referee.choose(num_requests, decision.forecast, catch_up_seconds, tokens_left)
            depth, why = choice.depth, choice.why
            explorers = None
        if decision and not depth:
            stats.steps_vetoed += 1
        if not depth:
            base = num_candidates + num_plain
            self.record.predicted_tokens, self.record.predicted_seconds = float(base), float(
                self.policy.plain_seconds(base))
        return StepDecision(depth, explorers, _predicted_rate(decision, depth), f"{decision.why}; {why}")


def _predicted_rate(decision: Decision, depth: int) -> float | None:
    """The model's tokens per second of a step drafted `depth` levels, where it predicted one."""
    return None if decision.forecast is None else decision.forecast.rate(depth)
