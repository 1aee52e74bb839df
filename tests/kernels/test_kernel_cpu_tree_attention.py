"""The CPU backend's graph-masked attention (engine/cpu_attention.py: `plan_cpu_tree` and
`paged_tree_attention`) against the torch reference `graph_attention_ref`, on random trees and
draft frontiers of odd sizes in vLLM's CPU cache packings ("vec", and the tiled "amx" that vLLM's
own cache writer packs), beside a causal request whose rows it must leave alone. Unused cache
slots hold NaN, so a read past a request's tokens shows up."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scripts.tools.kernel_testutils import gen, make_attn_batch, random_parents
# engine/cpu_attention.py imports no vLLM (the CPU_ATTN subclass that runs it is
# vllm_v0_32/attention/cpu_backend.py), so this file runs where vLLM cannot be installed too.
from vllm_gsd.engine import cpu_attention
from vllm_gsd.kernels import graph_attention_ref, split_kv_cache
from vllm_gsd.kernels.paged_layout import cpu_packing

SENTINEL = -77.0


def _requests(seed: int, num_trees: int, frontier: bool):
    """A causal request first, then `num_trees` trees (verification rows, or a draft frontier)."""
    g = gen(seed)
    requests = [{"kind": "causal", "ctx": int(torch.randint(0, 40, (1,), generator=g)), "q": 3}]
    for _ in range(num_trees):
        n = int(torch.randint(1, 24, (1,), generator=g))
        parents = random_parents(n, g)
        ctx = int(torch.randint(0, 90, (1,), generator=g))
        if frontier:  # a draft level: only some rows are queried (all n + 1 are cached)
            rows = sorted(set(torch.randint(0, n + 1, (max(1, n // 2),), generator=g).tolist()))
            requests.append({"kind": "frontier", "ctx": ctx, "parents": parents, "rows": rows})
        else:
            requests.append({"kind": "tree", "ctx": ctx, "parents": parents})
    return requests


def _check_tree_rows(seed, num_trees, frontier, heads, head_dim, block_size, dtype, isa):
    num_heads, num_kv_heads = heads
    requests = _requests(seed, num_trees, frontier)
    batch = make_attn_batch(requests, num_heads, num_kv_heads, head_dim, block_size, dtype, "cpu", gen(seed + 1))
    kv_cache = batch.paged.kv_cache if isa == "vec" else _repacked(batch.paged.kv_cache, isa)
    starts = batch.query_start_loc.tolist()
    trees = range(1, len(requests))  # request 0 is causal: not in the plan
    plan = cpu_attention.plan_cpu_tree(
        batch.paged.block_table[1:], batch.seq_lens[1:].tolist(), starts[1:-1],
        [starts[b + 1] - starts[b] for b in trees], batch.tree_base[1:].tolist(), batch.query_tree_row,
        batch.ancestor_words[1:], block_size, covers_all_rows=False,
        packing=cpu_packing(isa, block_size, head_dim))
    out = torch.full_like(batch.query, SENTINEL)
    cpu_attention.paged_tree_attention(batch.query, kv_cache, plan, batch.scale, out)

    ref = graph_attention_ref(*batch.args(), layout="cpu")
    tree_rows = slice(starts[1], starts[-1])
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the output
    torch.testing.assert_close(out[tree_rows].float(), ref[tree_rows].float(), atol=tol, rtol=tol)
    assert bool((out[:starts[1]] == SENTINEL).all()), "a row outside the plan was written"


def _repacked(vec_cache: torch.Tensor, isa: str) -> torch.Tensor:
    """The same tokens (NaN slots included) as vLLM's own cache writer packs them for `isa`."""
    from vllm import _custom_ops as ops

    nb, hkv, bs, two_d = vec_cache.shape
    keys, values = split_kv_cache(vec_cache, "cpu")  # [nb, bs, Hkv, D]
    packed = torch.empty_like(vec_cache)
    key_cache, value_cache = packed.view(nb, hkv, 2 * bs, two_d // 2).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys.reshape(nb * bs, hkv, -1), values.reshape(nb * bs, hkv, -1),
                                   key_cache, value_cache, torch.arange(nb * bs), isa)
    return packed


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), num_trees=st.integers(1, 3), frontier=st.booleans(),
       heads=st.sampled_from([(4, 2), (6, 3), (5, 5), (12, 2)]), head_dim=st.sampled_from([32, 64, 80]),
       block_size=st.sampled_from([16, 32]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_tree_rows_match_the_reference(seed, num_trees, frontier, heads, head_dim, block_size, dtype):
    _check_tree_rows(seed, num_trees, frontier, heads, head_dim, block_size, dtype, "vec")


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), num_trees=st.integers(1, 3), frontier=st.booleans(),
       heads=st.sampled_from([(4, 2), (12, 2), (3, 3)]), head_dim=st.sampled_from([32, 64, 128]),
       block_size=st.sampled_from([32, 64]))
def test_tree_rows_match_the_reference_in_amx_packing(seed, num_trees, frontier, heads, head_dim, block_size):
    """vLLM picks "amx" for bfloat16 caches on CPUs with AMX tiles (block_size % 32 == 0)."""
    _check_tree_rows(seed, num_trees, frontier, heads, head_dim, block_size, torch.bfloat16, "amx")
