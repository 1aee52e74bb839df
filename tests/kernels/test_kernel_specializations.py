"""Bounded compilation: the set of binaries each Triton kernel is compiled into while serving.

Triton compiles once per distinct key = constexpr values + launch options + the type and
specialization of every other argument (an int equal to 1 becomes a constant, ints divisible by
16 and 16-byte-aligned pointers get divisibility hints). A serving engine sees a new batch shape
every step, so the keys must not follow the batch. Three kinds of tests:

* enumeration (no launch): each launcher's pure ``_launch_constants`` over a few hundred random
  batch shapes (batch 1..256, tree nodes 1..128, contexts 1..32k, prefill chunks) stays within a
  bound computed from its buckets;
* full keys: the real launchers run against a recorder that binds the arguments exactly as
  Triton's JIT does (``create_function_from_signature``) without running the kernel; batch
  sizes, widths and metadata offsets vary, and the runtime arguments must add no variant on
  top of the constexpr tuple;
* correctness on the bucket edges (interpreter, odd sizes) against the torch references: a split
  count rounded up by the reduce, splits with no work, a clamped split count, ancestor words
  padded / strided / not a power of two, query blocks rounded up or capped, padded row tiles.
"""

from __future__ import annotations

import importlib
import math
import random

import pytest
import torch

from scripts.tools.kernel_testutils import (
    ancestor_words_loop, gen, make_attn_batch, make_paged_kv, pad_trees, randint, random_parents,
)
from vllm_gsd.graph import ancestor_words_from_parents as ancestor_words_torch
from vllm_gsd.graph.acceptance import walk_tree as walk_tree_torch
from vllm_gsd.kernels import (
    compact_kv, compact_kv_ref, graph_attention, graph_attention_ref, triton_ancestor_words_from_parents,
    triton_walk_tree,
)

GA = importlib.import_module("vllm_gsd.kernels.graph_attention")
AM = importlib.import_module("vllm_gsd.kernels.ancestor_masks")
TA = importlib.import_module("vllm_gsd.kernels.tree_acceptance")
KC = importlib.import_module("vllm_gsd.kernels.kv_compaction")

NUM_SHAPES = 300


def _log2(x: int) -> int:
    assert x > 0 and x & (x - 1) == 0, x
    return x.bit_length() - 1


def _key(d: dict) -> tuple:
    return tuple(sorted(d.items()))


# ----------------------------------------------------------------------------- random shapes


def _random_attention_shape(rng: random.Random) -> dict:
    """One step of a serving batch: verification trees, decode rows, prefill chunks."""
    b = rng.choice([1, 2, 3, rng.randint(1, 16), rng.randint(1, 64), rng.randint(1, 256), 256])
    mode = rng.choice(["trees", "trees", "mixed", "decode", "prefill"])
    budget = rng.randint(1, 128)  # tree nodes of the step
    q_lens, seq_lens = [], []
    for _ in range(b):
        kind = mode if mode != "mixed" else rng.choice(["trees", "decode", "prefill"])
        if kind == "trees":
            q = rng.randint(1, budget) + 1  # root + nodes
        elif kind == "decode":
            q = 1
        else:
            q = rng.choice([rng.randint(1, 64), rng.randint(1, 2048), 2048])
        ctx = rng.choice([rng.randint(1, 32768), rng.randint(1, 512), 32768, 1])
        q_lens.append(q)
        seq_lens.append(ctx + q)
    return dict(num_reqs=b, num_tokens=sum(q_lens) + rng.choice([0, 0, rng.randint(1, 16)]),
                max_query_len=max(q_lens), max_seq_len=max(seq_lens))


