"""GSD's worker metrics."""

from __future__ import annotations


def test_two_metrics_in_one_process_share_the_prometheus_counters():
    """vLLM's in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0) builds a second gsd
    worker in the same process: its metrics must not register the counters again."""
    from vllm_gsd.engine.metrics import GsdMetrics

    first, second = GsdMetrics(), GsdMetrics()
    for metrics in (first, second):
        metrics.add(trees_verified=2)
        metrics.step_done()
    assert first._counters is second._counters and first._counters


def _scheduled(num_tokens: dict, spec: dict):
    from types import SimpleNamespace

    return SimpleNamespace(num_scheduled_tokens=num_tokens, scheduled_spec_decode_tokens=spec)


def test_phase_timers_cover_decode_steps_only():
    """A prefill's forwards take seconds; averaged into the per-step split they would hide what a
    decode step costs (the split must add up to a decode step's wall time)."""
    from vllm_gsd.engine.metrics import GsdMetrics

    metrics = GsdMetrics()
    metrics.begin_step(_scheduled({"a": 300}, {}))  # a prompt
    metrics.add(target_forward_us=2_000_000, draft_step_us=600_000, draft_tokens_computed=300)
    metrics.step_done()
    metrics.begin_step(_scheduled({"a": 5, "b": 1}, {"a": [7, 8, 9, 10]}))  # a tree and a plain decode
    metrics.add(target_forward_us=180_000, draft_step_us=150_000, verify_us=3_000)
    metrics.step_done()
    metrics.begin_step(_scheduled({"a": 5, "c": 40}, {"a": [7, 8, 9, 10]}))  # a decode beside a chunk
    metrics.add(target_forward_us=500_000)
    metrics.step_done()
    stats = metrics.stats
    assert (stats.steps, stats.decode_steps) == (3, 1)
    assert (stats.target_forward_us, stats.draft_step_us, stats.verify_us) == (180_000, 150_000, 3_000)
    assert stats.draft_tokens_computed == 300  # counts are not timers: every step's count


def test_only_the_exporting_rank_adds_to_the_process_counters():
    """Every tensor-parallel rank drafts and scores the same trees and counts the same figures;
    were each to export them, /metrics (which sums every worker process's counters) would show
    them tp times. Two ranks: only rank 0's steps reach the counters; both keep their figures
    (gsd_stats reads them from a worker)."""
    from prometheus_client import REGISTRY

    from vllm_gsd.engine.metrics import GsdMetrics

    def exported() -> float:
        return REGISTRY.get_sample_value("vllm:gsd_trees_verified_total") or 0.0

    rank0, rank1 = GsdMetrics(exports=True), GsdMetrics(exports=False)
    before = exported()
    for metrics in (rank0, rank1):
        metrics.add(trees_verified=3)
        metrics.step_done()
    assert exported() - before == 3
    assert rank0.stats.trees_verified == rank1.stats.trees_verified == 3


def test_tree_counts_read_the_accepted_paths_once():
    """sampling_hooks._tree_counts: the step's counters and each request's accepted count and
    nodes from the accepted paths (a path through a merged node counts once per request)."""
    import torch

    from vllm_gsd.graph import AcceptedPaths
    from vllm_gsd.vllm_v0_32.runner.sampling_hooks import _tree_counts

    class Tree:  # what _tree_counts reads of a TreeBatch
        num_nodes = torch.tensor([3, 0, 2, 4])
        via_merge = torch.tensor([[False, True, False, False], [False] * 4,
                                  [False, False, False, False], [False, False, False, True]])

    accepted = AcceptedPaths(
        accepted_rows=torch.tensor([[0, 2, -1, -1, -1], [0, -1, -1, -1, -1], [0, 1, 2, -1, -1], [0, 1, 3, -1, -1]]),
        output_token_ids=torch.zeros(4, 5, dtype=torch.int64),
        num_accepted=torch.tensor([1, 0, 2, 2]))
    num_accepted, accepted_nodes, counts = _tree_counts(Tree(), accepted)
    assert num_accepted == [1, 0, 2, 2]
    assert accepted_nodes == [[1], [], [0, 1], [0, 2]]  # node = row - 1, root first
    # request 0 accepted node 1 (row 2, merged); request 3 nodes 0 and 2 (not node 3, merged)
    assert counts == {"trees_verified": 3, "nodes_verified": 9, "accepted_nodes": 5, "paths_through_merge": 1}
