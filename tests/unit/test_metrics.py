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
