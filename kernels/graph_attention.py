"""Graph-masked paged attention: tree rows see the context plus their ancestors.

Contract (docs/contracts.md, "Graph-masked attention"). For request ``b`` the query tokens are
``query_start_loc[b] .. query_start_loc[b+1]`` (``q_len_b`` of them) and ``seq_lens[b]`` KV
positions are read (context + the query's own keys, already written to the cache). A query
token ``t`` sees key position ``p`` iff

* ``query_tree_row[t] < 0`` (causal):   ``p <= seq_lens[b] - q_len_b + (t - query_start_loc[b])``
* ``query_tree_row[t] = r >= 0`` (tree): ``p < tree_base[b]``, or ``tree_base[b] <= p <
  seq_lens[b]`` and bit ``p - tree_base[b]`` of ``ancestor_words[b, r]`` is set.

A query row that sees no key at all (only possible with malformed metadata) outputs zeros.

Two implementations with one signature:

* ``graph_attention_ref``: plain torch, one SDPA call per request with an explicit boolean
  mask. This is the CPU implementation used by the engine's CPU backend and the reference the
  Triton kernel is tested against (it is itself tested against a brute-force dense version).
* ``graph_attention``: Triton, flash-decoding style. Program ``(tile, kv_head, split)`` takes
  ``BLOCK_Q`` consecutive query tokens of one request times the ``GROUP = Hq / Hkv`` query heads
  sharing ``kv_head`` (``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows), so each K/V tile is read once
  for the whole GQA group and all tree rows of the request. The request's KV range is cut into
  ``num_splits`` contiguous chunks handled by different programs (parallelism for small
  batches with long contexts); each writes a partial (max, sum, acc) and a second kernel
  merges them. With ``num_splits == 1`` the first kernel writes the output directly.

Both take ``layout="gpu"`` (``key_cache``/``value_cache`` ``[num_blocks, block_size, Hkv, D]``,
any strides) or ``layout="cpu"`` (vLLM CPU_ATTN's chunk views; see paged_layout.py).

Compile-time parameters (bounded compilation while serving; see _triton_compat.py). Every
distinct constexpr tuple is a separate Triton compile, and a serving engine sees a new batch
shape every step, so nothing that varies with the batch may reach a constexpr unbucketed.
``_launch_constants`` (pure, no launch) picks them:

* fixed by the model / cache: ``NUM_HQ``, ``GROUP``, ``GROUP_PAD``, ``HEAD_DIM``,
  ``HEAD_DIM_PAD``, ``PAGE`` (cache block size), ``BLOCK_N`` (from the head size),
  ``INPUT_PRECISION`` and ``DOT_FP32`` (from the dtype);
* bucketed: ``BLOCK_Q`` (and ``BLOCK_M = BLOCK_Q * GROUP_PAD``, ``num_warps``) is the max query
  length rounded up to a power of two, clamped to ``[cdiv(16, GROUP_PAD), target_m / GROUP_PAD]``
  (<= 4 values); ``SPLIT_K`` is only ``num_splits > 1`` (2 values); the reduce kernel's
  ``SPLITS_PAD`` is ``num_splits`` rounded up to a power of two in ``2..MAX_SPLITS`` (6 values).
  So per (head size, head counts, block size, dtype) at most 8 forward and 6 reduce binaries;
* runtime ints, not specialized: ``num_reqs``, ``num_tokens``, ``num_words`` (ancestor words per
  row: only bounds the tree window, the word loads are gathers), ``num_splits`` (the forward
  kernel only divides the KV tile range by it; a split whose range is empty stores m = -inf,
  l = 0, acc = 0, which the reduce weights by 0) and the strides of the per-batch
  ``block_table`` / ``ancestor_words`` tensors.

``num_splits`` (given or from the heuristic) is clamped to ``1..MAX_SPLITS``.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from . import launch_buckets
from ._triton_compat import interpreting, jit, next_pow2, pow2_bucket, require_triton, tl
from .paged_layout import canonical_kv

__all__ = ["GraphAttentionLaunch", "graph_attention", "graph_attention_ref", "prepare_graph_attention",
           "visibility_mask"]

_LOG2E = 1.4426950408889634
MAX_SPLITS = 64  # KV splits per request; the reduce kernel pads the split axis to a power of two


# ----------------------------------------------------------------------------------------------
# Reference (torch)
# ----------------------------------------------------------------------------------------------


def visibility_mask(
    q_tree_row: torch.Tensor,  # [q_len] int, -1 = causal
    seq_len: int,
    tree_base: int,
    ancestor_words_b: torch.Tensor,  # [R, W] int32 of this request
) -> torch.Tensor:
    """Boolean ``[q_len, seq_len]`` mask of one request (True = visible), vectorized.

    Bits are only decoded for the tree window ``[tree_base, min(seq_len, tree_base + 32 W))``;
    everything before it is plain context (visible to tree rows), everything after is not."""
    q_len = q_tree_row.shape[0]
    dev = q_tree_row.device
    pos = torch.arange(seq_len, device=dev)
    causal_last = seq_len - q_len + torch.arange(q_len, device=dev)  # [q_len]
    mask = pos[None, :] <= causal_last[:, None]
    is_tree = q_tree_row >= 0
    if bool(is_tree.any()):
        num_words = ancestor_words_b.shape[-1]
        lo = min(max(tree_base, 0), seq_len)
        hi = min(seq_len, max(tree_base + 32 * num_words, lo))
        rel = torch.arange(lo - tree_base, hi - tree_base, device=dev)  # window, relative to base
        words = ancestor_words_b[q_tree_row.clamp(min=0).long()]  # [q_len, W] int32
        # int32 arithmetic shift then & 1: the sign bit (row 31 of a word) decodes correctly.
        bits = ((words[:, rel // 32] >> (rel % 32).to(words.dtype)) & 1).bool()
        tree_mask = torch.zeros((q_len, seq_len), dtype=torch.bool, device=dev)
        tree_mask[:, :lo] = True
        tree_mask[:, lo:hi] = bits
        mask = torch.where(is_tree[:, None], tree_mask, mask)
    return mask


def graph_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # int32 [B, max_blocks]
    query_start_loc: torch.Tensor,  # int32 [B + 1]
    seq_lens: torch.Tensor,  # int32 [B]
    tree_base: torch.Tensor,  # int32 [B]
    query_tree_row: torch.Tensor,  # int32 [T]
    ancestor_words: torch.Tensor,  # int32 [B, R, W]
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    layout: str = "gpu",
    *,
    num_splits: int | None = None,  # accepted for signature parity; unused
    max_seq_len: int | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Torch graph-masked paged attention (see module docstring). Computes in fp32, writes
    ``out`` (allocated like ``query`` if None) for every token of every request and returns it.
    Tokens past ``query_start_loc[B]`` are left untouched."""
    k_all, v_all = canonical_kv(key_cache, value_cache, layout)
    _, block_size, num_kv_heads, _ = k_all.shape
    num_tokens, num_heads, head_size = query.shape
    if out is None:
        out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    sl = seq_lens.tolist()
    tb = tree_base.tolist()
    for b in range(len(sl)):
        q0, q1, s = qsl[b], qsl[b + 1], sl[b]
        if q1 <= q0:
            continue
        # Whole-block gather (one strided copy per block, not per token), then trim to S.
        num_blk = -(-s // block_size)
        blocks = block_table[b, :num_blk].long()
        k = k_all.index_select(0, blocks).permute(2, 0, 1, 3).reshape(num_kv_heads, -1, head_size)
        v = v_all.index_select(0, blocks).permute(2, 0, 1, 3).reshape(num_kv_heads, -1, head_size)
        k = k[:, :s].float()  # [Hkv, S, D]
        v = v[:, :s].float()
        q = query[q0:q1].float().transpose(0, 1)  # [Hq, q_len, D]
        mask = visibility_mask(query_tree_row[q0:q1].long(), s, tb[b], ancestor_words[b])
        empty = ~mask.any(dim=1)
        if bool(empty.any()):
            mask = mask | empty[:, None]  # keep SDPA finite; zeroed below
        o = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask[None, None], scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )[0].transpose(0, 1)  # [q_len, Hq, D]
        if bool(empty.any()):
            o = o.masked_fill(empty[:, None, None], 0.0)
        out[q0:q1] = o.to(out.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


@jit
def _find_request(query_start_loc_ptr, tile_id, num_reqs, BLOCK_Q: tl.constexpr):
    """Largest b with ``query_start_loc[b] // BLOCK_Q + b <= tile_id`` (binary search).

    Request b owns tiles ``[qsl[b] // BLOCK_Q + b, qsl[b+1] // BLOCK_Q + b + 1)``, a superset
    of the ``cdiv(q_len_b, BLOCK_Q)`` tiles it needs, so the grid size ``T // BLOCK_Q + B``
    is known without reading query lengths on the host."""
    lo: tl.int32 = 0  # annotated: loop-carried values need one type
    hi: tl.int32 = num_reqs
    while lo < hi - 1:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= tile_id:
            lo = mid
        else:
            hi = mid
    return lo


# Per-batch metadata: no ==1 / %16 / alignment variants (see the module docstring).
_FWD_BATCH_INTS = ("num_reqs", "num_tokens", "num_words", "num_splits", "stride_bt", "stride_ab",
                   "stride_ar")
_FWD_METADATA_PTRS = ("BLOCK_TABLE", "QSL", "SEQ_LENS", "TREE_BASE", "QROW", "ANC")


@jit(do_not_specialize=_FWD_BATCH_INTS, do_not_specialize_on_alignment=_FWD_METADATA_PTRS)
def _graph_attn_fwd_kernel(
    Q, K, V, BLOCK_TABLE, QSL, SEQ_LENS, TREE_BASE, QROW, ANC,
    OUT, PART_M, PART_L, PART_ACC,
    scale_log2,  # softmax scale * log2(e): scores live in the exp2 domain
    num_reqs, num_tokens,
    num_words,  # ancestor words per tree row (ancestor_words.shape[-1])
    num_splits,  # KV splits (grid axis 2); 1 iff not SPLIT_K
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    stride_ab, stride_ar,
    stride_ot, stride_oh, stride_od,
    NUM_HQ: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr,  # KV cache block size
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,  # num_splits > 1: write partials for the reduce kernel
    INPUT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter only: its tl.dot mis-handles 16-bit floats
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    b = _find_request(QSL, tile_id, num_reqs, BLOCK_Q)
    q_begin = tl.load(QSL + b)
    q_len = tl.load(QSL + b + 1) - q_begin
    q_start_local = (tile_id - (q_begin // BLOCK_Q + b)) * BLOCK_Q
    if q_start_local >= q_len:
        return  # spare tile of the grid's upper bound
    seq_len = tl.load(SEQ_LENS + b)
    ctx_len = seq_len - q_len
    base = tl.load(TREE_BASE + b)

    # Row m of the tile = (query token m // GROUP_PAD, query head kv_head*GROUP + m % GROUP_PAD).
    offs_m = tl.arange(0, BLOCK_M)
    q_local = q_start_local + offs_m // GROUP_PAD
    g = offs_m % GROUP_PAD
    row_ok = (q_local < q_len) & (g < GROUP)
    tok = q_begin + q_local
    head = kv_head * GROUP + g
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM

    q = tl.load(
        Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    tree_row = tl.load(QROW + tok, mask=row_ok, other=-1)
    is_tree = tree_row >= 0
    causal_last = ctx_len + q_local  # last key a causal row may see
    anc_row = ANC + b * stride_ab + tl.maximum(tree_row, 0) * stride_ar

    # KV extent of this tile: a tree row may see up to seq_len; causal rows stop at their own
    # position, so a prefill tile does not scan keys no row of it can see.
    has_tree = tl.max(is_tree.to(tl.int32), axis=0) > 0
    last_q = tl.minimum(q_start_local + BLOCK_Q, q_len)
    kv_len = tl.where(has_tree, seq_len, tl.minimum(seq_len, ctx_len + last_q))
    num_kv_tiles = tl.cdiv(kv_len, BLOCK_N)
    # A split past the last tile gets an empty range and stores m = -inf, l = 0, acc = 0.
    tiles_per_split = tl.cdiv(num_kv_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_kv_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for kv_tile in range(tile_lo, tile_hi):
        pos = kv_tile * BLOCK_N + offs_n
        pos_ok = pos < kv_len
        # Per-key page lookup: BLOCK_N is independent of the cache block size.
        blk = tl.load(BLOCK_TABLE + b * stride_bt + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
        slot_in_blk = pos % PAGE
        kv_ok = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(
            K + blk[:, None] * stride_kb + slot_in_blk[:, None] * stride_ks
            + kv_head * stride_kh + offs_d[None, :] * stride_kd,
            mask=kv_ok, other=0.0,
        )
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)

        # Visibility. Causal rows: by position. Tree rows: context before tree_base, then the
        # row's ancestor bits for keys in [tree_base, seq_len); the word load only happens
        # for (tree row, tree key) pairs, so pure-context tiles touch no mask memory.
        rel = pos - base
        rel_c = tl.maximum(rel, 0)
        in_tree = (rel >= 0) & (pos < seq_len) & (rel_c < 32 * num_words)
        need_bits = is_tree[:, None] & in_tree[None, :] & row_ok[:, None]
        words = tl.load(anc_row[:, None] + (rel_c // 32)[None, :], mask=need_bits, other=0)
        bit = (words >> (rel_c % 32)[None, :]) & 1  # arithmetic shift is fine: we keep bit 0
        tree_vis = (pos < base)[None, :] | (bit != 0)
        causal_vis = pos[None, :] <= causal_last[:, None]
        vis = tl.where(is_tree[:, None], tree_vis, causal_vis) & pos_ok[None, :] & row_ok[:, None]
        s = tl.where(vis, s * scale_log2, float("-inf"))

        # Online softmax; m_safe keeps fully-masked rows at 0 instead of NaN (-inf - -inf).
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            V + blk[:, None] * stride_vb + slot_in_blk[:, None] * stride_vs
            + kv_head * stride_vh + offs_d[None, :] * stride_vd,
            mask=kv_ok, other=0.0,
        )
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    if not SPLIT_K:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            OUT + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
            o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        # Partials are contiguous [num_splits, num_tokens, NUM_HQ(, HEAD_DIM_PAD)] fp32.
        ml_off = (split * num_tokens + tok).to(tl.int64) * NUM_HQ + head  # int64: S*T*Hq*D can pass 2^31
        tl.store(PART_M + ml_off, m_i, mask=row_ok)
        tl.store(PART_L + ml_off, l_i, mask=row_ok)
        tl.store(PART_ACC + ml_off[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_ok[:, None])


@jit(do_not_specialize=("num_reqs", "num_tokens", "num_splits"), do_not_specialize_on_alignment=("QSL",))
def _graph_attn_reduce_kernel(
    OUT, PART_M, PART_L, PART_ACC, QSL,
    num_reqs, num_tokens, num_splits,
    stride_ot, stride_oh, stride_od,
    NUM_HQ: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # num_splits rounded up to a power of two
):
    """Merge split partials of one (token, head): out = sum_s w_s acc_s / sum_s w_s l_s with
    w_s = 2^(m_s - max m). Splits that saw no visible key (an empty tile range, or only masked
    keys) carry m = -inf, l = 0, acc = 0, and so do the padding lanes ``s >= num_splits``: their
    weight is 2^-inf = 0. If every split is empty, max m = -inf is replaced by 0 (no NaN) and
    the row outputs zeros."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    if tok >= tl.load(QSL + num_reqs):
        return  # padding token past the last request: the forward kernel did not write it
    offs_s = tl.arange(0, SPLITS_PAD)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    ml_off = (offs_s * num_tokens + tok).to(tl.int64) * NUM_HQ + head
    m = tl.load(PART_M + ml_off, mask=s_ok, other=float("-inf"))
    l = tl.load(PART_L + ml_off, mask=s_ok, other=0.0)
    acc = tl.load(PART_ACC + ml_off[:, None] * HEAD_DIM_PAD + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    denom = tl.sum(w * l, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(OUT + tok * stride_ot + head * stride_oh + offs_d * stride_od,
             o.to(OUT.dtype.element_ty), mask=offs_d < HEAD_DIM)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few splits are enough to exercise the reduce path


def _block_q_bounds(group_pad: int, head_dim_pad: int) -> tuple[int, int]:
    """``BLOCK_Q``'s range: ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows must be >= 16 (tl.dot), and
    one tile per request is preferred (each tile re-reads the request's KV) up to 128 rows (64
    for big head dims)."""
    target_m = 128 if head_dim_pad <= 128 else 64
    lo = max(1, -(-16 // group_pad))
    return lo, max(lo, target_m // group_pad)


def _launch_constants(
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    page: int,
    dtype: torch.dtype,
    num_tokens: int,
    num_reqs: int,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int | None = None,
    num_sms: int = 4,
    interpret: bool = False,
) -> dict:
    """Launch constants of one ``graph_attention`` call, without launching (pure).

    Returns ``{"fwd": {...}, "reduce": {...} or None, "num_splits": int, "num_tiles": int}``:
    ``fwd`` / ``reduce`` hold every ``tl.constexpr`` of the two kernels plus ``num_warps`` /
    ``num_stages`` (so a distinct dict is a distinct compile); ``num_splits`` (clamped to
    ``1..MAX_SPLITS``) and ``num_tiles`` are runtime values (grid axes). Per-batch inputs reach
    the constexprs only through ``BLOCK_Q`` (power-of-two bucket), ``SPLIT_K`` (bool) and
    ``SPLITS_PAD`` (power-of-two bucket)."""
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    head_dim_pad = max(16, next_pow2(head_size))
    bq_lo, bq_hi = _block_q_bounds(group_pad, head_dim_pad)
    block_q = pow2_bucket(max(1, max_query_len), bq_lo, bq_hi)
    block_m = block_q * group_pad
    block_n = 32 if interpret else (64 if head_dim_pad <= 128 else 32)

    num_tiles = num_tokens // block_q + num_reqs
    if num_splits is None:
        progs = (-(-num_tokens // block_q)) * num_kv_heads
        kv_tiles = -(-max(1, max_seq_len) // block_n)
        want = -(-2 * num_sms // max(1, progs))
        num_splits = min(want, kv_tiles // 4 if not interpret else kv_tiles)
    num_splits = int(max(1, min(int(num_splits), MAX_SPLITS)))

    fwd = dict(
        NUM_HQ=num_heads, GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_size, HEAD_DIM_PAD=head_dim_pad, PAGE=page,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=num_splits > 1,
        # fp32 inputs: exact fp32 dots (tf32 would be ~1e-3 off the reference); 16-bit: default.
        INPUT_PRECISION="ieee" if dtype == torch.float32 else None,
        DOT_FP32=bool(interpret and dtype != torch.float32),  # interpreter's 16-bit tl.dot
        num_warps=4 if block_m * head_dim_pad <= 64 * 128 else 8,  # fp32 acc lives in registers
        num_stages=2,
    )
    reduce = None
    if num_splits > 1:
        reduce = dict(NUM_HQ=num_heads, HEAD_DIM=head_size, HEAD_DIM_PAD=head_dim_pad,
                      SPLITS_PAD=next_pow2(num_splits), num_warps=4)
    return {"fwd": fwd, "reduce": reduce, "num_splits": num_splits, "num_tiles": num_tiles}


class GraphAttentionLaunch:
    """One batch's ``graph_attention``, planned once and launched per layer.

    ``prepare_graph_attention`` does every host-side step of a call that depends on the batch
    only (argument checks, contiguity, maxima); ``launch`` launches the kernels (the forward, plus
    the reduce when the KV is split) on one layer's query, caches and output. What depends on the
    layer's shapes (launch constants, grid, split-K partial buffers) is computed at the first
    launch with those shapes and kept: the layers of a model share them, so later layers only
    launch. The partial buffers are reused by every layer: launches on one stream run in order,
    so a layer's reduce has read them before the next layer's forward writes them."""

    def __init__(self, metadata, num_tokens, max_seq_len, max_query_len, num_splits, layout):
        (self.block_table, self.query_start_loc, self.seq_lens, self.tree_base, self.query_tree_row,
         self.ancestor_words) = metadata
        self.num_tokens, self.max_seq_len, self.max_query_len = num_tokens, max_seq_len, max_query_len
        self.num_reqs = self.seq_lens.shape[0]
        self.requested_splits, self.layout = num_splits, layout
        self.metadata_strides = (self.block_table.stride(0), self.ancestor_words.stride(0),
                                 self.ancestor_words.stride(1))
        self._per_shape: dict = {}

    def _for_shape(self, query, k_all):
        """(launch constants, grid, partial buffers) for this layer's shapes, computed once."""
        key = (query.shape[1], k_all.shape[1], k_all.shape[2], k_all.shape[3], query.dtype, query.device)
        found = self._per_shape.get(key)
        if found is not None:
            return found
        num_heads, page, num_kv_heads, head_size = key[:4]
        assert query.shape[2] == head_size and num_heads % num_kv_heads == 0, "bad head shapes"
        assert k_all.dtype == query.dtype, "q/k/v dtypes must match"
        lc = _launch_constants(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, page=page,
            dtype=query.dtype, num_tokens=self.num_tokens, num_reqs=self.num_reqs,
            max_query_len=self.max_query_len, max_seq_len=self.max_seq_len, num_splits=self.requested_splits,
            num_sms=_num_sms(query.device), interpret=interpreting(),
        )
        splits = lc["num_splits"]
        parts = None
        if splits > 1:
            part_m = torch.empty((splits, self.num_tokens, num_heads), dtype=torch.float32, device=query.device)
            parts = (part_m, torch.empty_like(part_m),
                     torch.empty((splits, self.num_tokens, num_heads, lc["fwd"]["HEAD_DIM_PAD"]),
                                 dtype=torch.float32, device=query.device))
        found = self._per_shape[key] = (lc, (lc["num_tiles"], num_kv_heads, splits), parts)
        launch_buckets.note("graph_attention_fwd", lc["fwd"], query.dtype)
        if lc["reduce"] is not None:
            launch_buckets.note("graph_attention_reduce", lc["reduce"], query.dtype)
        return found

    def launch(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               out: torch.Tensor, scale: float) -> torch.Tensor:
        """Attend the planned rows of ``query`` (``[>= T, Hq, D]``; rows past T are not read)
        into ``out`` (``[>= T, Hq, D]``, or ``[>= T, Hq * D]``: heads contiguous)."""
        if self.num_tokens == 0 or self.num_reqs == 0:
            return out
        k_all, v_all = canonical_kv(key_cache, value_cache, self.layout)
        lc, grid, parts = self._for_shape(query, k_all)
        if out.dim() == 2:
            st, sd = out.stride()
            out_strides = (st, sd * query.shape[2], sd)
        else:
            out_strides = out.stride()
        part_m, part_l, part_acc = (out, out, out) if parts is None else parts
        _graph_attn_fwd_kernel[grid](
            query, k_all, v_all, self.block_table, self.query_start_loc, self.seq_lens, self.tree_base,
            self.query_tree_row, self.ancestor_words, out, part_m, part_l, part_acc,
            scale * _LOG2E, self.num_reqs, self.num_tokens, self.ancestor_words.shape[-1], grid[2],
            *query.stride(), *k_all.stride(), *v_all.stride(), *self.metadata_strides, *out_strides,
            **lc["fwd"],
        )
        if parts is not None:
            _graph_attn_reduce_kernel[(self.num_tokens, query.shape[1])](
                out, part_m, part_l, part_acc, self.query_start_loc, self.num_reqs, self.num_tokens,
                grid[2], *out_strides, **lc["reduce"],
            )
        return out


def prepare_graph_attention(
    *,
    num_tokens: int,
    block_table: torch.Tensor,  # int32 [B, max_blocks]
    query_start_loc: torch.Tensor,  # int32 [B + 1]
    seq_lens: torch.Tensor,  # int32 [B]
    tree_base: torch.Tensor,  # int32 [B]
    query_tree_row: torch.Tensor,  # int32 [>= T]
    ancestor_words: torch.Tensor,  # int32 [B, R, W]
    max_seq_len: int,
    max_query_len: int,
    layout: str = "gpu",
    num_splits: int | None = None,
) -> GraphAttentionLaunch:
    """Plan ``graph_attention`` for a batch of ``num_tokens`` query tokens, for any number of
    layers (see GraphAttentionLaunch)."""
    require_triton("graph_attention")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                    ("tree_base", tree_base), ("query_tree_row", query_tree_row),
                    ("ancestor_words", ancestor_words), ("block_table", block_table)):
        assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
    ancestor_words = ancestor_words.contiguous() if ancestor_words.stride(-1) != 1 else ancestor_words
    query_tree_row = query_tree_row.contiguous()
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    metadata = (block_table, query_start_loc, seq_lens, tree_base, query_tree_row, ancestor_words)
    return GraphAttentionLaunch(metadata, num_tokens, max_seq_len, max_query_len, num_splits, layout)


def graph_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # int32 [B, max_blocks]
    query_start_loc: torch.Tensor,  # int32 [B + 1]
    seq_lens: torch.Tensor,  # int32 [B]
    tree_base: torch.Tensor,  # int32 [B]
    query_tree_row: torch.Tensor,  # int32 [T]
    ancestor_words: torch.Tensor,  # int32 [B, R, W]
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    layout: str = "gpu",
    *,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Triton graph-masked paged attention; same contract as ``graph_attention_ref``.

    Keyword-only tuning knobs: ``num_splits`` (KV split count; default from a heuristic),
    ``max_seq_len`` / ``max_query_len`` (host-side maxima as vLLM's metadata has them; when
    omitted they are read from the device tensors, which costs a sync). One call plans and
    launches; a caller attending many layers over one batch plans once with
    ``prepare_graph_attention`` and launches per layer."""
    require_triton("graph_attention")
    k_all, v_all = canonical_kv(key_cache, value_cache, layout)
    _, page, num_kv_heads, head_size = k_all.shape
    num_tokens, num_heads, d_q = query.shape
    assert d_q == head_size and num_heads % num_kv_heads == 0, "bad head shapes"
    assert k_all.dtype == query.dtype and v_all.dtype == query.dtype, "q/k/v dtypes must match"
    if out is None:
        out = torch.empty_like(query)
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    if max_seq_len is None or max_query_len is None:
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        mq, ms = torch.stack([q_lens.max(), seq_lens.max()]).tolist()
        max_query_len = mq if max_query_len is None else max_query_len
        max_seq_len = ms if max_seq_len is None else max_seq_len
    plan = prepare_graph_attention(
        num_tokens=num_tokens, block_table=block_table, query_start_loc=query_start_loc, seq_lens=seq_lens,
        tree_base=tree_base, query_tree_row=query_tree_row, ancestor_words=ancestor_words,
        max_seq_len=max_seq_len, max_query_len=max_query_len, layout="gpu", num_splits=num_splits)
    return plan.launch(query, k_all, v_all, out, scale)
