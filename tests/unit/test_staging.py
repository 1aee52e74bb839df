"""HostStaging (engine/staging.py): a draft forward's host arrays reach the device in one
non-blocking copy, with their values, as int64, and staged tensors outlive the reuse of the host
buffers they came through."""

from __future__ import annotations

import numpy as np
import torch

from vllm_gsd.engine.staging import NUM_SLOTS, HostStaging
from vllm_gsd.testing.host_reads import HostReadCounter, StepReads


def _arrays(rng: np.random.Generator, count: int) -> list[np.ndarray]:
    """Arrays of odd sizes (empty included) and the dtypes a forward's inputs have."""
    dtypes = [np.int32, np.int64, np.int64, np.int32]
    return [rng.integers(-2**31, 2**31, int(rng.integers(0, 9000)), dtype=dtypes[i % 4]) for i in range(count)]


def test_staged_arrays_keep_their_values_through_every_slot_and_growth():
    rng = np.random.default_rng(0)
    staging = HostStaging("cpu", pin_memory=False)
    kept = []
    for _ in range(3 * NUM_SLOTS):  # every slot reused, buffers grown past their first size
        arrays = _arrays(rng, int(rng.integers(1, 6))) + [np.zeros(0, np.int64), np.arange(7).reshape(7, 1)]
        staged = staging.stage(arrays)
        assert [t.dtype for t in staged] == [torch.int64] * len(arrays)
        kept.append((arrays, staged))
    for arrays, staged in kept:  # earlier results are not overwritten by later stages
        for array, tensor in zip(arrays, staged):
            assert tensor.tolist() == array.reshape(-1).tolist()


def test_float_arrays_arrive_as_float64_with_their_exact_values():
    staging = HostStaging("cpu", pin_memory=False)
    temperature = np.asarray([0.7, 1e-30, 2.5], dtype=np.float32)
    top_p = [0.9, 1.0, float("inf")]
    rows, temperatures, top_ps = staging.stage([np.arange(4), temperature, np.asarray(top_p)])
    assert rows.dtype == torch.int64 and rows.tolist() == [0, 1, 2, 3]
    assert temperatures.dtype == top_ps.dtype == torch.float64
    assert temperatures.tolist() == temperature.astype(np.float64).tolist()
    assert top_ps.tolist() == top_p


def test_a_stage_is_one_copy_that_does_not_wait():
    """Under the host-read counter the staged tensors are device tensors made by one
    non-blocking copy (pinned on a GPU): no pageable copy, no read."""
    staging = HostStaging(torch.device("cpu"), pin_memory=True)  # pinned only on CUDA
    counter = HostReadCounter()
    counter.step = StepReads()
    with counter:
        staged = staging.stage([np.arange(5), np.arange(3, dtype=np.int32)])
        assert all(counter.is_device(t) for t in staged)
    assert counter.step.total == 0, (counter.step.reads, counter.step.h2d)
    assert not staging.pin_memory
