"""graph_attention: the torch reference against a brute-force dense oracle, and the Triton
kernel against the reference, on random paged batches (fresh draws per case, seeded)."""

from __future__ import annotations

import pytest
import torch

from scripts.tools.kernel_testutils import attention_bruteforce, gen, make_attn_batch, random_parents
from vllm_gsd.kernels import graph_attention, graph_attention_ref

TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def _mixed_requests(g, block_size, n_max=12):
    """Prefill-like causal request, verification trees (random, chain, empty), a frontier."""
    par = random_parents(n_max, g)
    return [
        {"kind": "causal", "ctx": block_size + 3, "q": 7},
        {"kind": "tree", "ctx": 2 * block_size - 1, "parents": par},
        {"kind": "tree", "ctx": 5, "parents": []},  # empty tree: just the root row
        {"kind": "tree", "ctx": block_size, "parents": random_parents(5, g, "chain")},
        {"kind": "frontier", "ctx": 9, "parents": par, "rows": [r for r in range(len(par) + 1) if r >= len(par) // 2]},
        {"kind": "causal", "ctx": 0, "q": 1},  # first token of a prompt
    ]


def _boundary_requests(g, block_size):
    """Sequence lengths at k*block_size, +-1, and tree bases on block edges."""
    reqs = []
    for s in (block_size - 1, block_size, block_size + 1, 2 * block_size):
        reqs.append({"kind": "causal", "ctx": s - 1, "q": 1})
    reqs.append({"kind": "tree", "ctx": block_size - 2, "parents": random_parents(3, g)})  # tree straddles
    reqs.append({"kind": "tree", "ctx": 2 * block_size, "parents": random_parents(block_size - 1, g)})
    return reqs


def _poisoned(query):
    return torch.full_like(query, float("nan"))


# --------------------------------------------------------------------------------- reference


@pytest.mark.parametrize(
    "seed,layout,dtype,hq,hkv,d,bs",
    [
        (1, "gpu", torch.float32, 4, 2, 32, 16),
        (2, "cpu", torch.float32, 3, 1, 16, 32),
        (3, "gpu", torch.bfloat16, 2, 2, 16, 16),
        (4, "cpu", torch.float16, 4, 4, 8, 16),
    ],
)
def test_reference_matches_bruteforce(seed, layout, dtype, hq, hkv, d, bs):
    g = gen(seed)
    reqs = _mixed_requests(g, bs) + _boundary_requests(g, bs)
    batch = make_attn_batch(reqs, hq, hkv, d, bs, dtype, layout, g, pad_tokens=2)
    out = graph_attention_ref(*batch.args(), out=_poisoned(batch.query), layout=layout)
    t = int(batch.query_start_loc[-1])
    expect = attention_bruteforce(batch)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out[:t].double(), expect, atol=atol, rtol=rtol)
    assert torch.isnan(out[t:]).all(), "padding tokens past the last request must stay untouched"


def test_reference_tree_row_sees_only_context_and_ancestors():
    """Hand-made case: changing a non-ancestor key must not change a tree row's output."""
    g = gen(7)
    parents = [0, 0, 1, 2]  # rows: 1<-0, 2<-0, 3<-1, 4<-2
    batch = make_attn_batch([{"kind": "tree", "ctx": 5, "parents": parents}], 2, 1, 16, 16,
                            torch.float32, "gpu", g)
    out1 = graph_attention_ref(*batch.args()).clone()
    # row 3's key (pos 5 + 3) is not an ancestor of rows 2 and 4
    blk = int(batch.paged.block_table[0, 8 // 16])
    batch.paged.key_cache[blk, 8 % 16] += 3.0
    batch.paged.value_cache[blk, 8 % 16] -= 5.0
    out2 = graph_attention_ref(*batch.args())
    for row in (0, 1, 2, 4):
        torch.testing.assert_close(out1[row], out2[row])
    assert not torch.allclose(out1[3], out2[3])


# ------------------------------------------------------------------------------------ triton


CASES = {
    # name: (seed, requests-builder, layout, dtype, hq, hkv, d, bs, num_splits)
    "mixed-gpu-fp32-gqa": (11, "mixed", "gpu", torch.float32, 4, 2, 64, 16, None),
    "mixed-cpu-bf16-gqa": (12, "mixed", "cpu", torch.bfloat16, 8, 2, 64, 32, None),
    "boundaries-gpu-fp32-splits3": (13, "boundary", "gpu", torch.float32, 2, 1, 32, 16, 3),
    "boundaries-cpu-fp32-d80-g3": (14, "boundary", "cpu", torch.float32, 3, 1, 80, 32, 1),
    "mixed-bhnc-strided-fp16": (15, "mixed", "gpu_bhnc", torch.float16, 4, 4, 32, 16, 2),
    "bs128-d128-splits4": (16, "long", "gpu", torch.bfloat16, 2, 1, 128, 128, 4),
    "tree256-small": (17, "tree256", "gpu", torch.float32, 2, 1, 16, 16, None),
    "tree256-cpu-bf16": (18, "tree256", "cpu", torch.bfloat16, 2, 2, 32, 32, 2),
    "d96-odd-heads": (19, "mixed", "gpu", torch.float32, 5, 1, 96, 16, 1),
}


def _requests(kind, g, bs):
    if kind == "mixed":
        return _mixed_requests(g, bs)
    if kind == "boundary":
        return _boundary_requests(g, bs)
    if kind == "long":
        return [
            {"kind": "tree", "ctx": 3 * bs + 17, "parents": random_parents(20, g)},
            {"kind": "causal", "ctx": 2 * bs - 1, "q": 3},
        ]
    if kind == "tree256":
        return [
            {"kind": "tree", "ctx": 40, "parents": random_parents(256, g)},
            {"kind": "tree", "ctx": 3, "parents": random_parents(70, g, "chain")},
            {"kind": "causal", "ctx": 10, "q": 2},
        ]
    raise ValueError(kind)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference(name):
    seed, kind, layout, dtype, hq, hkv, d, bs, splits = CASES[name]
    g = gen(seed)
    batch = make_attn_batch(_requests(kind, g, bs), hq, hkv, d, bs, dtype, layout, g, pad_tokens=3)
    attn_layout = "cpu" if layout == "cpu" else "gpu"  # gpu_bhnc: its split views are "gpu"
    ref = graph_attention_ref(*batch.args(), out=_poisoned(batch.query), layout=attn_layout)
    out = graph_attention(*batch.args(), out=_poisoned(batch.query), layout=attn_layout,
                          num_splits=splits)
    t = int(batch.query_start_loc[-1])
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out[:t].float(), ref[:t].float(), atol=atol, rtol=rtol)
    assert torch.isnan(out[t:]).all(), "padding tokens past the last request must stay untouched"


def test_triton_split_counts_agree():
    """The split-K reduce gives the same answer for any split count (incl. empty splits)."""
    g = gen(21)
    batch = make_attn_batch(_mixed_requests(g, 16), 2, 1, 32, 16, torch.float32, "gpu", g)
    outs = [graph_attention(*batch.args(), out=_poisoned(batch.query), num_splits=s) for s in (1, 2, 7)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=2e-5, rtol=2e-5)


def test_triton_returns_fresh_output_and_accepts_hints(poison_empty):
    g = gen(22)
    batch = make_attn_batch([{"kind": "tree", "ctx": 30, "parents": random_parents(9, g)}],
                            4, 2, 32, 16, torch.float32, "gpu", g)
    ref = graph_attention_ref(*batch.args())
    out = graph_attention(*batch.args(), max_seq_len=int(batch.seq_lens.max()), max_query_len=10)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
