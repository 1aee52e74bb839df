"""After a gsd runner's target forward: the `_sample` wrapper that vllm_v0_32/patches.py installs.

The rejection sampler is GsdRejectionSampler (vllm_v0_32/scorer.py), which scores the trees;
then the accepted nodes' KV moves to consecutive positions (`_compact_target_kv`) and GSD's
counters are updated. An error in this on one rank of a multi-worker engine stops the engine
(runner/rank_failure.py).
"""

from __future__ import annotations

import functools
import time

import torch

from vllm_gsd.engine.tree_batch import TreeBatch
from vllm_gsd.vllm_v0_32.runner.rank_failure import stop_on_rank_failure
from vllm_gsd.vllm_v0_32.runner.state import is_gsd_runner
from vllm_gsd.vllm_v0_32.spec_decode import TreeSpecDecodeMetadata


def wrap_sample(original):
    """Score (vLLM's sampler slots), then move the accepted nodes' KV and count the trees."""

    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        if not is_gsd_runner(self) or not isinstance(spec_decode_metadata, TreeSpecDecodeMetadata):
            return original(self, logits, spec_decode_metadata)
        try:
            started = time.perf_counter()
            output = original(self, logits, spec_decode_metadata)
            scored = time.perf_counter()
            tree = spec_decode_metadata.tree
            num_accepted, accepted_paths, counts = _tree_counts(tree, output.accepted)
            _commit_thinking(tree, accepted_paths)
            counted = time.perf_counter()
            _compact_target_kv(self, tree, output.accepted, max(num_accepted, default=0))
            self.gsd.metrics.add(verify_us=int((scored - started) * 1e6),
                                 kv_compaction_us=int((time.perf_counter() - counted) * 1e6),
                                 **counts)
        except Exception as error:
            stop_on_rank_failure(self, "tree scoring", error)
        return output

    return _sample


def _tree_counts(tree: TreeBatch, accepted) -> tuple[list[int], list[list[int]], dict[str, int]]:
    """Each request's accepted node count, its accepted nodes (indices, root first) and GSD's
    verification counters for one step.

    One device-to-host read: each request's accepted count beside its accepted rows, stacked
    (the merge lookup of the accepted paths then runs on the host's `via_merge`)."""
    num_nodes = tree.num_nodes.tolist()
    host = torch.cat([accepted.num_accepted.reshape(-1, 1).to(torch.int64),
                      accepted.accepted_rows.to(torch.int64)], dim=1).tolist()
    num_accepted = [row[0] for row in host]
    # accepted_rows[b] is [0, row of the first accepted node, ...]: node = row - 1.
    accepted_nodes = [[row - 1 for row in host[b][2:num_accepted[b] + 2]] for b in range(len(host))]
    trees = [b for b, n in enumerate(num_nodes) if n]
    through_merge = sum(bool(tree.via_merge[b, accepted_nodes[b]].any()) for b in trees if accepted_nodes[b])
    return num_accepted, accepted_nodes, {"trees_verified": len(trees), "nodes_verified": sum(num_nodes),
                          "accepted_nodes": sum(num_accepted[b] for b in trees),
                          "paths_through_merge": through_merge}


def _commit_thinking(tree: TreeBatch, accepted_nodes: list[list[int]]) -> None:
    """Requests with a thinking budget: vLLM's state as the target alone leaves it after the
    accepted path (vllm_v0_32/thinking_budget.py)."""
    for b, options in enumerate(tree.options):
        if options is not None and options.thinking is not None:
            options.thinking.commit(tree.draft_token_ids[b, accepted_nodes[b]].tolist())


def _compact_target_kv(runner, tree: TreeBatch, accepted, max_accepted: int) -> None:
    """Move each request's accepted nodes' KV to consecutive positions after its root
    (max_accepted: the most nodes a request accepted, read by `_tree_counts`)."""
    from vllm_gsd.kernels.kv_compaction import compact_kv, compact_kv_cpu

    num_accepted = accepted.num_accepted
    if max_accepted == 0:
        return
    block_table = runner.input_batch.block_table[runner.drafter.kv_cache_gid]
    table = block_table.get_device_tensor(runner.input_batch.num_reqs)
    (tree_base,) = runner.drafter.staging.stage([tree.tree_base])  # one pinned, non-blocking copy
    tree_base = tree_base.to(torch.int32)
    on_cpu = table.device.type == "cpu"
    if on_cpu:
        compact_kv_cpu(runner.gsd.target_kv_caches, table, block_table.block_size, tree_base,
                       accepted.accepted_rows, num_accepted, runner.gsd.target_cache_packing)
    else:
        compact_kv(runner.gsd.target_kv_caches, table, block_table.block_size, tree_base,
                   accepted.accepted_rows, num_accepted, layout="gpu_bhnc")
