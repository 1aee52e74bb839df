"""The GSD drafter: catch the draft model up, then grow each request's hypothesis graph.

Contract (called by the V1 model runner after bookkeeping, like vLLM's CPU-list drafters)::

    propose_tree(runner, scheduler_output, valid_sampled_token_ids) -> list[list[int]]

returns, per request of the runner's batch, the flattened tree's node tokens (breadth-first,
docs/contracts.md), or [] where the request gets no speculation this step. The tree's shape is
kept in `self.trees[req_id]` for the next step's verification (engine/runner_hooks.py).

One step, for the requests that may grow a tree (engine/eligibility.py, not finishing, and room
for the tree before the target's and the draft's context limits and in the allocated blocks):
0. Policy (adaptive node budget, vllm_gsd.policy): at this load, which depth (or plain
   decoding) is expected to emit the most tokens per second, corrected by whole steps as they
   measured (WallClockReferee)? If plain, nothing runs on the draft this step.
1. Catch-up: the draft runs causally over every token it has not seen yet, up to and including
   the new root (the last sampled token), at their real positions, writing its own KV. That is
   usually the tokens the target committed this step, but after steps without drafting (high
   load, a request not eligible yet, a prefill) it is everything since the draft last ran, and
   for a new request everything past the prefix-cache blocks whose draft KV is known to be
   valid (engine/draft_kv.py); it is cut into forwards of at most max_num_batched_tokens. Tree
   slots the draft wrote last step are overwritten, so its cache holds only accepted tokens.
2. Expansion: the hypothesis graph (vllm_gsd.graph.GraphBuilder) grows level by level; each level
   is ONE draft forward over the frontier rows of every request, where graph row g is written to
   KV position root_pos + g, rotated at root_pos + depth(g), and attends to the context plus its
   primary ancestors (graph mask). Children are the draft's top-k (greedy requests) or its
   Gumbel-top-k under the request's own sampling and noise (sampled requests, engine/sampling.py).
   It stops at the depth the policy chose for the step, or before, at the first level whose
   children the draft is too unsure of to pay for the forward (NodeBudgetPolicy.next_level_pays).
3. The graph is unrolled into the verification tree; the policy keeps each request's most likely
   nodes, as many as maximize the batch's expected tokens per second.
Everything here is deterministic given the batch (the cost curves are shared by all ranks), so
every tensor-parallel rank builds the same tree.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from vllm_gsd.engine import LOGGER_NAME
from vllm_gsd.engine.cost_calibration import budget_cost_curves
from vllm_gsd.engine.draft_head import DraftHead, draft_head, logit_columns, top_children, widen
from vllm_gsd.engine.draft_kv import DraftKvLedger, DraftProgress
from vllm_gsd.engine.eligibility import tree_refusal_reason
from vllm_gsd.engine.metrics import GsdStats, decodes_only
from vllm_gsd.engine.rank_consistency import check_same_on_all_ranks, tree_fingerprint
from vllm_gsd.engine.sampling import is_sampled, noise_key, processed_scores
from vllm_gsd.engine.scorer import rows_per_chunk
from vllm_gsd.engine.tree_batch import TreeAttention, TreeSlot
from vllm_gsd.graph import GraphBuilder, VerificationTree, warm_up
from vllm_gsd.graph.gumbel import gumbel_noise, gumbel_top_k
from vllm_gsd.engine.lookup import (Extensions, LookupAccuracy, append_extensions, find_node, lookup_extensions,
                                    lookup_outcome, node_path)
from vllm_gsd.engine.lookup import warm_up as warm_up_lookup
from vllm_gsd.policy import NodeBudgetPolicy, StepKind, WallClockReferee

logger = logging.getLogger(LOGGER_NAME)


@dataclass
class ProposedTree:
    """One request's verification tree, as proposed (CPU tensors, length n = num nodes)."""

    draft_token_ids: torch.Tensor  # int64 [n]
    parent_row: torch.Tensor  # int64 [n]
    depth: torch.Tensor  # int64 [n]
    via_merge: torch.Tensor  # bool [n]
    path_prob: torch.Tensor  # float64 [n]: the draft's probability of the path to the node (0: lookup)
    lookup_from: int  # nodes from this column on are context-lookup nodes (engine/lookup.py)


@dataclass(frozen=True)
class _Sampling:
    """How a sampled request's children are drawn (engine/sampling.py)."""

    noise_key: int
    temperature: float
    top_k: int  # 0: all
    top_p: float


@dataclass(frozen=True)
class _Candidate:
    """A request that grows a tree this step."""

    batch_row: int  # index in the runner's batch
    req_id: str
    catch_up_from: int  # first position whose draft KV is missing
    root_pos: int  # position of the root (the last sampled token)
    sampling: _Sampling | None  # None: greedy (the draft's deterministic top-k)


def _tokens_left(runner, candidates: list[_Candidate]) -> float:
    """How many tokens the tree requests may still generate, on average: their max_tokens, or
    the context limit, less what they have generated."""
    max_model_len = runner.max_model_len
    left = []
    for candidate in candidates:
        state = runner.requests[candidate.req_id]
        by_context = max_model_len - candidate.root_pos - 1
        max_tokens = state.sampling_params.max_tokens if state.sampling_params is not None else None
        by_request = by_context if max_tokens is None else max_tokens - len(state.output_token_ids)
        left.append(max(1, min(by_context, by_request)))
    return float(np.mean(left)) if left else 0.0


