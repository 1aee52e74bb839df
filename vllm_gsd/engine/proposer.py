"""The GSD drafter: catch the draft model up, then grow each request's hypothesis graph.

Contract (called by the V1 model runner after bookkeeping, like vLLM's CPU-list drafters)::

    propose_tree(runner, scheduler_output, valid_sampled_token_ids) -> list[list[int]]

returns, per request of the runner's batch, the flattened tree's node tokens (breadth-first,
docs/contracts.md), or [] where the request gets no speculation this step. The tree's shape is
kept in `self.trees[req_id]` for the next step's verification (engine/runner_hooks.py).

One step, per request of the batch:
1. Catch-up: the draft runs causally over the tokens the target committed this step plus the new
   root (the last sampled token), at their real positions, writing its own KV. Tree slots it
   wrote last step are overwritten here, so the draft's cache holds only accepted tokens.
2. Expansion: the hypothesis graph (vllm_gsd.graph.GraphBuilder) grows level by level; each level
   is ONE draft forward over the frontier rows of every request, where graph row g is written to
   KV position root_pos + g, rotated at root_pos + depth(g), and attends to the context plus its
   primary ancestors (graph mask). The draft's top-k children feed the builder's pruning,
   merging and node budget.
3. The graph is unrolled into the verification tree.
Everything here is deterministic given the batch, so every tensor-parallel rank builds the same
tree.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from vllm_gsd.engine.eligibility import tree_refusal_reason
from vllm_gsd.engine.metrics import GsdStats
from vllm_gsd.engine.rank_consistency import check_same_on_all_ranks, tree_fingerprint
from vllm_gsd.engine.tree_attention import TreeMask, graph_mask
from vllm_gsd.graph import GraphBuilder, GraphParams, VerificationTree

logger = logging.getLogger("vllm_gsd")


@dataclass
class ProposedTree:
    """One request's verification tree, as proposed (CPU tensors, length n = num nodes)."""

    draft_token_ids: torch.Tensor  # int64 [n]
    parent_row: torch.Tensor  # int64 [n]
    depth: torch.Tensor  # int64 [n]
    via_merge: torch.Tensor  # bool [n]


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

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        spec = self.speculative_config
        knobs = spec.gsd
        self.node_budget = spec.num_speculative_tokens
        self.graph_params = GraphParams(
            node_budget=self.node_budget,
            top_k=knobs.top_k,
            max_depth=knobs.max_depth,
            merge_ngram=knobs.merge_ngram,
            min_child_ratio=knobs.min_child_ratio,
            leaf_prob=knobs.leaf_prob,
        )
        self.history_len = max(knobs.merge_ngram, 0)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.trees: dict[str, ProposedTree] = {}
        self._refusals_logged: set[str] = set()
        self.metrics = None  # engine.metrics.GsdMetrics of the worker

    def _record(self, stats: GsdStats) -> None:
        """Add this step's drafting figures to the worker's GSD metrics."""
        if self.metrics is not None:
            self.metrics.add(**asdict(stats))
            self.metrics.step_done()

    # ------------------------------------------------------------------------------ public

    @torch.inference_mode()
    def propose_tree(self, runner, scheduler_output, valid_sampled_token_ids: list[list[int]]
                     ) -> list[list[int]]:
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        req_ids = list(batch.req_ids[:num_reqs])
        self.trees = {}
        stats = GsdStats()
        drafts: list[list[int]] = [[] for _ in range(num_reqs)]

        catch_up = _Forward(batch_rows=np.zeros(0, dtype=np.int64))
        rows, root_pos = [], []
        for i, req_id in enumerate(req_ids):
            num_scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if num_scheduled == 0:
                continue
            num_spec = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            start = int(batch.num_computed_tokens_cpu[i])
            num_sampled = len(valid_sampled_token_ids[i])
            end = min(int(batch.num_tokens_no_spec[i]), start + num_scheduled - num_spec + num_sampled)
            if end <= start:
                continue
            rows.append(i)
            catch_up.token_ids.append(batch.token_ids_cpu[i, start:end].astype(np.int64))
            positions = np.arange(start, end, dtype=np.int64)
            catch_up.positions.append(positions)
            catch_up.kv_positions.append(positions)
            catch_up.seq_lens.append(end)
            root_pos.append(end - 1 if num_sampled > 0 else -1)
        if not rows:
            self._record(stats)
            return drafts
        catch_up.batch_rows = np.asarray(rows, dtype=np.int64)
        last_index = np.cumsum([len(t) for t in catch_up.token_ids]) - 1
        root_logits = self._forward(runner, catch_up, None, last_index)
        stats.draft_tokens_computed += int(last_index[-1] + 1)

        # Which requests grow a tree this step.
        tree_rows, tree_root_pos, tree_logit_rows = [], [], []
        for k, (i, pos) in enumerate(zip(rows, root_pos)):
            if pos < 0 or not self._may_grow_tree(runner, i, req_ids[i], pos):
                continue
            tree_rows.append(i)
            tree_root_pos.append(pos)
            tree_logit_rows.append(k)
        if not tree_rows:
            self._record(stats)
            return drafts

        tree = self._grow(runner, np.asarray(tree_rows, dtype=np.int64),
                          np.asarray(tree_root_pos, dtype=np.int64),
                          root_logits[tree_logit_rows], stats)
        num_nodes = tree.num_nodes.tolist()
        for b, i in enumerate(tree_rows):
            n = num_nodes[b]
            if n == 0:
                continue
            proposed = ProposedTree(
                draft_token_ids=tree.draft_token_ids[b, :n].clone(),
                parent_row=tree.parent_row[b, :n].clone(),
                depth=tree.depth[b, :n].clone(),
                via_merge=tree.via_merge[b, :n].clone(),
            )
            self.trees[req_ids[i]] = proposed
            drafts[i] = proposed.draft_token_ids.tolist()
        stats.graph_nodes_drafted += int(tree.num_graph_nodes.sum())
        stats.merges += int(tree.num_merges.sum())
        stats.draft_expansions_saved += int(tree.expansions_saved.sum())
        self._check_ranks_agree(req_ids, drafts)
        self._record(stats)
        return drafts

    def _check_ranks_agree(self, req_ids: list[str], drafts: list[list[int]]) -> None:
        if self.vllm_config.parallel_config.tensor_parallel_size == 1:
            return
        from vllm.distributed import get_tp_group

        parents = [self.trees[r].parent_row.tolist() if r in self.trees else [] for r in req_ids]
        group = get_tp_group()
        check_same_on_all_ranks(tree_fingerprint(drafts, parents), group.cpu_group,
                                group.rank_in_group)

    # ------------------------------------------------------------------------------ steps

    def _may_grow_tree(self, runner, batch_row: int, req_id: str, root_pos: int) -> bool:
        state = runner.requests[req_id]
        reason = tree_refusal_reason(state.sampling_params, len(state.output_token_ids))
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

    def _grow(self, runner, batch_rows: np.ndarray, root_pos: np.ndarray,
              root_logits: torch.Tensor, stats: GsdStats) -> VerificationTree:
        batch = runner.input_batch
        roots = torch.from_numpy(batch.token_ids_cpu[batch_rows, root_pos].astype(np.int64))
        history = torch.full((len(batch_rows), self.history_len), -1, dtype=torch.int64)
        for col in range(self.history_len):
            pos = root_pos - self.history_len + col
            ok = pos >= 0
            history[torch.from_numpy(ok), col] = torch.from_numpy(
                batch.token_ids_cpu[batch_rows[ok], pos[ok]].astype(np.int64))
        builder = GraphBuilder(self.graph_params, roots, history)
        frontier_logits = root_logits
        while True:
            frontier = builder.frontier()
            if frontier is None:
                break
            if frontier_logits is None:
                frontier_logits = self._expand_level(runner, builder, frontier, batch_rows, root_pos)
                stats.draft_tokens_computed += int(frontier.request_index.numel())
            probs = torch.softmax(frontier_logits.float(), dim=-1)
            top_probs, top_tokens = probs.topk(self.graph_params.top_k, dim=-1)
            builder.expand(top_tokens.cpu(), top_probs.cpu())
            frontier_logits = None
        return builder.build_tree()

    def _expand_level(self, runner, builder: GraphBuilder, frontier, batch_rows: np.ndarray,
                      root_pos: np.ndarray) -> torch.Tensor:
        """One draft forward over the frontier rows of every request; logits per frontier row."""
        request = frontier.request_index.numpy()
        order = np.argsort(request, kind="stable")  # the forward wants rows grouped by request
        request, node_row = request[order], frontier.node_row.numpy()[order]
        depth, token = frontier.depth.numpy()[order], frontier.token_ids.numpy()[order]
        requests, starts = np.unique(request, return_index=True)
        ends = np.append(starts[1:], len(request))
        level = _Forward(batch_rows=batch_rows[requests])
        for b, s, e in zip(requests, starts, ends):
            base = root_pos[b]
            level.token_ids.append(token[s:e])
            level.positions.append(base + depth[s:e])
            level.kv_positions.append(base + node_row[s:e])
            level.seq_lens.append(int(base + node_row[s:e].max() + 1))
        mask = TreeMask(
            request_index=torch.arange(len(requests), dtype=torch.int64),
            tree_base=torch.from_numpy(root_pos[requests].astype(np.int32)),
            ancestor_words=builder.draft_ancestor_words[torch.from_numpy(requests)],
            query_tree_row=torch.from_numpy(node_row.astype(np.int32)),
        )
        logits = self._forward(runner, level, mask, np.arange(len(request)))
        # Back to the builder's frontier order.
        unsorted = torch.empty_like(logits)
        unsorted[torch.from_numpy(order)] = logits
        return unsorted

    # ------------------------------------------------------------------------------ forward

    def _forward(self, runner, fwd: _Forward, mask: TreeMask | None,
                 sample_index: np.ndarray) -> torch.Tensor:
        """Run the draft over `fwd`; return logits [len(sample_index), V] of the given tokens."""
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
        _, per_layer_metadata = self.build_per_group_and_layer_attn_metadata(common)
        with set_forward_context(per_layer_metadata, self.vllm_config, num_tokens=num_tokens,
                                 slot_mapping=self._get_slot_mapping(num_tokens, slot_mapping)), \
                graph_mask(mask):
            hidden_states = self.model(input_ids=token_ids, positions=positions)
        if isinstance(hidden_states, tuple):
            hidden_states = hidden_states[0]
        return self.model.compute_logits(hidden_states[torch.from_numpy(sample_index).to(device)])
