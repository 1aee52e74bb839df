"""KV compaction after tree acceptance: pull the accepted path's KV down to contiguous slots.

For request ``b`` the verified tree row ``r`` was written at KV position ``tree_base[b] + r``.
After acceptance the path is ``accepted_rows[b, 0..a]`` (``accepted_rows[b, 0] = 0``, the root,
which is already in place; ``a = num_accepted[b]``). For ``k = 1..a`` the KV of row
``accepted_rows[b, k]`` moves to position ``tree_base[b] + k``, in every layer, keys and values.

Overlap safety: along a path rows strictly increase and ``accepted_rows[b, k] >= k``. A copy
walking ``k`` ascending therefore never reads a position it has already overwritten (it writes
``tree_base + j`` for ``j < k`` and reads ``tree_base + accepted_rows[b, k] >= tree_base + k``).
The Triton kernel (``compact_kv``, the GPU engine's) gives each (request, slice of heads*dims,
layer) to one program that walks ``k`` ascending; programs touch disjoint elements, so there is
no race. All layers go in one launch: the kernel reads each layer's keys and values at an int64
element offset (a small device table, built once per set of cache addresses) from the first
layer's keys, so every layer must share one view shape, strides and dtype, as vLLM's caches do
(vLLM 0.32 views all layers from one backing allocation, utils.allocate_kv_cache); layers that
do not get one launch per kind. Offsets may be negative or cross allocations (plain 64-bit
address arithmetic on CUDA).
The torch versions gather every source first and then scatter: ``compact_kv_cpu``, the CPU
engine's, through the packing vLLM's CPU attention picked, and ``compact_kv_ref``, the Triton
kernel's reference in tests, through the canonical views of any layout.

``kv_caches``: one tensor per layer, in a layout of paged_layout.py (``"gpu"``
``[2, nb, bs, Hkv, D]``, ``"gpu_bhnc"`` or ``"cpu"`` ``[nb, Hkv, bs, 2*D]``). Positions must
be below ``block_table.shape[1] * block_size``; rows of requests with ``num_accepted = 0`` are
left alone.

Compile-time parameters (bounded compilation while serving; see _triton_compat.py): all four
constexprs, ``NUM_KV_HEADS``, ``HEAD_DIM``, ``PAGE`` and ``BLOCK_HD`` (the (head, dim) plane
rounded up to a power of two, at most 1024), come from the model and cache config
(``_launch_constants``, pure), so one binary per (model, layout) serves every batch. What varies
with the batch (number of requests = grid, accepted lengths = loaded, ``accepted_rows`` width
``N + 1`` = stride ``stride_ar``, the block table's width) is a runtime value; those strides
carry no ==1 / %16 specialization.
"""

from __future__ import annotations

import torch

from . import launch_buckets
from ._triton_compat import jit, next_pow2, require_triton, tl
from .paged_layout import CpuPacking, cpu_token_views, split_kv_cache

__all__ = ["compact_kv", "compact_kv_cpu", "compact_kv_ref"]