# (num_heads, num_kv_heads, head_size, block_size, dtype): common models plus odd groups/dims.
MODELS = [
    (32, 8, 128, 16, torch.bfloat16),   # Llama-3-8B
    (28, 4, 128, 16, torch.bfloat16),   # Qwen2-7B: group 7 -> GROUP_PAD 8
    (14, 2, 64, 16, torch.float16),     # Qwen2-0.5B
    (32, 32, 128, 32, torch.float16),   # MHA
    (16, 8, 256, 16, torch.bfloat16),   # head dim 256: smaller query tiles
    (12, 4, 80, 16, torch.float32),     # head dim 80 -> 128, group 3 -> 4
    (5, 1, 96, 128, torch.float32),     # group 5 -> 8
]
DEVICES = [(132, False), (108, False), (4, True)]  # (SMs, interpreter): H100/H200, A100, CPU


def _attention_bounds(num_heads, num_kv_heads, head_size):
    """(forward, reduce) binary counts the buckets allow for one model."""
    group_pad = GA.next_pow2(num_heads // num_kv_heads)
    lo, hi = GA._block_q_bounds(group_pad, max(16, GA.next_pow2(head_size)))
    block_q_values = _log2(hi) - _log2(lo) + 1
    fwd = 2 * block_q_values  # x SPLIT_K in {False, True}
    reduce = _log2(GA.MAX_SPLITS)  # SPLITS_PAD in {2, 4, ..., MAX_SPLITS}
    return fwd, reduce


def test_attention_bound_is_a_few_binaries():
    for hq, hkv, d, _, _ in MODELS:
        fwd, red = _attention_bounds(hq, hkv, d)
        assert fwd <= 8 and red <= 6, (hq, hkv, d, fwd, red)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: f"hq{m[0]}-hkv{m[1]}-d{m[2]}-bs{m[3]}-{m[4]}".replace("torch.", ""))
