"""The target forward's StepTimer (engine/cost_calibration.py) and the host-read counter
(testing/host_reads.py) on plain tensors. The engine figures: tests/engine/test_host_reads.py."""

from __future__ import annotations

import pytest
import torch

from vllm_gsd.engine.cost_calibration import CudaStepTimer, HostStepTimer, StepTimer
from vllm_gsd.testing.host_reads import HostReadCounter, StepReads


class _FakeEvent:
    """torch.cuda.Event's timing surface over a fake stream: `record` stamps the event with the
    stream's position; it is done once the stream has run that far; `synchronize` fails the
    test (the timer must not wait where the stream is past the event)."""

    def __init__(self, stream):
        self.stream, self.stamp = stream, None

    def record(self):
        self.stamp = self.stream.queued
        self.stream.queued += 1

    def query(self):
        return self.stamp is not None and self.stamp < self.stream.done

    def elapsed_time(self, end):
        assert self.query() and end.query()
        return self.stream.ms[end.stamp] - self.stream.ms[self.stamp]

    def synchronize(self):  # pragma: no cover - the test fails if reached
        raise AssertionError("the timer waited for the device")


class _FakeStream:
    def __init__(self):
        self.queued = self.done = 0
        self.ms = {}

    def run_to(self, position, at_ms):
        for stamp in range(self.done, position):
            self.ms[stamp] = at_ms + stamp  # 1 ms between consecutive events
        self.done = position


def test_host_timer_gives_each_forward_at_stop():
    clock = iter([1.0, 1.25, 2.0, 2.5]).__next__
    timer = HostStepTimer(clock)
    timer.start()
    timer.stop("a")
    assert timer.finished() == [("a", 0.25)]
    assert timer.finished() == []
    timer.start()
    timer.stop("b")
    assert timer.finished() == [("b", 0.5)]
    assert isinstance(StepTimer.for_device("cpu"), HostStepTimer)


def test_cuda_timer_gives_a_forward_at_the_next_step_without_waiting():
    stream, made = _FakeStream(), []
    timer = CudaStepTimer(event_class=lambda: made.append(_FakeEvent(stream)) or made[-1])
    timer.start()
    timer.stop("step 1")
    assert timer.finished() == []  # this step's: not before the next step starts
    stream.run_to(stream.queued, at_ms=0.0)  # the step's sampled tokens were read: the stream is past it
    timer.start()  # the next step
    assert timer.finished() == [("step 1", pytest.approx(1e-3))]
    timer.stop("step 2")
    assert timer.finished() == []
    stream.run_to(stream.queued, at_ms=10.0)
    for step in range(3, 6):  # the events are reused
        timer.start()
        assert [payload for payload, _ in timer.finished()] == [f"step {step - 1}"]
        timer.stop(f"step {step}")
        stream.run_to(stream.queued, at_ms=20.0)
    assert len(made) == 3 and timer.waits == 0  # three events serve every step


def test_cuda_timer_gives_every_rank_the_same_forwards_when_the_host_runs_ahead():
    """With the host a step ahead of the stream (async scheduling) the last step's end event may
    not be done at the next start: it is waited for, not left for later, so that every rank
    hands the adaptive budget the same forwards (it all-reduces their times)."""
    class _Waitable(_FakeEvent):
        def synchronize(self):
            self.stream.run_to(self.stamp + 1, at_ms=0.0)

    stream = _FakeStream()
    timer = CudaStepTimer(event_class=lambda: _Waitable(stream))
    timer.start()
    timer.stop("step 1")
    timer.start()
    assert [payload for payload, _ in timer.finished()] == ["step 1"]
    assert timer.waits == 1


def test_target_forward_time_measured_later_counts_for_its_own_step():
    """A CUDA-timed forward arrives in the next step: its phase timer follows the step it timed."""
    from types import SimpleNamespace

    from vllm_gsd.engine.metrics import GsdMetrics

    metrics = GsdMetrics()
    metrics.begin_step(SimpleNamespace(num_scheduled_tokens={"a": 300}, scheduled_spec_decode_tokens={}))
    assert not metrics.decode_step
    metrics.add(decode_step=True, target_forward_us=5)  # the decode step before this prefill
    metrics.add(target_forward_us=7)  # this prefill's: not counted
    assert metrics.stats.target_forward_us == 5


def _counted(fn):
    counter = HostReadCounter()
    counter.step = StepReads()
    with counter:
        fn(counter)
    return counter.step


def test_counter_counts_reads_of_device_tensors_only():
    def step(counter):
        logits = counter.mark(torch.randn(4, 8))
        host = torch.arange(4)
        host.tolist()  # host: free
        top = logits.softmax(-1).topk(2, dim=-1).indices  # computed from a device tensor: device
        top.tolist()  # 1
        top.cpu().tolist()  # 1 (the copy), then a host tensor
        int(top[0, 0])  # 1
        host[:2] = top[:2, 0]  # 1: a host tensor assigned from a device one
        torch.tensor([1, 2], device=torch.device("cpu"))  # 1: a pageable host-to-device copy
        torch.zeros(3, device=torch.device("cpu")).add_(1)  # a device allocation: free
        host.to(torch.device("cpu"), non_blocking=True)  # pinned on a GPU: free
        host.to(torch.device("cpu"))  # 1: blocking
        torch.tensor([1, 2], device="cpu")  # "cpu": the host

    reads = _counted(step)
    assert (reads.num_reads, reads.num_h2d, reads.total) == (4, 2, 6), (reads.reads, reads.h2d)
    assert all("test_host_read_counter.py" in site for site in [*reads.reads, *reads.h2d])


def test_counter_copy_to_host_leaves_the_source_a_device_tensor():
    """On the CPU `.cpu()` returns the tensor itself: the counter must not unmark the source."""
    def step(counter):
        hidden = counter.mark(torch.randn(2))
        hidden.cpu()
        hidden.tolist()
        assert counter.is_device(hidden)

    assert _counted(step).num_reads == 2


def test_counter_counts_synchronize_as_a_stall():
    from vllm_gsd.engine import cost_calibration

    counter = HostReadCounter()
    counter.step = StepReads()
    cost_calibration.STALL_HOOKS.append(lambda: counter.count("stalls"))
    try:
        cost_calibration.synchronize("cpu")
    finally:
        cost_calibration.STALL_HOOKS.pop()
    assert counter.step.num_stalls == 1