def _moves(block_table, block_size, tree_base, accepted_rows, num_accepted):
    """(src_block, src_off, dst_block, dst_off) int64 index vectors of every move."""
    n1 = accepted_rows.shape[1]
    dev = accepted_rows.device
    k = torch.arange(1, n1, device=dev)
    valid = k[None, :] <= num_accepted.to(dev).long()[:, None]  # [B, N]
    base = tree_base.to(dev).long()[:, None]
    src = (base + accepted_rows[:, 1:].long().clamp(min=0))[valid]
    dst = (base + k[None, :]).expand_as(valid)[valid]
    req = torch.arange(accepted_rows.shape[0], device=dev)[:, None].expand_as(valid)[valid]
    bt = block_table.long()
    return bt[req, src // block_size], src % block_size, bt[req, dst // block_size], dst % block_size


def compact_kv_cpu(
    kv_caches: list[torch.Tensor],  # vLLM's CPU caches, [nb, Hkv, bs, 2 * D] each
    block_table: torch.Tensor,  # int32 [B, max_blocks]
    block_size: int,
    tree_base: torch.Tensor,  # int32 [B]
    accepted_rows: torch.Tensor,  # int64 [B, N + 1], -1 padded
    num_accepted: torch.Tensor,  # int [B]
    packing: CpuPacking | None,
) -> None:
    """The CPU engine's compaction, in place: gather all sources, then scatter (overlap-safe).

    ``packing``: how the ISA packs a block (paged_layout.cpu_packing; None: the canonical
    ``"cpu"`` layout)."""
    sb, so, db, do = _moves(block_table, block_size, tree_base, accepted_rows, num_accepted)
    if sb.numel() == 0:
        return
    if packing is None:
        _move_canonical(kv_caches, "cpu", block_size, sb, so, db, do)
        return
    # Every layer moves the same tokens: their digits, once.
    sources = {kind: (sb, *packing.token_digits(kind, so)) for kind in ("key", "value")}
    targets = {kind: (db, *packing.token_digits(kind, do)) for kind in ("key", "value")}
    for kv_cache in kv_caches:
        assert kv_cache.shape[2] == block_size, f"cache block size {kv_cache.shape[2]} != {block_size}"
        for kind, view in zip(("key", "value"), cpu_token_views(kv_cache, packing)):
            view[targets[kind]] = view[sources[kind]]


def compact_kv_ref(kv_caches: list[torch.Tensor], block_table: torch.Tensor, block_size: int, tree_base: torch.Tensor,
                   accepted_rows: torch.Tensor, num_accepted: torch.Tensor, layout: str = "gpu") -> None:
    """The Triton kernel's torch reference (tests), in place, with compact_kv's arguments: gather
    all sources, then scatter."""
    sb, so, db, do = _moves(block_table, block_size, tree_base, accepted_rows, num_accepted)
    if sb.numel():
        _move_canonical(kv_caches, layout, block_size, sb, so, db, do)


def _move_canonical(kv_caches, layout, block_size, sb, so, db, do) -> None:
    """Every layer's moves (the index vectors of `_moves`) through its canonical [nb, bs, Hkv, D] views."""
    for kv_cache in kv_caches:
        for cache in split_kv_cache(kv_cache, layout):
            assert cache.shape[1] == block_size, f"cache block size {cache.shape[1]} != {block_size}"
            cache[db, do] = cache[sb, so]  # RHS is a gathered copy


def _launch_constants(num_kv_heads: int, head_dim: int, page: int) -> dict:
    """Constexprs (and ``num_warps``) of the kernel for one cache, without launching."""
    return dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE=page,
                BLOCK_HD=min(1024, next_pow2(num_kv_heads * head_dim)), num_warps=4)


@jit(do_not_specialize=("stride_bt", "stride_ar"),
     do_not_specialize_on_alignment=("LAYER_OFF", "BLOCK_TABLE", "TREE_BASE", "ACC_ROWS", "NUM_ACC"))
