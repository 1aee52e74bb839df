"""compact_kv (Triton) against compact_kv_ref and a sequential python oracle, over every
layout, and compact_kv_cpu (the CPU engine's) in every CPU packing; several layers, paths
crossing block edges, nothing/everything accepted."""

from __future__ import annotations

import pytest
import torch

from scripts.tools.kernel_testutils import gen, make_paged_kv, randint, random_parents
from vllm_gsd.kernels import compact_kv, compact_kv_cpu, compact_kv_ref, split_kv_cache
from vllm_gsd.kernels.paged_layout import cpu_packing, cpu_token_views


def _random_paths(g, trees, n_budget):
    """A random root-to-node path per tree (children pick), as accepted_rows/num_accepted."""
    b = len(trees)
    rows = torch.full((b, n_budget + 1), -1, dtype=torch.int64)
    acc = torch.zeros(b, dtype=torch.int64)
    for i, ps in enumerate(trees):
        path, r = [0], 0
        while True:
            kids = [c + 1 for c, p in enumerate(ps) if p == r]
            if not kids or randint(g, 0, 5) == 0:
                break
            r = kids[randint(g, 0, len(kids) - 1)]
            path.append(r)
        rows[i, : len(path)] = torch.tensor(path)
        acc[i] = len(path) - 1
    return rows, acc


