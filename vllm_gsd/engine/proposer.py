"""The GSD drafter: catch the draft model up, then grow each request's hypothesis graph.

Contract (called by the V1 model runner after bookkeeping, like vLLM's CPU-list drafters)::

    propose_tree(runner, scheduler_output, valid_sampled_token_ids) -> list[list[int]]

returns, per request of the runner's batch, the flattened tree's node tokens (breadth-first,
docs/contracts.md), or [] where the request gets no speculation this step. The tree's shape is
kept in `self.trees[req_id]` for the next step's verification (vllm_v0_32/runner/step_hooks.py).

One step runs the drafter's jobs (engine/drafter/), for the requests that may grow a tree:
0. Policy (the adaptive node budget, drafter/adaptive.py): at this load, which depth (or plain
   decoding) is expected to emit the most tokens per second, corrected by whole steps as they
   measured? If plain, nothing runs on the draft this step.
1. Catch-up (drafter/catch_up.py): the draft runs causally over every token it has not seen yet,
   up to and including the new root (the last sampled token), writing its own KV.
2. Expansion (drafter/grow.py): the hypothesis graph grows level by level, one batched draft
   forward per level over every request's frontier (graph-masked), children by the draft's
   top-k or keyed Gumbel-top-k (drafter/children.py), while a level is expected to pay.
3. The graph is unrolled into the verification tree, lookup nodes offered past its deepest likely
   leaf; the policy keeps each request's most likely nodes, as many as maximize the batch's
   expected tokens per second.
Everything here is deterministic given the batch (the cost curves are shared by all ranks), so
every tensor-parallel rank builds the same tree. `_forward`, `_children` and `_grow` are the
seams the test probes and the step profiler wrap (vllm_gsd/testing/worker_probes.py,
scripts/profile_step.py).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.utils.platform_utils import is_pin_memory_available
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from vllm_gsd.engine import LOGGER_NAME
from vllm_gsd.engine.cost_calibration import budget_cost_curves
from vllm_gsd.engine.draft_head import DraftHead, draft_head
from vllm_gsd.engine.drafter.adaptive import AdaptiveBudget
from vllm_gsd.engine.drafter.batch import DraftBatch
from vllm_gsd.engine.drafter.catch_up import catch_up
from vllm_gsd.engine.drafter.children import Children, Vocabulary, draft_children, step_vocabulary
from vllm_gsd.engine.drafter.choose import Candidate, CandidateChooser, tokens_left
from vllm_gsd.engine.drafter.feedback import observe_verified
from vllm_gsd.engine.drafter.forward_metadata import DraftForward, forward_inputs, level_forwards
from vllm_gsd.engine.drafter.grow import grow_levels, start_graph, verification_tree
from vllm_gsd.engine.lookup import LookupAccuracy
from vllm_gsd.engine.lookup import warm_up as warm_up_lookup
from vllm_gsd.engine.metrics import GsdStats
from vllm_gsd.engine.rank_consistency import check_same_on_all_ranks, tree_fingerprint
from vllm_gsd.engine.scorer import rows_per_chunk
from vllm_gsd.engine.staging import HostStaging
from vllm_gsd.engine.tree_batch import TreeAttention, TreeSlot
from vllm_gsd.graph import Frontier, GraphBuilder, VerificationTree, warm_up

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


class GsdProposer(DraftModelProposer):
    """Draft model loading, KV layers and attention groups are vLLM's draft_model ones."""

    def __init__(self, vllm_config, device, runner, tree_slot: TreeSlot):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        self.tree_slot = tree_slot
        self.staging = HostStaging(device, is_pin_memory_available())  # draft forwards' host arrays
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
        self.budget: AdaptiveBudget | None = None  # set by prepare_policy when adaptive
        self.chooser = CandidateChooser(self.node_budget, self.max_model_len, self.vllm_config.model_config.seed)
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
        if not knobs.adaptive or self.budget is not None:
            return
        target_cost, draft_cost = budget_cost_curves(runner, self, knobs.cost_curve)
        self.budget = AdaptiveBudget.build(target_cost, draft_cost, self.node_budget, knobs,
                                           self.vllm_config.parallel_config.tensor_parallel_size)

    def record_target_forward(self, num_tokens: int, seconds: float, verified_trees: bool) -> None:
        """The runner's target forward of this step took `seconds` (vllm_v0_32/runner/step_hooks.py)."""
        if self.budget is not None:
            self.budget.record_target_forward(num_tokens, seconds, verified_trees)

    # ------------------------------------------------------------------------------ the step

    @torch.inference_mode()
    def propose_tree(self, runner, scheduler_output, valid_sampled_token_ids: list[list[int]]
                     ) -> list[list[int]]:
        batch = DraftBatch.of(runner, self.kv_cache_gid)
        stats = GsdStats()
        budget = self.budget
        if budget is not None:
            budget.learn_step(scheduler_output, valid_sampled_token_ids, stats)
        observe_verified(self.trees, batch.req_ids, scheduler_output, valid_sampled_token_ids,
                         budget.policy.acceptance if budget is not None else None, self.lookup_accuracy, stats)
        for req_id in scheduler_output.finished_req_ids:
            self.trees.pop(req_id, None)
        self.chooser.forget(scheduler_output.finished_req_ids)
        # A request left out of this step keeps its tree: the scheduler keeps its draft tokens.
        in_batch = set(batch.req_ids)
        self.trees = {r: tree for r, tree in self.trees.items() if r not in in_batch}
        drafts: list[list[int]] = [[] for _ in batch.req_ids]
        chosen = self.chooser.choose(batch, scheduler_output, valid_sampled_token_ids)
        candidates, num_plain = chosen.candidates, chosen.num_plain
        if not candidates:
            self._record(stats)
            return drafts
        depth, explore, rate_to_beat = self.graph_params.max_depth, False, None
        # With a referee no step explores, so these candidates are the ones that draft.
        catch_up_excess = budget.catch_up_excess(candidates, valid_sampled_token_ids) if budget is not None else 0.0
        if budget is not None:
            # Only a catch-up has to pay back within the tokens left (referee.choose).
            left = tokens_left(batch, candidates) if catch_up_excess > 0 else None
            decision = budget.decide(batch.num_reqs, len(candidates), num_plain, stats, catch_up_excess, left)
            depth, rate_to_beat = decision.depth, decision.rate_to_beat
            logger.debug("gsd: %d tree candidates, %d other requests: %s (%s)", len(candidates), num_plain,
                         f"draft {depth} levels" if depth else "plain step", decision.why)
            if not depth:
                stats.steps_not_speculated += 1
                self._record(stats)
                return drafts
            explore = decision.explorers is not None
            if explore and decision.explorers < len(candidates):
                budget.record.drafted_partially = True
                # The least behind: their catch-up is the shortest (then back in batch order).
                least_behind = sorted(candidates, key=lambda c: c.root_pos - c.catch_up_from)
                num_plain += len(candidates) - decision.explorers
                candidates = sorted(least_behind[:decision.explorers], key=lambda c: c.batch_row)
            budget.record.depth = depth

        started = time.perf_counter()
        if budget is not None:
            budget.record.draft_curve_seconds = 0.0
        forward = functools.partial(self._forward, batch, stats=stats)
        caught_up = catch_up(candidates, batch.token_ids, self.max_num_tokens, forward)
        stats.draft_tokens_computed += caught_up.num_tokens
        stats.levels_drafted += 1
        if budget is not None:
            budget.policy.observe_forward(0, caught_up.num_tokens, len(candidates))
        self.chooser.advance(batch, candidates)
        if budget is not None and budget.referee is not None:
            budget.record.catch_up_excess = catch_up_excess
        tree = self._grow(batch, candidates, caught_up.root_hidden, num_plain, stats, depth, explore, rate_to_beat)
        self._keep_trees(tree, candidates, drafts, stats)
        drafted_in = time.perf_counter() - started
        stats.draft_step_us += int(drafted_in * 1e6)
        if budget is not None:
            budget.record_draft_step(drafted_in)
        self._check_ranks_agree(batch.req_ids, drafts)
        self._record(stats)
        return drafts

    def _keep_trees(self, tree: VerificationTree, candidates: list[Candidate], drafts: list[list[int]],
                    stats: GsdStats) -> None:
        """Keep each candidate's tree for its verification; its node tokens are its drafts."""
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

    def _record(self, stats: GsdStats) -> None:
        """Add this step's drafting figures to the worker's GSD metrics."""
        if self.metrics is not None:
            self.metrics.add(**vars(stats))  # flat ints (asdict deep-copies: slow every step)
            self.metrics.step_done()

    def _check_ranks_agree(self, req_ids: list[str], drafts: list[list[int]]) -> None:
        if self.vllm_config.parallel_config.tensor_parallel_size == 1:
            return
        from vllm.distributed import get_tp_group

        parents = [self.trees[r].parent_row.tolist() if r in self.trees else [] for r in req_ids]
        group = get_tp_group()
        check_same_on_all_ranks(tree_fingerprint(drafts, parents), group.cpu_group, group.rank_in_group)

    # ------------------------------------------------------------------------------ seams

    def _grow(self, batch: DraftBatch, candidates: list[Candidate], root_hidden: torch.Tensor, num_plain: int,
              stats: GsdStats, depth: int, explore: bool = False, rate_to_beat: float | None = None
              ) -> VerificationTree:
        """Draft the candidates' graphs from their roots' hidden states and return the tree to
        verify (drafter/grow.py)."""
        builder = start_graph(self.graph_params, batch, candidates, self.history_len)
        batch_rows = np.asarray([c.batch_row for c in candidates], dtype=np.int64)
        root_pos = np.asarray([c.root_pos for c in candidates], dtype=np.int64)
        vocabulary = step_vocabulary(self.draft_head, batch, candidates)

        def expand(builder: GraphBuilder, frontier: Frontier) -> torch.Tensor:
            level = level_forwards(frontier, builder.draft_ancestor_words, batch_rows, root_pos,
                                   self.max_num_tokens, self.device)
            sorted_hidden = torch.cat([self._forward(batch, fwd, attention, np.arange(sum(map(len, fwd.token_ids))),
                                                     stats) for fwd, attention in level.forwards])
            if (level.order == np.arange(level.order.size)).all():  # the frontier was grouped already
                return sorted_hidden
            hidden = torch.empty_like(sorted_hidden)  # back to the frontier's order
            (order,) = self.staging.stage([level.order])
            hidden[order] = sorted_hidden
            return hidden

        def children(hidden: torch.Tensor, request_index: np.ndarray, row_depth: np.ndarray,
                     node_row: np.ndarray) -> Children:
            def paths(rows: np.ndarray) -> list[list[int]]:
                return builder.paths_below_root(request_index[rows], node_row[rows])

            return self._children(hidden, stats, candidates, request_index, row_depth, vocabulary, paths)

        levels = grow_levels(builder, root_hidden, depth, num_plain, expand, children, self.budget, stats,
                             explore, rate_to_beat)
        return verification_tree(builder, batch, candidates, self.node_budget, self.lookup_nodes,
                                 self.lookup_accuracy.value, self.budget, num_plain, depth, levels, stats, explore)

    def _forward(self, batch: DraftBatch, fwd: DraftForward, tree: TreeAttention | None, sample_index: np.ndarray,
                 stats: GsdStats) -> torch.Tensor:
        """Run the draft over `fwd` (graph-masked where `tree` says); return the hidden states
        [len(sample_index), H] of the given tokens."""
        inputs = forward_inputs(fwd, batch.block_table, batch.num_reqs, self.staging, sample_index)
        with self.tree_slot.holding(tree):
            _, per_layer_metadata = self.build_per_group_and_layer_attn_metadata(inputs.common)
        started = time.perf_counter()
        mode, descriptor = self.cudagraph_dispatcher.dispatch(inputs.num_tokens)
        num_tokens = descriptor.num_tokens  # padded to a captured size (CUDA graphs), else as given
        input_ids, positions = ((inputs.token_ids, inputs.positions) if mode == CUDAGraphMode.NONE
                                else self._graph_inputs(inputs.token_ids, inputs.positions, num_tokens))
        with set_forward_context(per_layer_metadata, self.vllm_config, num_tokens=num_tokens,
                                 cudagraph_runtime_mode=mode, batch_descriptor=descriptor,
                                 slot_mapping=self._get_slot_mapping(num_tokens, inputs.slot_mapping)):
            hidden_states = self.model(input_ids=input_ids, positions=positions)
        if isinstance(hidden_states, tuple):
            hidden_states = hidden_states[0]
        stats.draft_model_us += int((time.perf_counter() - started) * 1e6)
        if self.budget is not None:
            self.budget.record.draft_curve_seconds += float(self.budget.policy.draft_cost(inputs.num_tokens))
        return hidden_states[inputs.sample_index]

    def _graph_inputs(self, token_ids: torch.Tensor, positions: torch.Tensor, num_tokens: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft forward's tokens and positions in the drafter's persistent buffers, padded to
        `num_tokens` (a captured CUDA-graph size): the graphs replay on the addresses they were
        captured with. Padding rows read position 0 and write no KV (their slots are padding)."""
        n = token_ids.shape[0]
        self.input_ids[:n].copy_(token_ids)
        self.input_ids[n:num_tokens].zero_()
        self._set_positions(n, positions)
        self.positions[n:num_tokens].zero_()
        return self.input_ids[:num_tokens], self._get_positions(num_tokens)

    def _children(self, hidden: torch.Tensor, stats: GsdStats, candidates: list[Candidate] | None = None,
                  request_index: np.ndarray | None = None, depth: np.ndarray | None = None,
                  vocabulary: Vocabulary | None = None, paths=None) -> Children:
        """The draft's top_k children of each row (drafter/children.py)."""
        started = time.perf_counter()
        children = draft_children(self.draft_head, hidden, self.graph_params.top_k, self._vocab_size, candidates,
                                  request_index, depth, vocabulary, self.staging, paths)
        stats.draft_logits_us += int((time.perf_counter() - started) * 1e6)
        return children

    # ------------------------------------------------------------------------------ dummy runs

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, use_cudagraphs: bool = False, is_graph_capturing: bool = False,
                  **kwargs) -> None:
        """vLLM's dummy, profile, warm-up and capture runs: the draft's largest forward
        (num_tokens rows, no attention metadata, as vLLM's own dummy forwards) and its largest
        LM-head chunk, so that they are compiled and counted in the memory profile; where the
        runner captures CUDA graphs (`use_cudagraphs`), the draft's piecewise graph of that size
        is captured too, as vLLM's drafter does, and `_forward` replays it. No tree, no request
        state."""
        num_tokens = min(num_tokens, self.max_num_tokens)
        mode, descriptor = self.cudagraph_dispatcher.dispatch(
            num_tokens, valid_modes=None if use_cudagraphs else {CUDAGraphMode.NONE})
        num_tokens = descriptor.num_tokens
        with set_forward_context(None, self.vllm_config, num_tokens=num_tokens, cudagraph_runtime_mode=mode,
                                 batch_descriptor=descriptor):
            hidden_states = self.model(input_ids=self.input_ids[:num_tokens],
                                       positions=self._get_positions(num_tokens))
        if is_graph_capturing:
            return  # the capture is the graph's; the LM head ran in the warm-up before it
        if isinstance(hidden_states, tuple):
            hidden_states = hidden_states[0]
        rows = min(num_tokens, rows_per_chunk(self._vocab_size))
        self._children(torch.rand_like(hidden_states[:rows]), GsdStats())

    @property
    def _vocab_size(self) -> int:
        return self.draft_model_config.get_vocab_size()
