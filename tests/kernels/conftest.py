"""Kernel tests run Triton in interpreter mode on CPU: the variable must be set before Triton
is imported anywhere, hence at conftest import (a CUDA machine can export TRITON_INTERPRET=0)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import triton  # noqa: E402,F401  (the test extra installs it; a missing Triton must fail)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # Two CPU cores: keep torch from oversubscribing them while the interpreter runs numpy.
    prev = torch.get_num_threads()
    torch.set_num_threads(min(prev, 2))
    yield
    torch.set_num_threads(prev)


@pytest.fixture
def poison_empty(monkeypatch):
    """Make torch.empty return sentinel-filled memory (NaN / -77) so kernel outputs that a
    launcher allocates itself cannot pass by inheriting a previous run's correct values."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(-77)
        return t

    monkeypatch.setattr(torch, "empty", empty)
    return empty