def _oracle(kv_caches, layout, block_table, block_size, tree_base, rows, acc):
    for kv in kv_caches:
        for cache in split_kv_cache(kv, layout):
            for b in range(rows.shape[0]):
                for k in range(1, int(acc[b]) + 1):  # ascending sequential copy
                    src = int(tree_base[b]) + int(rows[b, k])
                    dst = int(tree_base[b]) + k
                    sb, db = int(block_table[b, src // block_size]), int(block_table[b, dst // block_size])
                    cache[db, dst % block_size] = cache[sb, src % block_size].clone()


@pytest.mark.parametrize("seed,layout,dtype,block_size,hkv,d,n_budget", [
    (1, "gpu", torch.float32, 16, 2, 32, 24),
    (2, "cpu", torch.bfloat16, 32, 3, 16, 40),
    (3, "gpu_bhnc", torch.float16, 16, 1, 80, 12),
    (4, "gpu", torch.bfloat16, 128, 4, 64, 256),
])
def test_triton_and_reference_match_sequential_copy(seed, layout, dtype, block_size, hkv, d, n_budget):
    g = gen(seed)
    kinds = ("chain", "random", "star", "random", "chain")
    trees = [random_parents([n_budget, randint(g, 1, n_budget), 0, n_budget, 3][i], g, kinds[i])
             for i in range(5)]
    ctxs = [block_size - 3, 0, 7, 2 * block_size - 1, block_size]
    seq_lens = [c + len(t) + 1 for c, t in zip(ctxs, trees)]
    rows, acc = _random_paths(g, trees, n_budget)
    rows[0, :] = torch.arange(n_budget + 1)  # chain fully accepted: nothing moves
    acc[0] = n_budget
    # One block table shared by every layer (as in vLLM); each layer's whole cache random,
    # including slots no request owns (they must come out unchanged).
    paged = make_paged_kv(seq_lens, hkv, d, block_size, dtype, layout, g)
    block_table = paged.block_table
    layers = [torch.randn(paged.kv_cache.shape, generator=g).to(dtype) for _ in range(3)]
    tree_base = torch.tensor(ctxs, dtype=torch.int32)

    expect = [kv.clone() for kv in layers]
    _oracle(expect, layout, block_table, block_size, tree_base, rows, acc)
    via_ref = [kv.clone() for kv in layers]
    compact_kv_ref(via_ref, block_table, block_size, tree_base, rows, acc, layout=layout)
    via_triton = [kv.clone() for kv in layers]
    compact_kv(via_triton, block_table, block_size, tree_base, rows, acc, layout=layout)
    for e, r, t in zip(expect, via_ref, via_triton):
        assert torch.equal(r, e), "reference != sequential copy"
        assert torch.equal(t, e), "triton != sequential copy"
    assert any(not torch.equal(e, kv) for e, kv in zip(expect, layers)), "test moved nothing"


def test_nothing_accepted_is_a_no_op():
    g = gen(9)
    p = make_paged_kv([20, 5], 2, 16, 16, torch.float32, "gpu", g, poison=0.0)
    before = p.kv_cache.clone()
    rows = torch.full((2, 9), -1, dtype=torch.int64)
    rows[:, 0] = 0
    compact_kv([p.kv_cache], p.block_table, 16, torch.tensor([3, 1], dtype=torch.int32), rows,
               torch.zeros(2, dtype=torch.int64))
    assert torch.equal(before, p.kv_cache)


@pytest.mark.parametrize("isa,block_size,d", [("vec", 32, 64), ("vec16", 16, 80), ("amx", 32, 64), ("amx", 64, 128)])
def test_cpu_compaction_moves_tokens_in_every_cpu_packing(isa, block_size, d):
    """The CPU engine compacts through the packing vLLM's CPU attention picked: every accepted
    token (all its keys and values, every head) lands where that packing reads it, and nothing
    else changes. Checked on token views (test_kernel_paged_layout checks them against vLLM)."""
    g = gen(11)
    hkv, n_budget = 2, 20
    trees = [random_parents(n, g) for n in (n_budget, 7, n_budget)]
    ctxs = [block_size - 5, 3, 2 * block_size - 2]
    rows, acc = _random_paths(g, trees, n_budget)
    acc[2] = 0  # a tree with nothing accepted: untouched
    paged = make_paged_kv([c + len(t) + 1 for c, t in zip(ctxs, trees)], hkv, d, block_size,
                          torch.bfloat16, "cpu", g)
    layer = torch.randn(paged.kv_cache.shape, generator=g).to(torch.bfloat16)
    packing = cpu_packing(isa, block_size, d)
    tree_base = torch.tensor(ctxs, dtype=torch.int32)
    moved = layer.clone()
    compact_kv_cpu([moved], paged.block_table, block_size, tree_base, rows, acc, packing)

    expect = [view.clone() for view in cpu_token_views(layer, packing)]
    for kind, view in zip(("key", "value"), expect):
        for b in range(len(trees)):
            for k in range(1, int(acc[b]) + 1):  # ascending sequential copy
                src, dst = ctxs[b] + int(rows[b, k]), ctxs[b] + k
                src_at, dst_at = ((paged.block_table[b, p // block_size].long(),
                                   *packing.token_digits(kind, torch.tensor(p % block_size))) for p in (src, dst))
                view[dst_at] = view[src_at].clone()
    for kind, got, want in zip(("key", "value"), cpu_token_views(moved, packing), expect):
        assert torch.equal(got, want), f"{kind}s moved wrongly"
    assert not torch.equal(moved, layer), "test moved nothing"


def _one_allocation_layers(num_layers, num_blocks, block_size, hkv, d, dtype, block_outermost, g):
    """Every layer's [nb, Hkv, bs, 2*D] cache (vLLM's TRITON_ATTN view, layout "gpu_bhnc") as a
    view of one backing buffer, as vLLM 0.32 allocates them (utils.allocate_kv_cache): layer l of
    block b at l * layer_stride + b * block_stride; layer-outermost or block-outermost (the
    other layers' pages between a layer's blocks)."""
    page = hkv * block_size * 2 * d
    buffer = torch.randn(num_layers * num_blocks * page + 7, generator=g).to(dtype)[7:]  # odd offset
    layer_stride, block_stride = (page, num_layers * page) if block_outermost else (num_blocks * page, page)
    inner = (block_size * 2 * d, 2 * d, 1)
    return [buffer.as_strided((num_blocks, hkv, block_size, 2 * d), (block_stride, *inner), l * layer_stride)
            for l in range(num_layers)], buffer


class _LaunchCounter:
    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("seed,num_layers,block_outermost,dtype,block_size,hkv,d", [
    (21, 5, False, torch.bfloat16, 16, 3, 24),  # odd layer count, odd (head, dim) plane
    (22, 3, True, torch.float32, 8, 1, 40),  # block-outermost: layers interleaved by block
    (23, 4, False, torch.float16, 32, 2, 16),
])
def test_one_launch_compacts_every_layer(monkeypatch, seed, num_layers, block_outermost, dtype, block_size, hkv, d):
    """compact_kv over L layers is one launch (grid axis 2 = layer, each layer reached through
    its element offset from the first layer's keys), equal to compact_kv_ref per layer, on
    random caches viewed from one allocation as vLLM's are, listed in reverse address order
    (negative offsets), with random trees and paths crossing block edges."""
    import vllm_gsd.kernels.kv_compaction as KC

    g = gen(seed)
    n_budget = 2 * block_size + 3
    trees = [random_parents(randint(g, 1, n_budget), g) for _ in range(4)] + [random_parents(n_budget, g, "chain")]
    ctxs = [randint(g, 0, 3 * block_size) for _ in trees]
    seq_lens = [c + len(t) + 1 for c, t in zip(ctxs, trees)]
    rows, acc = _random_paths(g, trees, n_budget)
    rows[4, 1:4] = torch.tensor([2, 5, 2 * block_size + 1])  # a path jumping over block edges
    acc[4] = 3
    paged = make_paged_kv(seq_lens, hkv, d, block_size, dtype, "gpu_bhnc", g)
    num_blocks = paged.kv_cache.shape[0]
    layers, buffer = _one_allocation_layers(num_layers, num_blocks, block_size, hkv, d, dtype, block_outermost, g)
    layers = layers[::-1]
    tree_base = torch.tensor(ctxs, dtype=torch.int32)
    before = buffer.clone()
    expect = [kv.clone() for kv in layers]
    compact_kv_ref(expect, paged.block_table, block_size, tree_base, rows, acc, layout="gpu_bhnc")
    counter = _LaunchCounter(KC._compact_kv_kernel)
    monkeypatch.setattr(KC, "_compact_kv_kernel", counter)
    compact_kv(layers, paged.block_table, block_size, tree_base, rows, acc, layout="gpu_bhnc")
    assert len(counter.launches) == 1 and counter.launches[0][2] == num_layers
    for layer, want in zip(layers, expect):
        assert torch.equal(layer, want)
    assert not torch.equal(buffer, before), "test moved nothing"


def test_layers_of_different_kinds_get_a_launch_per_kind(monkeypatch):
    """Separate allocations of one kind share a launch; a layer with other strides gets its own."""
    import vllm_gsd.kernels.kv_compaction as KC

    g = gen(24)
    hkv, d, bs = 2, 16, 16
    trees = [random_parents(9, g), random_parents(20, g)]
    ctxs = [5, bs - 1]
    rows, acc = _random_paths(g, trees, 20)
    paged = make_paged_kv([c + len(t) + 1 for c, t in zip(ctxs, trees)], hkv, d, bs, torch.float32, "gpu", g)
    same = [torch.randn(paged.kv_cache.shape, generator=g) for _ in range(3)]
    wider = torch.randn((*paged.kv_cache.shape[:-1], d + 4), generator=g)[..., :d]  # other strides
    layers = [same[0], wider, same[1], same[2]]
    tree_base = torch.tensor(ctxs, dtype=torch.int32)
    expect = [kv.clone() for kv in layers]
    compact_kv_ref(expect, paged.block_table, bs, tree_base, rows, acc)
    counter = _LaunchCounter(KC._compact_kv_kernel)
    monkeypatch.setattr(KC, "_compact_kv_kernel", counter)
    for _step in range(2):  # the second step reuses the plan of the same caches
        moved = [kv.clone() for kv in layers]
        moved[1] = torch.empty((*paged.kv_cache.shape[:-1], d + 4))[..., :d].copy_(wider)  # strided as wider
        compact_kv(moved, paged.block_table, bs, tree_base, rows, acc)
        for got, want in zip(moved, expect):
            assert torch.equal(got, want)
    assert sorted(grid[2] for grid in counter.launches) == [1, 1, 3, 3]