def _compact_kv_kernel(
    BASE, LAYER_OFF, BLOCK_TABLE, TREE_BASE, ACC_ROWS, NUM_ACC,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt, stride_ar,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    layer = tl.program_id(2)
    # The layer's keys and values: element offsets (int64) from BASE, the first layer's keys.
    K = BASE + tl.load(LAYER_OFF + 2 * layer)
    V = BASE + tl.load(LAYER_OFF + 2 * layer + 1)
    # This program owns a fixed slice of the (head, dim) plane of one layer for every position
    # it touches.
    idx = chunk * BLOCK_HD + tl.arange(0, BLOCK_HD)
    ok = idx < NUM_KV_HEADS * HEAD_DIM
    h = idx // HEAD_DIM
    d = idx % HEAD_DIM
    k_inner = h * stride_kh + d * stride_kd
    v_inner = h * stride_vh + d * stride_vd
    n_acc = tl.load(NUM_ACC + b).to(tl.int32)
    base = tl.load(TREE_BASE + b)
    # Ascending k: each source row >= k was not yet overwritten (see module docstring).
    for k in range(1, n_acc + 1):
        row = tl.load(ACC_ROWS + b * stride_ar + k).to(tl.int32)
        if row != k:
            src = base + row
            dst = base + k
            src_blk = tl.load(BLOCK_TABLE + b * stride_bt + src // PAGE).to(tl.int64)
            dst_blk = tl.load(BLOCK_TABLE + b * stride_bt + dst // PAGE).to(tl.int64)
            src_off = src % PAGE
            dst_off = dst % PAGE
            kx = tl.load(K + src_blk * stride_kb + src_off * stride_ks + k_inner, mask=ok)
            vx = tl.load(V + src_blk * stride_vb + src_off * stride_vs + v_inner, mask=ok)
            tl.store(K + dst_blk * stride_kb + dst_off * stride_ks + k_inner, kx, mask=ok)
            tl.store(V + dst_blk * stride_vb + dst_off * stride_vs + v_inner, vx, mask=ok)


_PLANS: dict = {}  # (layout, every layer's address, shape and strides) -> _plan_layers(); a few entries
_MAX_PLANS = 8


def _plan_layers(kv_caches: list[torch.Tensor], layout: str) -> list[tuple[int, tuple, torch.Tensor]]:
    """The layers as launches: [(index of the group's first layer, (k strides, v strides, k
    shape), int64 device table [L, 2])].

    Layers whose key/value views share shape, strides and dtype, and whose addresses are whole
    elements apart (always so in vLLM: every layer is a view of one backing allocation), form one
    group: one launch, its table holding each layer's key and value offsets in elements from the
    group's first layer's keys. Planned once per set of caches (vLLM's do not move between
    steps; a rebuilt set has new addresses or shapes, hence a new plan), holding no cache tensor."""
    groups: dict = {}
    for index, kv_cache in enumerate(kv_caches):
        k, v = split_kv_cache(kv_cache, layout)
        item = k.element_size()
        kind = (k.shape, k.stride(), v.stride(), k.dtype, k.device)
        group = groups.get(kind)
        if group is not None and (k.data_ptr() - group["origin"]) % item == 0 \
                and (v.data_ptr() - group["origin"]) % item == 0:
            group["pointers"] += (k.data_ptr(), v.data_ptr())
        else:
            groups[kind if group is None else (*kind, index)] = dict(
                first=index, origin=k.data_ptr(), item=item, pointers=[k.data_ptr(), v.data_ptr()],
                strides=(k.stride(), v.stride(), k.shape), device=k.device)
    return [(g["first"], g["strides"],
             torch.tensor([(p - g["origin"]) // g["item"] for p in g["pointers"]], dtype=torch.int64)
             .view(-1, 2).to(g["device"])) for g in groups.values()]


def _layer_launches(kv_caches: list[torch.Tensor], layout: str) -> list[tuple[int, tuple, torch.Tensor]]:
    """_plan_layers, cached by the caches' addresses, shapes and strides (cheap attribute reads)."""
    key = (layout, tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in kv_caches))
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)))
        plan = _PLANS[key] = _plan_layers(kv_caches, layout)
    return plan


def compact_kv(
    kv_caches: list[torch.Tensor],
    block_table: torch.Tensor,  # int32 [B, max_blocks]
    block_size: int,
    tree_base: torch.Tensor,  # int32 [B]
    accepted_rows: torch.Tensor,  # int64 [B, N + 1], -1 padded
    num_accepted: torch.Tensor,  # int [B]
    layout: str = "gpu",
) -> None:
    """Triton compaction, in place: one launch for all layers (keys and values together), grid
    (request, slice of the (head, dim) plane, layer); layers of different shapes or strides
    (not vLLM's case) get a launch per kind (``_plan_layers``)."""
    require_triton("compact_kv")
    num_reqs = accepted_rows.shape[0]
    if num_reqs == 0 or accepted_rows.shape[1] <= 1 or not kv_caches:
        return
    accepted_rows = accepted_rows.contiguous()
    block_table = block_table.contiguous()
    tree_base = tree_base.contiguous()
    num_accepted = num_accepted.contiguous()
    for first, (k_strides, v_strides, shape), table in _layer_launches(kv_caches, layout):
        k = split_kv_cache(kv_caches[first], layout)[0]  # the group's base: its first layer's keys
        _, page, num_kv_heads, head_dim = shape
        assert page == block_size, f"cache block size {page} != block_size {block_size}"
        lc = _launch_constants(num_kv_heads, head_dim, page)
        grid = (num_reqs, -(-(num_kv_heads * head_dim) // lc["BLOCK_HD"]), table.shape[0])
        launch_buckets.note("compact_kv", lc, k.dtype)
        _compact_kv_kernel[grid](
            k, table, block_table, tree_base, accepted_rows, num_accepted,
            *k_strides, *v_strides, block_table.stride(0), accepted_rows.stride(0), **lc,
        )