@dataclass
class _Forward:
    """Inputs of one draft forward over a subset of the runner's batch."""

    batch_rows: np.ndarray  # int64 [Bs]: runner batch index of each request in this forward
    token_ids: list[np.ndarray] = field(default_factory=list)  # per request
    positions: list[np.ndarray] = field(default_factory=list)  # rotary positions
    kv_positions: list[np.ndarray] = field(default_factory=list)  # where KV is written
    seq_lens: list[int] = field(default_factory=list)  # KV positions readable


class GsdProposer(DraftModelProposer):
    """Draft model loading, KV layers and attention groups are vLLM's draft_model ones."""

    def __init__(self, vllm_config, device, runner, tree_slot: TreeSlot):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        self.tree_slot = tree_slot
        spec = self.speculative_config
        knobs = spec.gsd
        self.node_budget = spec.num_speculative_tokens
        self.graph_params = knobs.graph_params(self.node_budget)
        self.history_len = max(knobs.merge_ngram, 0)
        self.lookup_nodes = knobs.lookup_nodes
        self.lookup_accuracy = LookupAccuracy()
        # Positions the draft may hold: vLLM clamps the draft's max_model_len to the target's.
        self.max_model_len = spec.draft_model_config.max_model_len
        self.trees: dict[str, ProposedTree] = {}
        self.policy: NodeBudgetPolicy | None = None  # set by prepare_policy when adaptive
        self.referee: WallClockReferee | None = None  # the adaptive budget's veto (measured curves only)
        self._last_call: float | None = None  # when the last step's drafting began
        # The step decided last call: the depth it was allowed to draft (0: plain), the arm the
        # referee measures it under, and whether it drafted for only some of its tree requests
        # (exploring: measured as no arm).
        self._step_depth = 0
        self._drafted_before = False  # whether a step of this process has drafted
        self._drafted_partially = False
        self._step_prediction = (0.0, 0.0)  # the model's (tokens, seconds) of it
        # Its draft's catch-up on tokens decoded plainly before it, in seconds by the draft's
        # curve: a cost of the plain streak, not of the depth the step drafted.
        self._step_catch_up_excess = 0.0
        self._draft: dict[str, DraftProgress] = {}  # per request: where its draft KV is valid
        self._ledger: DraftKvLedger | None = None  # made once the block size is known
        # Measured step times not yet given to the policy: (kind, seconds by the curves, seconds).
        self._step_times: list[tuple[StepKind, float, float]] = []
        self._curve_seconds = 0.0  # this step's draft forwards, by the draft's cost curve
        self._refusals_logged: set[str] = set()
        self.metrics = None  # engine.metrics.GsdMetrics of the worker
        self.draft_head: DraftHead | None = None  # the draft's LM head, once the draft is loaded
        warm_up()  # the graph core's compiled kernels, before the first request needs them
        warm_up_lookup()

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        knobs = self.speculative_config.gsd
        self.draft_head = draft_head(self.model, self.vllm_config, knobs.int8_draft_head, knobs.draft_vocab)

    def prepare_policy(self, runner) -> None:
        """Build the adaptive node budget (after the KV cache exists: it may time forwards)."""
        knobs = self.speculative_config.gsd
        if not knobs.adaptive or self.policy is not None:
            return
        target_cost, draft_cost = budget_cost_curves(runner, self, knobs.cost_curve)
        # Curves measured here time bare forwards: real step times refine them (a user's are kept).
        self.policy = NodeBudgetPolicy(target_cost, draft_cost, self.node_budget, knobs.max_depth,
                                       learn_scales=knobs.cost_curve is None,
                                       min_child_ratio=knobs.min_child_ratio)
        # Whole steps as they run decide in the end; curves a user gave are taken as they are.
        self.referee = WallClockReferee(knobs.max_depth) if knobs.cost_curve is None else None

    def record_target_forward(self, num_tokens: int, seconds: float, verified_trees: bool) -> None:
        """The runner's target forward of this step took `seconds` (engine/runner_hooks.py)."""
        if self.policy is not None and self.policy.learn_scales:
            self._step_times.append((StepKind.TREE if verified_trees else StepKind.PLAIN,
                                     float(self.policy.target_cost(num_tokens)), seconds))

    def _learn_step_times(self, scheduler_output, valid_sampled_token_ids, stats: GsdStats) -> None:
        """Give the policy the measured times of the step that just finished: the whole step's
        wall time to the referee, the forwards' to the cost scales (the slowest tensor-parallel
        rank's, so that every rank decides the same)."""
        if self.policy is None:
            return
        # The step that just finished ran from the last call's drafting (which made this step's
        # drafts, or none) to now: it was speculative if this step's scheduler output verified drafts.
        now = time.perf_counter()
        last, self._last_call = self._last_call, now
        if last is None:
            return
        measured = torch.tensor([now - last] + [t for _, _, t in self._step_times], dtype=torch.float64)
        if self.vllm_config.parallel_config.tensor_parallel_size > 1:
            from vllm.distributed import get_tp_group

            torch.distributed.all_reduce(measured, op=torch.distributed.ReduceOp.MAX,
                                         group=get_tp_group().cpu_group)
        step_seconds, *forward_seconds = measured.tolist()
        for (kind, predicted, _), seconds in zip(self._step_times, forward_seconds):
            self.policy.observe_time(kind, predicted, seconds)
        self._step_times.clear()
        depth, partially, predicted = self._step_depth, self._drafted_partially, self._step_prediction
        excess, self._step_catch_up_excess = self._step_catch_up_excess, 0.0
        self._step_depth, self._drafted_partially, self._step_prediction = 0, False, (0.0, 0.0)
        speculative = bool(scheduler_output.scheduled_spec_decode_tokens)
        # A prefill would skew the rate, and a step that drafted for some of its requests only
        # (exploring) measures neither plain nor speculative decoding. The draft's catch-up on
        # tokens decoded plainly is left out of both the measured and the predicted seconds (it
        # is the plain streak's, not the depth's; a quarter of each is kept at least, in case the
        # draft's curve overrates it).
        # The process's first drafted step pays one-time costs (numba's cache loads, the first
        # calls of the tree path): it measures no arm.
        first_draft = depth > 0 and not self._drafted_before
        self._drafted_before |= depth > 0
        if self.referee is not None and decodes_only(scheduler_output) and not partially and not first_draft:
            tokens = sum(len(t) for t in valid_sampled_token_ids)
            self.referee.observe(depth, len(valid_sampled_token_ids), tokens,
                                 max(step_seconds - excess, 0.25 * step_seconds),
                                 predicted[0], max(predicted[1] - excess, 0.25 * predicted[1]))
            logger.debug("gsd: step of depth %d measured: %d tokens in %.3f s (catch-up on the plain "
                         "streak %.3f s); the model expected %.2f tokens in %.3f s", depth, tokens,
                         step_seconds, excess, predicted[0], predicted[1])
            us = int(step_seconds * 1e6)
            if speculative:
                stats.speculative_step_us, stats.speculative_step_tokens = us, tokens
                stats.speculative_steps_timed = 1
            else:
                stats.plain_step_us, stats.plain_step_tokens = us, tokens
                stats.plain_steps_timed = 1

    def _record(self, stats: GsdStats) -> None:
        """Add this step's drafting figures to the worker's GSD metrics."""
        if self.metrics is not None:
            self.metrics.add(**vars(stats))  # flat ints (asdict deep-copies: slow every step)
            self.metrics.step_done()

    # ------------------------------------------------------------------------------ public

    @torch.inference_mode()
    def propose_tree(self, runner, scheduler_output, valid_sampled_token_ids: list[list[int]]
                     ) -> list[list[int]]:
        batch = runner.input_batch
        req_ids = list(batch.req_ids[:batch.num_reqs])
        stats = GsdStats()
        self._learn_step_times(scheduler_output, valid_sampled_token_ids, stats)
        self._observe_verified(req_ids, scheduler_output, valid_sampled_token_ids, stats)
        self._forget_finished(scheduler_output.finished_req_ids)
        # A request left out of this step keeps its tree: the scheduler keeps its draft tokens.
        in_batch = set(req_ids)
        self.trees = {r: tree for r, tree in self.trees.items() if r not in in_batch}
        drafts: list[list[int]] = [[] for _ in req_ids]
        candidates, num_plain = self._tree_candidates(runner, scheduler_output, req_ids,
                                                      valid_sampled_token_ids)
        if not candidates:
            self._record(stats)
            return drafts
        depth, explore, rate_to_beat = self.graph_params.max_depth, False, None
        # With a referee no step explores, so these candidates are the ones that draft.
        catch_up_excess = self._catch_up_excess(candidates, valid_sampled_token_ids)
        if self.policy is not None:
            # Only a catch-up has to pay back within the tokens left (referee.choose).
            tokens_left = _tokens_left(runner, candidates) if catch_up_excess > 0 else None
            depth, explorers, rate_to_beat, why = self._decide(len(req_ids), len(candidates), num_plain, stats,
                                                               catch_up_excess, tokens_left)
            logger.debug("gsd: %d tree candidates, %d other requests: %s (%s)", len(candidates),
                         num_plain, f"draft {depth} levels" if depth else "plain step", why)
            if not depth:
                stats.steps_not_speculated += 1
                self._record(stats)
                return drafts
            explore = explorers is not None
            if explore and explorers < len(candidates):
                self._drafted_partially = True
                # The least behind: their catch-up is the shortest (then back in batch order).
                least_behind = sorted(candidates, key=lambda c: c.root_pos - c.catch_up_from)
                num_plain += len(candidates) - explorers
                candidates = sorted(least_behind[:explorers], key=lambda c: c.batch_row)
            self._step_depth = depth

        started, self._curve_seconds = time.perf_counter(), 0.0
        root_logits = self._catch_up(runner, candidates, stats)
        if self.referee is not None:
            self._step_catch_up_excess = catch_up_excess
        tree = self._grow(runner, candidates, root_logits, num_plain, stats, depth, explore, rate_to_beat)
        num_nodes = tree.num_nodes.tolist()
        lookup_from = (tree.graph_row >= 0).sum(1).tolist()  # lookup nodes come last
        for b, candidate in enumerate(candidates):
            n = num_nodes[b]
            if n == 0:
                continue
            proposed = ProposedTree(
                draft_token_ids=tree.draft_token_ids[b, :n].clone(),
                parent_row=tree.parent_row[b, :n].clone(),
                depth=tree.depth[b, :n].clone(),
                via_merge=tree.via_merge[b, :n].clone(),
                path_prob=tree.path_prob[b, :n].clone(),
                lookup_from=lookup_from[b],
            )
            stats.lookup_nodes_proposed += n - lookup_from[b]
            self.trees[candidate.req_id] = proposed
            drafts[candidate.batch_row] = proposed.draft_token_ids.tolist()
        stats.steps_speculated += 1
        stats.nodes_proposed += int(tree.num_nodes.sum())
        stats.graph_nodes_drafted += int(tree.num_graph_nodes.sum())
        stats.merges += int(tree.num_merges.sum())
        stats.draft_expansions_saved += int(tree.expansions_saved.sum())
        drafted_in = time.perf_counter() - started
        stats.draft_step_us += int(drafted_in * 1e6)
        if self.policy is not None and self.policy.learn_scales:
            self._step_times.append((StepKind.DRAFT, self._curve_seconds, drafted_in))
        self._check_ranks_agree(req_ids, drafts)
        self._record(stats)
        return drafts

    def _catch_up_excess(self, candidates: list[_Candidate], valid_sampled_token_ids) -> float:
        """Seconds (by the draft's curve and scale) the draft's catch-up spends on tokens the
        target decoded plainly, beyond what a step right after a drafted one catches up."""
        if self.policy is None:
            return 0.0
        behind = [c.root_pos + 1 - c.catch_up_from for c in candidates]
        steady = [min(b, len(valid_sampled_token_ids[c.batch_row])) for b, c in zip(behind, candidates)]
        return self.policy.scale[StepKind.DRAFT] * float(self.policy.draft_cost(sum(behind))
                                                  - self.policy.draft_cost(sum(steady)))

    def _decide(self, num_requests: int, num_candidates: int, num_plain: int, stats: GsdStats,
                catch_up_seconds: float, tokens_left: float | None) -> tuple[int, int | None, float | None, str]:
        """(depth, explorers, rate, why): the adaptive budget's answer for this step; explorers:
        the step drafts for only this many of its tree requests (None: all); rate: the model's
        tokens per second of a step drafted that deep (None: not predicted yet), which each
        further draft level must beat. The cost model proposes
        a depth, or plain decoding (its first tree, and with curves the user gave now and then a
        few exploring trees to refresh its estimates); where whole steps are measured, the
        referee picks the arm that measures fastest (the model's depth while that is not
        measured yet) and does the exploring itself, at a bounded cost."""
        decision = self.policy.should_draft(num_candidates, num_plain)
        explorers = decision.num_requests if decision.explore else None
        if self.referee is None:
            depth = decision.depth if decision else 0
            return depth, explorers, _predicted_rate(decision, depth), decision.why
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
            self._step_prediction = (float(base), float(self.policy.plain_seconds(base)))
        return depth, explorers, _predicted_rate(decision, depth), f"{decision.why}; {why}"

    def _check_ranks_agree(self, req_ids: list[str], drafts: list[list[int]]) -> None:
        if self.vllm_config.parallel_config.tensor_parallel_size == 1:
            return
        from vllm.distributed import get_tp_group

        parents = [self.trees[r].parent_row.tolist() if r in self.trees else [] for r in req_ids]
        group = get_tp_group()
        check_same_on_all_ranks(tree_fingerprint(drafts, parents), group.cpu_group,
                                group.rank_in_group)

    # ------------------------------------------------------------------------------ steps

    def _observe_verified(self, req_ids, scheduler_output, valid_sampled_token_ids, stats: GsdStats) -> None:
        """Calibrate the policy's acceptance model, and the context lookup's odds, on the trees
        verified in this step. Lookup nodes carry no path probability: the acceptance model
        calibrates the draft alone."""
        if not self.trees:
            return
        max_depth = self.graph_params.max_depth
        predicted, accepted = [], []
        hits = tries = 0
        for i, req_id in enumerate(req_ids):
            tree = self.trees.get(req_id)
            verified = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            if tree is None or verified == 0 or not valid_sampled_token_ids[i]:
                continue
            if verified > tree.lookup_from:
                leaf = int(tree.parent_row[tree.lookup_from]) - 1
                h, t = lookup_outcome(valid_sampled_token_ids[i],
                                      node_path(tree.parent_row.numpy(), tree.draft_token_ids.numpy(), leaf),
                                      tree.draft_token_ids[tree.lookup_from:verified].numpy())
                hits, tries = hits + h, tries + t
            if self.policy is None:
                continue
            predicted.append(np.bincount(tree.depth[:verified].numpy(), tree.path_prob[:verified].numpy(),
                                         minlength=max_depth + 1)[: max_depth + 1])
            accepted.append(len(valid_sampled_token_ids[i]) - 1)
        if accepted:
            self.policy.acceptance.observe(np.stack(predicted), np.asarray(accepted))
        self.lookup_accuracy.observe(hits, tries)
        stats.lookup_nodes_tried += tries
        stats.lookup_nodes_accepted += hits

    def _forget_finished(self, finished_req_ids) -> None:
        for req_id in finished_req_ids:
            self.trees.pop(req_id, None)
            self._draft.pop(req_id, None)
            self._refusals_logged.discard(req_id)

    def _tree_candidates(self, runner, scheduler_output, req_ids, valid_sampled_token_ids
                         ) -> tuple[list[_Candidate], int]:
        """The requests that grow a tree this step, and how many other requests decode."""
        batch = runner.input_batch
        resumed = scheduler_output.scheduled_cached_reqs.resumed_req_ids
        candidates, num_plain = [], 0
        for i, req_id in enumerate(req_ids):
            num_scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if num_scheduled == 0:
                continue
            start = int(batch.num_computed_tokens_cpu[i])
            progress = self._draft.get(req_id)
            if progress is None or req_id in resumed:
                # New (perhaps with a prefix-cache hit) or resumed after a preemption: the draft
                # KV of its cached blocks counts only where the draft wrote this very prefix.
                progress = self._draft[req_id] = self._ledger_of(runner).resume(
                    batch.token_ids_cpu[i], self._block_ids(runner, i), start)
            num_sampled = len(valid_sampled_token_ids[i])
            if num_sampled == 0:  # a prefill chunk: no root yet
                continue
            num_spec = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            end = min(int(batch.num_tokens_no_spec[i]), start + num_scheduled - num_spec + num_sampled)
            root_pos = end - 1
            if root_pos < start or not self._may_grow_tree(runner, i, req_id, root_pos):
                num_plain += 1
                continue
            # The root is run again when the draft already holds it: its logits are needed.
            candidates.append(_Candidate(i, req_id, min(progress.known, root_pos), root_pos,
                                         self._sampling_of(req_id, runner.requests[req_id].sampling_params)))
        return candidates, num_plain

    def _sampling_of(self, req_id: str, params) -> _Sampling | None:
        if not is_sampled(params):
            return None
        return _Sampling(noise_key(req_id, params, self.vllm_config.model_config.seed), float(params.temperature),
                         max(int(params.top_k), 0), float(params.top_p))

    def _ledger_of(self, runner) -> DraftKvLedger:
        if self._ledger is None:
            self._ledger = DraftKvLedger(runner.input_batch.block_table[self.kv_cache_gid].block_size)
        return self._ledger

    def _block_ids(self, runner, batch_row: int) -> np.ndarray:
        block_table = runner.input_batch.block_table[self.kv_cache_gid]
        return block_table.block_table.np[batch_row, :block_table.num_blocks_per_row[batch_row]]

    def _may_grow_tree(self, runner, batch_row: int, req_id: str, root_pos: int) -> bool:
        state = runner.requests[req_id]
        params = state.sampling_params
        if params is not None and params.max_tokens is not None and len(state.output_token_ids) >= params.max_tokens:
            return False  # it has its last token: the scheduler finishes it, no tree is read
        reason = tree_refusal_reason(params, len(state.output_token_ids))
        if reason is not None:
            if req_id not in self._refusals_logged:
                self._refusals_logged.add(req_id)
                logger.info("gsd: request %s is served without speculation (%s)", req_id, reason)
            return False
        # Room for every node: the target writes node rows at root_pos + 1 .. root_pos + N and
        # the draft writes graph rows there too; stay inside max_model_len and the blocks the
        # scheduler allocated (near the context limit the request decodes without a tree).
        block_table = runner.input_batch.block_table[self.kv_cache_gid]
        allocated = int(block_table.num_blocks_per_row[batch_row]) * block_table.block_size
        last_slot = root_pos + self.node_budget
        return last_slot < self.max_model_len and last_slot < allocated

    def _catch_up(self, runner, candidates: list[_Candidate], stats: GsdStats) -> torch.Tensor:
        """Run the draft over each candidate's unseen tokens; return the roots' hidden states
        [R, H]."""
        token_ids_cpu = runner.input_batch.token_ids_cpu
        cap = self.max_num_tokens
        forwards: list[list[tuple[int, int, int]]] = [[]]  # per forward: (candidate, lo, hi)
        used = 0
        for k, candidate in enumerate(candidates):
            lo, hi = candidate.catch_up_from, candidate.root_pos + 1
            while lo < hi:
                if used == cap:
                    forwards.append([])
                    used = 0
                take = min(hi - lo, cap - used)
                forwards[-1].append((k, lo, lo + take))
                used, lo = used + take, lo + take
        root_hidden: list[torch.Tensor | None] = [None] * len(candidates)
        total_tokens = 0
        for pieces in forwards:
            fwd = _Forward(batch_rows=np.asarray([candidates[k].batch_row for k, _, _ in pieces]))
            for k, lo, hi in pieces:
                fwd.token_ids.append(token_ids_cpu[candidates[k].batch_row, lo:hi].astype(np.int64))
                fwd.positions.append(np.arange(lo, hi, dtype=np.int64))
                fwd.kv_positions.append(fwd.positions[-1])
                fwd.seq_lens.append(hi)
            ends_root = [j for j, (k, _, hi) in enumerate(pieces) if hi == candidates[k].root_pos + 1]
            last_token = np.cumsum([hi - lo for _, lo, hi in pieces]) - 1
            hidden = self._forward(runner, fwd, None, last_token[ends_root], stats)
            for row, j in enumerate(ends_root):
                root_hidden[pieces[j][0]] = hidden[row]
            total_tokens += int(last_token[-1] + 1)
        stats.draft_tokens_computed += total_tokens
        stats.levels_drafted += 1
        if self.policy is not None:
            self.policy.observe_forward(0, total_tokens, len(candidates))
        ledger = self._ledger_of(runner)
        for candidate in candidates:
            ledger.advance(self._draft[candidate.req_id], token_ids_cpu[candidate.batch_row],
                           self._block_ids(runner, candidate.batch_row), candidate.root_pos + 1)
        return torch.stack(root_hidden)

    def _grow(self, runner, candidates: list[_Candidate], root_hidden: torch.Tensor, num_plain: int,
              stats: GsdStats, depth: int, explore: bool = False, rate_to_beat: float | None = None
              ) -> VerificationTree:
        """Draft the graph level by level, at most `depth` forwards (the catch-up was the first);
        with the adaptive budget, a level is drafted only while it is expected to pay at
        `rate_to_beat` (NodeBudgetPolicy.next_level_pays), except on exploring steps, which
        draft every level to refresh the estimates. Returns the tree to verify."""
        token_ids_cpu = runner.input_batch.token_ids_cpu
        batch_rows = np.asarray([c.batch_row for c in candidates], dtype=np.int64)
        root_pos = np.asarray([c.root_pos for c in candidates], dtype=np.int64)
        roots = torch.from_numpy(token_ids_cpu[batch_rows, root_pos].astype(np.int64))
        history = torch.full((len(candidates), self.history_len), -1, dtype=torch.int64)
        for col in range(self.history_len):
            pos = root_pos - self.history_len + col
            ok = pos >= 0
            history[torch.from_numpy(ok), col] = torch.from_numpy(
                token_ids_cpu[batch_rows[ok], pos[ok]].astype(np.int64))
        builder = GraphBuilder(self.graph_params, roots, history)
        vocabulary = self._step_vocabulary(runner, candidates)
        policy = self.policy
        frontier_hidden, level = root_hidden, 0
        while (frontier := builder.frontier()) is not None:
            if frontier_hidden is None:
                if level >= depth:
                    break
                if policy is not None and not explore and not self._next_level_pays(
                        builder, frontier, level, num_plain, rate_to_beat):
                    stats.levels_not_paying += depth - level
                    break
                frontier_hidden = self._expand_level(runner, builder, frontier, batch_rows, root_pos, stats)
                num_rows = int(frontier.request_index.numel())
                stats.draft_tokens_computed += num_rows
                stats.levels_drafted += 1
                if policy is not None:
                    policy.observe_forward(level, num_rows, len(candidates))
            if level == 0:
                rows_request, rows_depth = np.arange(len(candidates)), np.zeros(len(candidates), np.int64)
            else:
                rows_request, rows_depth = frontier.request_index.numpy(), frontier.depth.numpy()
            top_tokens, top_probs = self._children(frontier_hidden, stats, candidates, rows_request, rows_depth,
                                                   vocabulary)
            if policy is not None:
                policy.observe_children(level, top_probs.numpy())
            builder.expand(top_tokens, top_probs)
            frontier_hidden, level = None, level + 1
        tree = builder.build_tree()
        extensions = lookup_extensions(tree, [token_ids_cpu[c.batch_row, :c.root_pos + 1] for c in candidates],
                                       self.lookup_nodes)
        stats.nodes_offered += int(tree.num_nodes.sum()) + int(extensions.num.sum())
        # Lookup nodes compete with the draft's for the node budget, and with the adaptive budget
        # for the verified rows: as a path probability, their leaf's times the lookup's odds for
        # each of them.
        path_prob, node_depth, num_nodes = _with_extensions(tree, extensions, self.lookup_accuracy.value)
        node_budget = num_nodes
        if policy is not None:
            policy.observe_levels(depth, level)
            selection = policy.select(path_prob, node_depth, num_nodes, num_plain, self._curve_seconds,
                                      explore=explore, drafted_depth=depth)
            self._step_prediction = (selection.tokens, selection.seconds)
            node_budget = selection.node_budget
        node_budget = np.minimum(node_budget, self.node_budget)
        kept = _kept_extensions(path_prob, num_nodes - extensions.num, node_budget)
        if policy is None and not kept.any():
            return tree
        selected = builder.build_tree(node_budget=node_budget - kept)
        if not kept.any():
            return selected
        # The leaf in the selected tree (its rows are numbered anew).
        leaf = np.full(len(candidates), -1, dtype=np.int64)
        for b in np.flatnonzero(kept).tolist():
            leaf[b] = find_node(selected, b, extensions.leaf_path[b])
        return append_extensions(selected, leaf, extensions.tokens, kept)

    def _next_level_pays(self, builder: GraphBuilder, frontier, level: int, num_plain: int,
                         rate_to_beat: float | None) -> bool:
        graph = builder.graph(copy=False)
        return self.policy.next_level_pays(
            level, graph.path_prob[:, 1:], graph.depth[:, 1:], graph.num_nodes, frontier.request_index.numpy(),
            frontier.path_prob.numpy(), num_plain, self._curve_seconds, rate_to_beat)

    def _expand_level(self, runner, builder: GraphBuilder, frontier, batch_rows: np.ndarray,
                      root_pos: np.ndarray, stats: GsdStats) -> torch.Tensor:
        """Draft forwards over the frontier rows of every request (one, unless the rows exceed
        max_num_batched_tokens); hidden states per frontier row, in the frontier's order."""
        request = frontier.request_index.numpy()
        order = np.argsort(request, kind="stable")  # a forward wants rows grouped by request
        request, node_row = request[order], frontier.node_row.numpy()[order]
        depth, token = frontier.depth.numpy()[order], frontier.token_ids.numpy()[order]
        requests, starts = np.unique(request, return_index=True)
        ends = np.append(starts[1:], len(request))
        ancestor_words = builder.draft_ancestor_words
        hidden = []
        for group in _groups_within(ends - starts, self.max_num_tokens):
            level = _Forward(batch_rows=batch_rows[requests[group]])
            for b, s, e in zip(requests[group], starts[group], ends[group]):
                base = root_pos[b]
                level.token_ids.append(token[s:e])
                level.positions.append(base + depth[s:e])
                level.kv_positions.append(base + node_row[s:e])
                level.seq_lens.append(int(base + node_row[s:e].max() + 1))
            rows = slice(starts[group[0]], ends[group[-1]])
            lengths = ends[group] - starts[group]
            query_start = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            # A graph that is a chain so far (one frontier row, numbered as deep as it is: one
            # row per level before it, all its ancestors) needs no graph mask: the causal one is it.
            chain = (lengths == 1) & (node_row[starts[group]] == depth[starts[group]])
            trees = np.flatnonzero(~chain)
            query_tree_row = node_row[rows].astype(np.int32)
            query_tree_row[query_start[chain]] = -1
            attention = None if trees.size == 0 else TreeAttention.build(
                request_index=trees, query_start=query_start[trees], query_len=lengths[trees],
                tree_base=root_pos[requests[group][trees]],
                ancestor_words=ancestor_words[torch.from_numpy(requests[group][trees])],
                query_tree_row=query_tree_row, device=self.device)
            hidden.append(self._forward(runner, level, attention, np.arange(rows.stop - rows.start), stats))
        # Back to the builder's frontier order.
        sorted_hidden = torch.cat(hidden)
        unsorted = torch.empty_like(sorted_hidden)
        unsorted[torch.from_numpy(order).to(unsorted.device)] = sorted_hidden
        return unsorted

    # ------------------------------------------------------------------------------ forward

    def _forward(self, runner, fwd: _Forward, tree: TreeAttention | None,
                 sample_index: np.ndarray, stats: GsdStats) -> torch.Tensor:
        """Run the draft over `fwd` (graph-masked where `tree` says); return the hidden states
        [len(sample_index), H] of the given tokens."""
        device = self.device
        lengths = np.asarray([len(t) for t in fwd.token_ids], dtype=np.int64)
        num_tokens = int(lengths.sum())
        query_start_loc = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=query_start_loc[1:])
        token_ids = torch.from_numpy(np.concatenate(fwd.token_ids)).to(device, torch.int32)
        positions = torch.from_numpy(np.concatenate(fwd.positions)).to(device)
        kv_positions = torch.from_numpy(np.concatenate(fwd.kv_positions)).to(device)

        block_table = runner.input_batch.block_table[self.kv_cache_gid]
        block_size = block_table.block_size
        table = block_table.get_device_tensor(runner.input_batch.num_reqs)[
            torch.from_numpy(fwd.batch_rows).to(device)]
        token_request = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths)).to(device)
        slot_mapping = (table[token_request, kv_positions // block_size].to(torch.int64) * block_size
                        + kv_positions % block_size)
        seq_lens = torch.tensor(fwd.seq_lens, dtype=torch.int32)
        qsl = torch.from_numpy(query_start_loc)
        common = CommonAttentionMetadata(
            query_start_loc=qsl.to(device),
            query_start_loc_cpu=qsl,
            seq_lens=seq_lens.to(device),
            num_reqs=len(lengths),
            num_actual_tokens=num_tokens,
            max_query_len=int(lengths.max()),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=table,
            slot_mapping=slot_mapping,
            causal=True,
            positions=positions,
            seq_lens_cpu_upper_bound=seq_lens,
        )
        with self.tree_slot.holding(tree):
            _, per_layer_metadata = self.build_per_group_and_layer_attn_metadata(common)
        started = time.perf_counter()
        with set_forward_context(per_layer_metadata, self.vllm_config, num_tokens=num_tokens,
                                 slot_mapping=self._get_slot_mapping(num_tokens, slot_mapping)):
            hidden_states = self.model(input_ids=token_ids, positions=positions)
        if isinstance(hidden_states, tuple):
            hidden_states = hidden_states[0]
        stats.draft_model_us += int((time.perf_counter() - started) * 1e6)
        if self.policy is not None:
            self._curve_seconds += float(self.policy.draft_cost(num_tokens))
        return hidden_states[torch.from_numpy(sample_index).to(device)]

    def _step_vocabulary(self, runner, candidates: list[_Candidate]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(extra_ids int64 [E], columns int64 [kept + E]) of a reduced head (engine/draft_head.py)
        for this step: the ids past its kept ones that the draft scores (every id in the
        candidates' own tokens, a prompt's names or a chat's turn markers, and their stop tokens),
        and the token id of each logit column. None: the head scores the whole vocabulary."""
        head = self.draft_head
        if not getattr(head, "reduced", False):
            return None
        token_ids_cpu = runner.input_batch.token_ids_cpu
        ids = []
        for c in candidates:
            context = token_ids_cpu[c.batch_row, :c.root_pos + 1]
            ids.append(context[context >= head.kept])  # few: filter before sorting them
            params = runner.requests[c.req_id].sampling_params
            if params is not None:
                ids.append(np.fromiter(params.all_stop_token_ids, dtype=token_ids_cpu.dtype))
        ids = np.unique(np.concatenate(ids))
        extra_ids = torch.from_numpy(ids[(ids >= head.kept) & (ids < head.vocab_size)].astype(np.int64))
        return extra_ids, logit_columns(head.kept, extra_ids)

    def _children(self, hidden: torch.Tensor, stats: GsdStats, candidates: list[_Candidate] | None = None,
                  request_index: np.ndarray | None = None, depth: np.ndarray | None = None,
                  vocabulary: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's top_k children of each row: (tokens int64 [R, k], probs float32 [R, k],
        descending), CPU. Row r belongs to candidates[request_index[r]] at primary depth
        depth[r]. Greedy requests: the top-k of the draft's softmax. Sampled requests: the
        Gumbel-top-k of the draft's processed scores with the noise of the children's position
        (engine/sampling.py), probs under the noisy softmax. The LM head and its softmax run in
        row chunks (one [chunk, V] float32 copy at a time). A reduced head
        (engine/draft_head.py) scores its kept ids and the step's extra ones (`vocabulary`, from
        _step_vocabulary): the softmax is over those, and the other ids are never children."""
        started = time.perf_counter()
        k = self.graph_params.top_k
        head = self.draft_head
        if vocabulary is None and getattr(head, "reduced", False):  # dummy runs: the kept ids alone
            vocabulary = (None, logit_columns(head.kept, None))
        extra_ids, columns = vocabulary if vocabulary is not None else (None, None)
        tokens = torch.empty((hidden.shape[0], k), dtype=torch.int64)
        probs = torch.empty((hidden.shape[0], k), dtype=torch.float32)
        sampled = np.zeros(hidden.shape[0], dtype=bool)
        if candidates is not None:
            sampled = np.asarray([candidates[b].sampling is not None for b in request_index], dtype=bool)
        chunk = rows_per_chunk(self._vocab_size)
        for lo in range(0, hidden.shape[0], chunk):
            logits = head(hidden[lo:lo + chunk]) if columns is None else head(hidden[lo:lo + chunk], extra_ids)
            rows = np.arange(lo, min(lo + chunk, hidden.shape[0]))
            greedy = rows[~sampled[rows]]
            if greedy.size:
                tokens[greedy], probs[greedy] = top_children(logits[greedy - lo], k, columns)
            drawn = rows[sampled[rows]]
            if drawn.size:
                scores = logits[drawn - lo]
                if columns is not None:  # the noise and the sampling knobs index the whole vocabulary
                    scores = widen(scores, columns, head.vocab_size)
                tokens[drawn], probs[drawn] = self._sampled_children(scores, candidates,
                                                                     request_index[drawn], depth[drawn])
        stats.draft_logits_us += int((time.perf_counter() - started) * 1e6)
        return tokens, probs

    def _sampled_children(self, logits: torch.Tensor, candidates: list[_Candidate], request_index: np.ndarray,
                          depth: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        settings = [candidates[b].sampling for b in request_index]
        device, vocab = logits.device, logits.shape[-1]
        top_k = [s.top_k if s.top_k > 0 else vocab for s in settings]
        top_p = [s.top_p for s in settings]
        scores = processed_scores(
            logits, torch.tensor([s.temperature for s in settings], device=device),
            None if all(k == vocab for k in top_k) else torch.tensor(top_k, device=device),
            None if all(p >= 1.0 for p in top_p) else torch.tensor(top_p, device=device))
        # Children of a depth-d row sit at position root_pos + d + 1.
        positions = np.asarray([candidates[b].root_pos for b in request_index]) + depth + 1
        noise = gumbel_noise(np.asarray([s.noise_key for s in settings]), positions, vocab, device)
        top_tokens, top_probs = gumbel_top_k(scores, noise, self.graph_params.top_k)
        return top_tokens.cpu(), top_probs.cpu()

    # ------------------------------------------------------------------------------ dummy runs

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, *args, **kwargs) -> None:
        """vLLM's dummy, profile and warm-up runs: the draft's largest forward (num_tokens rows,
        no attention metadata, as vLLM's own dummy forwards) and its largest LM-head chunk, so
        that they are compiled and counted in the memory profile. No tree, no request state."""
        num_tokens = min(num_tokens, self.max_num_tokens)
        with set_forward_context(None, self.vllm_config, num_tokens=num_tokens):
            hidden_states = self.model(input_ids=self.input_ids[:num_tokens],
                                       positions=self._get_positions(num_tokens))
        if isinstance(hidden_states, tuple):
            hidden_states = hidden_states[0]
        rows = min(num_tokens, rows_per_chunk(self._vocab_size))
        self._children(torch.rand_like(hidden_states[:rows]), GsdStats())

    @property
    def _vocab_size(self) -> int:
        return self.draft_model_config.get_vocab_size()


def _predicted_rate(decision, depth: int) -> float | None:
    """The model's tokens per second of a step drafted `depth` levels, where it predicted one."""
    return None if decision.forecast is None else decision.forecast.rate(depth)


def _with_extensions(tree: VerificationTree, extensions: Extensions, odds: float
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(path_prob float64 [B, N + E], depth int64 [B, N + E], num_nodes int64 [B]): the tree's
    nodes, each request's lookup nodes right after them, at the leaf's path probability times
    odds per lookup node."""
    num_nodes = tree.num_nodes.numpy()
    batch, width = tree.path_prob.shape
    extra = extensions.tokens.shape[1]
    path_prob = np.zeros((batch, width + extra))
    depth = np.zeros((batch, width + extra), dtype=np.int64)
    path_prob[:, :width], depth[:, :width] = tree.path_prob.numpy(), tree.depth.numpy()
    for b in np.flatnonzero(extensions.leaf >= 0).tolist():
        n, e, leaf = int(num_nodes[b]), int(extensions.num[b]), int(extensions.leaf[b])
        steps = np.arange(1, e + 1)
        path_prob[b, n:n + e] = path_prob[b, leaf] * odds ** steps
        depth[b, n:n + e] = depth[b, leaf] + steps
    return path_prob, depth, num_nodes + extensions.num


def _kept_extensions(path_prob: np.ndarray, num_draft: np.ndarray, node_budget: np.ndarray) -> np.ndarray:
    """int64 [B]: how many of each request's lookup nodes (the columns from num_draft[b] on) are
    among its node_budget[b] most likely nodes (ties: the earlier column, as select orders)."""
    kept = np.zeros(len(num_draft), dtype=np.int64)
    for b in np.flatnonzero(node_budget > 0).tolist():
        best = np.argsort(-path_prob[b], kind="stable")[: int(node_budget[b])]
        kept[b] = int((best >= num_draft[b]).sum())
    return kept


def _groups_within(sizes: np.ndarray, cap: int) -> list[np.ndarray]:
    """Consecutive index groups of `sizes` whose sums stay <= cap (each size is <= cap)."""
    groups, first, used = [], 0, 0
    for index, size in enumerate(sizes.tolist()):
        if used + size > cap:
            groups.append(np.arange(first, index))
            first, used = index, 0
        used += size
    groups.append(np.arange(first, len(sizes)))
    return groups
