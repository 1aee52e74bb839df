"""Import Triton if it is there, so the plain-torch references (the CPU implementation used
inside vLLM's CPU backend) keep working on a machine without Triton.

Kernel modules write ``from ._triton_compat import triton, tl, jit, HAS_TRITON`` and decorate
kernels with ``@jit`` or ``@jit(do_not_specialize=..., do_not_specialize_on_alignment=...)``.
Without Triton, ``jit`` returns the function untouched and ``tl`` is a stub whose attributes
exist (so ``x: tl.constexpr`` annotations still evaluate); calling a Triton launcher then
raises a clear error via ``require_triton``.

Bounded compilation. Triton compiles one binary per distinct *key*: the values of the
``tl.constexpr`` parameters, the launch options (``num_warps``, ``num_stages``) and, for every
other argument, its type plus a specialization (an int equal to 1 becomes a constant, an int
divisible by 16 and a 16-byte-aligned pointer get a divisibility hint). While serving, every
batch has a different number of requests, tokens, tree nodes and context lengths, so the
kernels here follow three rules (each kernel module lists its parameters):

* a ``tl.constexpr`` is either fixed by the model / cache config (head size, head counts,
  cache block size, dtype) or bucketed by the launcher's pure ``_launch_constants`` function
  into a small fixed set (powers of two between fixed limits);
* a per-batch size that the code does not need at compile time (a count, a tensor width, a
  stride of a per-batch metadata tensor) is a runtime argument listed in ``do_not_specialize``
  (no ==1 / %16 variants);
* per-batch integer metadata pointers (block tables, query_start_loc, ...) are listed in
  ``do_not_specialize_on_alignment``: they may be slices at any offset, and their loads are
  scalar or gathers that gain nothing from a divisibility hint. Q / K / V / output pointers keep
  it (fresh or offset-0 views in practice, and their row loads do vectorize).

tests/kernels/test_kernel_specializations.py enumerates the keys over random batch shapes.
"""

try:  # pragma: no cover - exercised by the environment, not by tests
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    HAS_TRITON = False

    class _Stub:
        def __getattr__(self, name):
            return self

        def __call__(self, *args, **kwargs):
            return self

    tl = _Stub()


def jit(fn=None, **options):
    """``triton.jit`` when Triton is importable, else the identity. ``@jit`` or
    ``@jit(do_not_specialize=(...), do_not_specialize_on_alignment=(...))``."""
    if fn is None:
        return lambda f: jit(f, **options)
    return triton.jit(fn, **options) if HAS_TRITON else fn


def require_triton(what: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"{what} needs Triton; use the *_ref torch function instead")


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def pow2_bucket(x: int, lo: int, hi: int) -> int:
    """``x`` rounded up to a power of two, then clamped to ``[lo, hi]`` (``lo``, ``hi`` powers
    of two): at most ``log2(hi / lo) + 1`` distinct results whatever ``x`` is."""
    return max(lo, min(hi, next_pow2(x)))


def interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