def test_attention_constexprs_bounded_over_random_batches(model):
    hq, hkv, d, bs, dtype = model
    fwd_bound, reduce_bound = _attention_bounds(hq, hkv, d)
    group_pad = GA.next_pow2(hq // hkv)
    lo, hi = GA._block_q_bounds(group_pad, max(16, GA.next_pow2(d)))
    rng = random.Random(hq * 1000 + d)
    per_batch = {"BLOCK_Q", "BLOCK_M", "SPLIT_K", "num_warps"}
    for num_sms, interpret in DEVICES:
        fwd_keys, reduce_keys, fixed = set(), set(), set()
        for _ in range(NUM_SHAPES):
            shape = _random_attention_shape(rng)
            lc = GA._launch_constants(num_heads=hq, num_kv_heads=hkv, head_size=d, page=bs,
                                      dtype=dtype, num_sms=num_sms, interpret=interpret, **shape)
            fwd, red, splits = lc["fwd"], lc["reduce"], lc["num_splits"]
            assert 1 <= splits <= GA.MAX_SPLITS
            assert fwd["SPLIT_K"] == (splits > 1) and (red is None) == (splits == 1)
            assert lo <= fwd["BLOCK_Q"] <= hi and _log2(fwd["BLOCK_Q"]) >= 0
            assert fwd["BLOCK_M"] == fwd["BLOCK_Q"] * group_pad and fwd["BLOCK_M"] >= 16
            assert lc["num_tiles"] >= -(-shape["num_tokens"] // fwd["BLOCK_Q"])
            fwd_keys.add(_key(fwd))
            fixed.add(_key({k: v for k, v in fwd.items() if k not in per_batch}))
            if red is not None:
                assert red["SPLITS_PAD"] >= splits > red["SPLITS_PAD"] // 2
                reduce_keys.add(_key(red))
        assert len(fixed) == 1, "a model-derived constexpr followed the batch"
        assert len(fwd_keys) <= fwd_bound, (num_sms, sorted(fwd_keys))
        assert len(reduce_keys) <= reduce_bound, (num_sms, sorted(reduce_keys))


def test_attention_split_heuristic_picks_many_counts_compiled_few_ways():
    """The heuristic's split counts are runtime values: many of them, a handful of binaries."""
    rng = random.Random(1)
    counts, pads = set(), set()
    for hq, hkv, d, bs, dtype in MODELS:
        for _ in range(NUM_SHAPES):
            lc = GA._launch_constants(num_heads=hq, num_kv_heads=hkv, head_size=d, page=bs, dtype=dtype,
                                      num_sms=132, **_random_attention_shape(rng))
            counts.add(lc["num_splits"])
            if lc["reduce"] is not None:
                pads.add(lc["reduce"]["SPLITS_PAD"])
    assert len(counts) >= 15, sorted(counts)
    assert pads <= {2, 4, 8, 16, 32, 64}


def test_attention_given_split_counts_are_clamped_and_bucketed():
    pads = set()
    for s in [1, 2, 3, 5, 7, 8, 9, 31, 33, 63, 64, 65, 100, 10**6]:
        lc = GA._launch_constants(num_heads=8, num_kv_heads=2, head_size=64, page=16,
                                  dtype=torch.bfloat16, num_tokens=40, num_reqs=3, max_query_len=17,
                                  max_seq_len=5000, num_splits=s, num_sms=132)
        assert lc["num_splits"] == min(s, GA.MAX_SPLITS)
        if lc["reduce"] is not None:
            pads.add(lc["reduce"]["SPLITS_PAD"])
    assert pads == {2, 4, 8, 16, 32, 64}


def _ancestor_bound(max_n: int) -> int:
    """(WORDS_PAD, BLOCK_R): BLOCK_R in {16, 32} while WORDS_PAD = 1 (N + 1 <= 32), then one
    BLOCK_R per WORDS_PAD (2, 4, ...)."""
    return 2 + _log2(GA.next_pow2((max_n + 1 + 31) // 32))


@pytest.mark.parametrize("max_n,bound", [(128, 5), (4096, None)])
def test_ancestor_constexprs_bounded(max_n, bound):
    bound = bound or _ancestor_bound(max_n)
    assert _ancestor_bound(max_n) == bound
    rng = random.Random(max_n)
    ns = list(range(0, min(max_n, 300) + 1)) + [rng.randint(0, max_n) for _ in range(NUM_SHAPES)]
    keys = set()
    for n in ns:
        lc = AM._launch_constants(n)
        w = (n + 1 + 31) // 32
        assert lc["WORDS_PAD"] >= w and _log2(lc["WORDS_PAD"]) >= 0 and _log2(lc["BLOCK_R"]) >= 0
        assert lc["BLOCK_R"] * lc["WORDS_PAD"] <= 2048 or lc["BLOCK_R"] == 1
        keys.add(_key(lc))
    assert len(keys) <= bound, sorted(keys)


@pytest.mark.parametrize("max_n,bound", [(128, 5), (1024, 8)])
def test_walk_tree_constexprs_bounded(max_n, bound):
    assert bound == _log2(max(16, GA.next_pow2(max_n + 1))) - _log2(16) + 1
    keys = set()
    for n in range(0, max_n + 1):
        lc = TA._launch_constants(n)
        assert lc["BLOCK_N"] >= n + 1 and _log2(lc["BLOCK_N"]) >= 4
        keys.add(_key(lc))
    assert len(keys) <= bound, sorted(keys)


def test_compact_kv_constexprs_do_not_see_the_batch():
    """Only model / cache quantities reach the kernel's constexprs: one binary per model."""
    import inspect

    assert list(inspect.signature(KC._launch_constants).parameters) == ["num_kv_heads", "head_dim", "page"]
    for hkv, d, page in [(8, 128, 16), (3, 24, 16), (1, 80, 128), (16, 128, 32)]:
        lc = KC._launch_constants(hkv, d, page)
        assert lc["BLOCK_HD"] >= min(1024, hkv * d) and _log2(lc["BLOCK_HD"]) >= 0


# --------------------------------------------------------------------------------- full keys


class _KeyRecorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kw)`` binds the arguments as
    Triton's JIT does (same binder, generic backend) and records the compile key, without
    running anything."""

    def __init__(self, kernel):
        jit_mod = pytest.importorskip("triton.runtime.jit")
        backend = pytest.importorskip("triton.backends.compiler").BaseBackend
        jf = kernel if isinstance(kernel, jit_mod.JITFunction) else jit_mod.JITFunction(kernel.fn, **kernel.kwargs)
        self.binder = jit_mod.create_function_from_signature(jf.signature, jf.params, backend)
        self.is_constexpr = [p.is_constexpr for p in jf.params]
        self.keys: set = set()  # full key: every argument's specialization + options
        self.constexpr_keys: set = set()  # constexprs + options only
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _, spec, options = self.binder(*args, **kwargs)
            opts = tuple(sorted(options.items()))
            self.keys.add((tuple(spec), opts))
            self.constexpr_keys.add((tuple(s for s, c in zip(spec, self.is_constexpr) if c), opts))
            self.launches += 1
        return launch

    def check(self, bound):
        assert self.launches > 0
        assert len(self.keys) == len(self.constexpr_keys), (
            "a runtime argument (count, stride, pointer offset) added a specialization:\n"
            + "\n".join(map(str, sorted(self.keys, key=str))))
        assert len(self.constexpr_keys) <= bound, sorted(self.constexpr_keys, key=str)


def _int32_slice(values, rng):
    """``values`` as an int32 tensor at a random offset inside a bigger buffer."""
    off = rng.randint(0, 5)
    buf = torch.zeros(len(values) + off + 3, dtype=torch.int32)
    buf[off: off + len(values)] = torch.tensor(values, dtype=torch.int32)
    return buf[off: off + len(values)]


def test_attention_full_keys_bounded(monkeypatch):
    hq, hkv, d, bs, dtype = 4, 2, 32, 16, torch.bfloat16
    fwd = _KeyRecorder(GA._graph_attn_fwd_kernel)
    red = _KeyRecorder(GA._graph_attn_reduce_kernel)
    monkeypatch.setattr(GA, "_graph_attn_fwd_kernel", fwd)
    monkeypatch.setattr(GA, "_graph_attn_reduce_kernel", red)
    rng = random.Random(5)
    cache = torch.zeros((2, 4, bs, hkv, d), dtype=dtype)  # never read: nothing runs
    for i in range(150):
        b = rng.choice([1, 2, 16, 17, rng.randint(1, 40)])
        budget = rng.choice([0, 1, 15, 31, 32, rng.randint(0, 80)])
        q_lens = [rng.choice([1, budget + 1, rng.randint(1, 40)]) for _ in range(b)]
        ctx = [rng.randint(0, 4000) for _ in range(b)]
        qsl = [0]
        for q in q_lens:
            qsl.append(qsl[-1] + q)
        t = qsl[-1] + rng.choice([0, 1, 15])
        rows, words = budget + 1, (budget + 1 + 31) // 32
        anc = torch.zeros((b, rows + rng.choice([0, 3]), words + rng.choice([0, 0, 2])), dtype=torch.int32)
        if rng.random() < 0.3:
            anc = anc[:, :, : max(1, anc.shape[-1] - 1)]  # strided: stride(1) != shape[-1]
        bt_width = rng.choice([256, 257, 512])
        block_table = torch.zeros((b + rng.randint(0, 2), bt_width), dtype=torch.int32)[:b]
        query = torch.zeros((t, hq, d), dtype=dtype)
        graph_attention(
            query, cache[0], cache[1], block_table, _int32_slice(qsl, rng),
            _int32_slice([c + q for c, q in zip(ctx, q_lens)], rng), _int32_slice(ctx, rng),
            _int32_slice([-1] * t, rng), anc, 0.1, out=torch.zeros_like(query),
            num_splits=rng.choice([None, 1, 2, 3, rng.randint(1, 64)]),
            max_seq_len=max(c + q for c, q in zip(ctx, q_lens)), max_query_len=max(q_lens),
        )
    fwd_bound, reduce_bound = _attention_bounds(hq, hkv, d)
    fwd.check(fwd_bound)
    red.check(reduce_bound)


def test_ancestor_and_walk_full_keys_bounded(monkeypatch):
    anc = _KeyRecorder(AM._ancestor_words_kernel)
    walk = _KeyRecorder(TA._walk_tree_kernel)
    monkeypatch.setattr(AM, "_ancestor_words_kernel", anc)
    monkeypatch.setattr(TA, "_walk_tree_kernel", walk)
    rng = random.Random(6)
    for _ in range(200):
        b, n = rng.choice([1, 16, rng.randint(1, 256)]), rng.choice([1, 15, 16, 31, rng.randint(1, 128)])
        off = rng.randint(0, 3)
        parent_row = torch.zeros((b + off, n), dtype=torch.int64)[off:]
        num_nodes = torch.zeros(b + off, dtype=torch.int64)[off:]
        triton_ancestor_words_from_parents(parent_row, num_nodes)
        target = torch.zeros((b + off, n + 1), dtype=torch.int64)[off:]
        triton_walk_tree(parent_row, parent_row, num_nodes, target)
    anc.check(_ancestor_bound(128))
    walk.check(5)


@pytest.mark.parametrize("layout", ["gpu", "cpu", "gpu_bhnc"])
def test_compact_kv_full_keys_one_per_layout(monkeypatch, layout):
    rec = _KeyRecorder(KC._compact_kv_kernel)
    monkeypatch.setattr(KC, "_compact_kv_kernel", rec)
    rng = random.Random(7)
    hkv, d, bs = 2, 64, 16
    if layout == "gpu":
        kv = torch.zeros((2, 6, bs, hkv, d), dtype=torch.bfloat16)
    else:
        kv = torch.zeros((6, hkv, bs, 2 * d), dtype=torch.bfloat16)
    for _ in range(100):
        b, n = rng.choice([1, 16, rng.randint(1, 256)]), rng.choice([1, 15, rng.randint(1, 128)])
        off = rng.randint(0, 3)
        rows = torch.zeros((b + off, n + 1), dtype=torch.int64)[off:]
        compact_kv([kv, kv], torch.zeros((b, rng.choice([100, 128])), dtype=torch.int32), bs,
                   torch.zeros(b + off, dtype=torch.int32)[off:], rows, torch.zeros(b, dtype=torch.int64),
                   layout=layout)
    rec.check(1)


# ------------------------------------------------------------------- correctness on the edges


TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2)}


def _check_attention(batch, dtype, **kw):
    poison = torch.full_like(batch.query, float("nan"))
    ref = graph_attention_ref(*batch.args(), out=poison.clone())
    out = graph_attention(*batch.args(), out=poison.clone(), **kw)
    t = int(batch.query_start_loc[-1])
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out[:t].float(), ref[:t].float(), atol=atol, rtol=rtol)
    assert torch.isnan(out[t:]).all(), "padding tokens past the last request must stay untouched"
    return out


def _odd_requests(g, bs):
    return [
        {"kind": "tree", "ctx": 3 * bs + 5, "parents": random_parents(11, g)},
        {"kind": "causal", "ctx": 5, "q": 3},  # 8 keys: most splits have no work
        {"kind": "tree", "ctx": 0, "parents": []},  # a lone root, no context
        {"kind": "frontier", "ctx": 2 * bs - 1, "parents": random_parents(9, g, "chain"), "rows": [4, 7, 9]},
        {"kind": "causal", "ctx": 70, "q": 1},
    ]


@pytest.mark.parametrize("splits", [3, 5, 9, 17])
def test_split_count_rounded_up_and_empty_splits(splits):
    """SPLITS_PAD > num_splits (masked reduce lanes) and splits past a request's last KV tile."""
    g = gen(300 + splits)
    hq, hkv, d, bs, dtype = 6, 2, 48, 16, torch.float32  # GROUP 3 -> 4, D 48 -> 64
    batch = make_attn_batch(_odd_requests(g, bs), hq, hkv, d, bs, dtype, "gpu", g, pad_tokens=3)
    lc = GA._launch_constants(num_heads=hq, num_kv_heads=hkv, head_size=d, page=bs, dtype=dtype,
                              num_tokens=batch.query.shape[0], num_reqs=5, max_query_len=12,
                              max_seq_len=int(batch.seq_lens.max()), num_splits=splits, interpret=True)
    assert lc["reduce"]["SPLITS_PAD"] > splits  # the edge is really exercised
    kv_tiles = -(-int(batch.seq_lens.min()) // lc["fwd"]["BLOCK_N"])
    assert kv_tiles < splits  # and some split of some request has no KV tile at all
    _check_attention(batch, dtype, num_splits=splits)


def test_split_count_above_the_cap_is_clamped():
    g = gen(310)
    bs = 16
    reqs = [{"kind": "tree", "ctx": 41 * 32 + 3, "parents": random_parents(6, g)},  # 42 KV tiles
            {"kind": "causal", "ctx": 2, "q": 1}]
    batch = make_attn_batch(reqs, 3, 1, 16, bs, torch.float32, "gpu", g, pad_tokens=1)
    out = _check_attention(batch, torch.float32, num_splits=100)
    torch.testing.assert_close(
        out, graph_attention(*batch.args(), out=torch.full_like(batch.query, float("nan")), num_splits=GA.MAX_SPLITS),
        atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("extra_words,strided", [(0, False), (1, False), (2, True), (5, True)])
def test_ancestor_words_padded_or_strided(extra_words, strided):
    """num_words is a runtime int: a word axis wider than the tree (garbage in the padding words,
    never read: those positions are past seq_len), not a power of two, or a strided view."""
    g = gen(320 + extra_words)
    bs, dtype = 16, torch.bfloat16
    reqs = [
        {"kind": "tree", "ctx": 17, "parents": random_parents(70, g)},  # 71 rows: 3 words
        {"kind": "tree", "ctx": 32, "parents": random_parents(31, g, "chain")},  # 32 rows: 1 word
        {"kind": "tree", "ctx": 5, "parents": random_parents(32, g)},  # 33 rows: 2 words
        {"kind": "causal", "ctx": 9, "q": 4},
    ]
    batch = make_attn_batch(reqs, 4, 2, 32, bs, dtype, "gpu", g, pad_tokens=2)
    b, r, w = batch.ancestor_words.shape
    assert w == 3
    wide = torch.randint(-2**31, 2**31 - 1, (b, r + 2, w + extra_words + (2 if strided else 0)),
                         generator=g, dtype=torch.int64).to(torch.int32)
    wide[:, :r, :w] = batch.ancestor_words
    batch.ancestor_words = wide[:, :, : w + extra_words] if strided else wide
    assert batch.ancestor_words.stride(-1) == 1
    _check_attention(batch, dtype, num_splits=2)


@pytest.mark.parametrize("longest,hint,block_q", [(129, None, 128), (16, 16, 16), (17, 17, 32), (9, 200, 128)])
def test_query_block_edges(longest, hint, block_q):
    """BLOCK_Q capped (129 tokens -> 128: two tiles for that request), exactly a bucket (16),
    rounded up (17 -> 32), and a host hint above the real maximum (spare tiles)."""
    g = gen(330 + longest)
    hq = hkv = 3  # GROUP 1: BLOCK_Q in 16..128
    reqs = [{"kind": "causal", "ctx": 7, "q": longest},
            {"kind": "tree", "ctx": 21, "parents": random_parents(min(15, longest - 1), g)},
            {"kind": "causal", "ctx": 3, "q": 1}]
    batch = make_attn_batch(reqs, hq, hkv, 16, 16, torch.float32, "gpu", g, pad_tokens=1)
    lc = GA._launch_constants(num_heads=hq, num_kv_heads=hkv, head_size=16, page=16, dtype=torch.float32,
                              num_tokens=batch.query.shape[0], num_reqs=3, max_query_len=hint or longest,
                              max_seq_len=int(batch.seq_lens.max()), interpret=True)
    assert lc["fwd"]["BLOCK_Q"] == block_q
    _check_attention(batch, torch.float32, max_query_len=hint, num_splits=2 if longest < 100 else 1)


@pytest.mark.parametrize("n", [0, 16, 95, 159])
def test_ancestor_kernel_on_padded_tiles(n, poison_empty):
    """BLOCK_R above N + 1 (1 row -> 16, 17 -> 32) and WORDS_PAD above W (3 -> 4, 5 -> 8)."""
    lc = AM._launch_constants(n)
    assert lc["BLOCK_R"] > n + 1 or lc["WORDS_PAD"] > (n + 32) // 32
    g = gen(340 + n)
    trees = [random_parents(k, g, kind) for k, kind in ((n, "random"), (n, "chain"), (n // 2, "star"), (0, "random"))]
    parent_row, num_nodes = pad_trees(trees, n)
    out = triton_ancestor_words_from_parents(parent_row, num_nodes)
    torch.testing.assert_close(out, ancestor_words_loop(parent_row, num_nodes), atol=0, rtol=0)
    torch.testing.assert_close(out, ancestor_words_torch(parent_row, num_nodes), atol=0, rtol=0)


@pytest.mark.parametrize("n", [15, 17, 100])
def test_walk_tree_on_padded_blocks(n, poison_empty):
    """BLOCK_N exactly N + 1 (16), rounded up (18 -> 32, 101 -> 128)."""
    g = gen(350 + n)
    trees = [random_parents(k, g, kind) for k, kind in ((n, "random"), (n, "chain"), (randint(g, 1, n), "star"))]
    parent_row, num_nodes = pad_trees(trees, n)
    draft = torch.randint(0, 3, (3, n), generator=g)
    target = torch.randint(0, 3, (3, n + 1), generator=g)
    rows, toks, acc = triton_walk_tree(draft, parent_row, num_nodes, target)
    ref = walk_tree_torch(draft, parent_row, num_nodes, target)
    torch.testing.assert_close(rows, ref.accepted_rows, atol=0, rtol=0)
    torch.testing.assert_close(toks, ref.output_token_ids, atol=0, rtol=0)
    torch.testing.assert_close(acc, ref.num_accepted.to(torch.int64), atol=0, rtol=0)


def test_compact_kv_odd_plane_and_wide_rows():
    """Odd (head, dim) plane (3 x 24 = 72 -> BLOCK_HD 128), accepted_rows wider than N + 1 needs
    and sliced at an offset: the kernel reads only ``num_accepted`` entries per row."""
    g = gen(360)
    hkv, d, bs, n = 3, 24, 16, 37
    trees = [random_parents(n, g, "chain"), random_parents(n, g), random_parents(5, g, "star")]
    ctxs = [bs - 1, 3, 2 * bs]
    paged = make_paged_kv([c + n + 1 for c in ctxs], hkv, d, bs, torch.float32, "gpu", g)
    layer = torch.randn(paged.kv_cache.shape, generator=g)
    wide = torch.full((4, n + 9), -1, dtype=torch.int64)
    acc = torch.tensor([n, 4, 1])
    wide[1:, : n + 1] = torch.arange(n + 1)
    wide[2, 1:5] = torch.tensor([2, 5, 9, 30])  # a path of increasing rows >= k
    wide[3, 1] = 4
    rows = wide[1:]
    tree_base = torch.tensor(ctxs, dtype=torch.int32)
    via_ref, via_triton = layer.clone(), layer.clone()
    compact_kv_ref([via_ref], paged.block_table, bs, tree_base, rows, acc)
    compact_kv([via_triton], paged.block_table, bs, tree_base, rows, acc)
    assert not torch.equal(via_ref, layer)
    assert torch.equal(via_triton, via_ref)
    assert math.isfinite(float(via_triton.sum()))
