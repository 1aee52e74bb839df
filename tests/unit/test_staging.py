"""HostStaging (engine/staging.py): host arrays reach the device in one non-blocking copy (on
the CPU: one concatenation), with their values, ints as int64 and floats as float64, and staged
tensors outlive the reuse of the host buffers they came through."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_gsd.engine import staging as staging_module
from vllm_gsd.engine.staging import NUM_SLOTS, HostStaging
from vllm_gsd.testing.host_reads import HostReadCounter, StepReads


def _arrays(rng: np.random.Generator, count: int) -> list[np.ndarray]:
    """Arrays of odd sizes (empty included) and the dtypes a forward's inputs have."""
    dtypes = [np.int32, np.int64, np.int64, np.int32]
    return [rng.integers(-2**31, 2**31, int(rng.integers(0, 9000)), dtype=dtypes[i % 4]) for i in range(count)]


@pytest.mark.parametrize("copy", [False, True], ids=["host", "device_path"])
def test_staged_arrays_keep_their_values_through_every_slot_and_growth(copy):
    rng = np.random.default_rng(0)
    staging = HostStaging("cpu", pin_memory=False, copy=copy)
    kept = []
    for _ in range(3 * NUM_SLOTS):  # every slot reused, buffers grown past their first size
        arrays = _arrays(rng, int(rng.integers(1, 6))) + [np.zeros(0, np.int64), np.arange(7).reshape(7, 1)]
        staged = staging.stage(arrays)
        assert [t.dtype for t in staged] == [torch.int64] * len(arrays)
        kept.append((arrays, staged))
    for arrays, staged in kept:  # earlier results are not overwritten by later stages
        for array, tensor in zip(arrays, staged):
            assert tensor.tolist() == array.reshape(-1).tolist()
    source = np.arange(5)
    (tensor,) = staging.stage([source])
    source[0] = 99  # a stage is a copy of the caller's array, on either path
    assert tensor.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("copy", [False, True], ids=["host", "device_path"])
def test_float_arrays_arrive_as_float64_with_their_exact_values(copy):
    staging = HostStaging("cpu", pin_memory=False, copy=copy)
    temperature = np.asarray([0.7, 1e-30, 2.5], dtype=np.float32)
    top_p = [0.9, 1.0, float("inf")]
    rows, temperatures, top_ps = staging.stage([np.arange(4), temperature, np.asarray(top_p)])
    assert rows.dtype == torch.int64 and rows.tolist() == [0, 1, 2, 3]
    assert temperatures.dtype == top_ps.dtype == torch.float64
    assert temperatures.tolist() == temperature.astype(np.float64).tolist()
    assert top_ps.tolist() == top_p


@pytest.mark.parametrize("copy", [False, True], ids=["host", "device_path"])
def test_a_stage_is_counted_as_device_tensors_made_without_waiting(monkeypatch, copy):
    """Under the host-read counter (with its hook, as the worker installs it) the staged tensors
    are device tensors, made without a pageable copy or a read: on a GPU one non-blocking copy
    from pinned memory."""
    staging = HostStaging(torch.device("cpu"), pin_memory=True, copy=copy)  # pinned only on CUDA
    counter = HostReadCounter()
    counter.step = StepReads()
    monkeypatch.setattr(staging_module, "STAGED_HOOKS", [counter.mark])
    with counter:
        staged = staging.stage([np.arange(5), np.arange(3, dtype=np.int32), np.ones(2)])
        assert all(counter.is_device(t) for t in staged)
    assert counter.step.total == 0, (counter.step.reads, counter.step.h2d)
    assert not staging.pin_memory
