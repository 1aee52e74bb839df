"""Import Triton if it is there, so the plain-torch references (the CPU implementation used
inside vLLM's CPU backend) keep working on a machine without Triton.

Kernel modules write ``from ._triton_compat import triton, tl, jit, HAS_TRITON`` and decorate
kernels with ``@jit``. Without Triton, ``jit`` returns the function untouched and ``tl`` is a
stub whose attributes exist (so ``x: tl.constexpr`` annotations still evaluate); calling a
Triton launcher then raises a clear error via ``require_triton``.
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


def jit(fn):
    """``triton.jit`` when Triton is importable, else the identity."""
    return triton.jit(fn) if HAS_TRITON else fn


def require_triton(what: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"{what} needs Triton; use the *_ref torch function instead")


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
