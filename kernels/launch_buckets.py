"""Which launch buckets of the Triton kernels ran, and whether during warm-up or while serving.

A *launch bucket* is what makes Triton compile a new binary for a kernel here (see
_triton_compat.py, "Bounded compilation"): the values of its ``tl.constexpr`` parameters and
launch options (the dict the launcher's pure ``_launch_constants`` returns) plus the dtype of its
main tensor. Runtime arguments never add one (tests/kernels/test_kernel_specializations.py checks
that against Triton's own binder), so a bucket seen for the first time is a compile on CUDA.

Every launcher calls ``note(kernel, constants, dtype)`` right before its launch: one set insert
(the constants' values as a tuple, the dtype, the phase). The phase is "serving" unless a
``warming_up()`` block is open (vllm_v0_32/kernel_warmup.py opens one inside vLLM's warm-up), so
``new_while_serving()`` lists the buckets that would have compiled while serving.

Per process (each worker records its own launches); tests read it through the worker probe
``gsd_test_kernel_buckets`` (vllm_gsd/testing/worker_probes.py). No vLLM, no Triton needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["WARMUP", "SERVING", "note", "warming_up", "buckets", "new_while_serving", "report", "reset"]

WARMUP, SERVING = "warmup", "serving"

_phase = [SERVING]
_runs: set[tuple] = set()  # (kernel, bucket values, phase)
_fields: dict[str, tuple[str, ...]] = {}  # kernel -> names of its bucket values


def note(kernel: str, constants: dict, dtype) -> None:
    """Record one launch of ``kernel`` with these launch constants (``_launch_constants``'s dict:
    constexprs, num_warps, num_stages) on tensors of ``dtype``. Cheap: a tuple and a set insert."""
    _runs.add((kernel, (*constants.values(), dtype), _phase[0]))
    if kernel not in _fields:
        _fields[kernel] = (*constants, "dtype")


@contextmanager
def warming_up() -> Iterator[None]:
    """Launches inside this block are recorded as warm-up launches."""
    previous, _phase[0] = _phase[0], WARMUP
    try:
        yield
    finally:
        _phase[0] = previous


def as_dict(kernel: str, values: tuple) -> dict:
    """A bucket's values by name (dtype as a string)."""
    return {name: (str(v).replace("torch.", "") if name == "dtype" else v)
            for name, v in zip(_fields.get(kernel, ()), values)}


def buckets(phase: str | None = None) -> dict[str, set[tuple]]:
    """kernel -> the buckets launched (in ``phase``, or in any)."""
    out: dict[str, set[tuple]] = {}
    for kernel, values, ran_in in _runs:
        if phase is None or ran_in == phase:
            out.setdefault(kernel, set()).add(values)
    return out


def new_while_serving() -> dict[str, set[tuple]]:
    """kernel -> the buckets launched while serving that no warm-up launch had: on CUDA, binaries
    compiled while serving (empty when the warm-up covered serving)."""
    warm = buckets(WARMUP)
    return {kernel: new for kernel, seen in buckets(SERVING).items()
            if (new := seen - warm.get(kernel, set()))}


def report() -> dict:
    """JSON-friendly summary: per kernel, the warm-up and serving bucket counts and the buckets
    new while serving (by name)."""
    warm, serving, new = buckets(WARMUP), buckets(SERVING), new_while_serving()
    return {kernel: {"warmup": len(warm.get(kernel, ())), "serving": len(serving.get(kernel, ())),
                     "new_while_serving": [as_dict(kernel, v) for v in sorted(new.get(kernel, ()), key=str)]}
            for kernel in sorted(set(warm) | set(serving))}


def reset() -> None:
    """Forget every recorded launch (tests)."""
    _runs.clear()
