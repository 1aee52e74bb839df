"""Random inputs and obviously-correct (slow, loop-based) oracles for the kernel tests.

Shared by tests/kernels and `python -m scripts.gpu_check` (which runs without vLLM: torch and
vllm_gsd.kernels only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_gsd.kernels.paged_layout import cpu_kv_cache_shape, gpu_kv_cache_shape, split_kv_cache


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def randint(g: torch.Generator, lo: int, hi: int) -> int:
    """Uniform integer in [lo, hi]."""
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


# ------------------------------------------------------------------------------------------
# Trees (breadth-first flattened: parent rows non-decreasing, parent_row[i] < i + 1)
# ------------------------------------------------------------------------------------------


def random_parents(n: int, g: torch.Generator, kind: str = "random") -> list[int]:
    """Parent rows of node rows 1..n of a BFS-ordered tree.

    A non-decreasing parent sequence with parent < own row is exactly a BFS order."""
    if kind == "chain":
        return list(range(n))
    if kind == "star":
        return [0] * n
    parents, p = [], 0
    for i in range(n):
        # stay on the same parent (siblings) or move on to a later row; bias gives depth ~log n
        if i > 0 and randint(g, 0, 2) == 0:
            p = min(i, p + randint(g, 1, 3))
        parents.append(p)
    return parents


def pad_trees(parent_lists: list[list[int]], n_budget: int):
    """-> (parent_row int64 [B, N], num_nodes int64 [B]), -1 padded."""
    b = len(parent_lists)
    parent_row = torch.full((b, n_budget), -1, dtype=torch.int64)
    num_nodes = torch.zeros(b, dtype=torch.int64)
    for i, ps in enumerate(parent_lists):
        parent_row[i, : len(ps)] = torch.tensor(ps, dtype=torch.int64)
        num_nodes[i] = len(ps)
    return parent_row, num_nodes


def ancestor_words_loop(parent_row: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """Pure-python ancestor bitmasks (contract layout), for building attention test inputs."""
    b, n = parent_row.shape
    w = (n + 32) // 32
    out = torch.zeros((b, n + 1, w), dtype=torch.int32)
    for i in range(b):
        nb = int(num_nodes[i])
        for r in range(n + 1):
            bits = [r]
            c = r
            while 1 <= c <= nb:
                c = int(parent_row[i, c - 1])
                bits.append(c)
            for c in bits:
                word = int(out[i, r, c // 32]) & 0xFFFFFFFF
                word |= 1 << (c % 32)
                out[i, r, c // 32] = word - (1 << 32) if word >= (1 << 31) else word
    return out


# ------------------------------------------------------------------------------------------
# Paged KV caches
# ------------------------------------------------------------------------------------------


@dataclass
class PagedKV:
    kv_cache: torch.Tensor  # one layer, in `layout`
    key_cache: torch.Tensor  # what an attention backend passes for this layout
    value_cache: torch.Tensor
    block_table: torch.Tensor  # int32 [B, max_blocks]
    dense_k: list[torch.Tensor]  # per request [S_b, Hkv, D] (the cached values)
    dense_v: list[torch.Tensor]
    layout: str


def make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, layout, g,
                  extra_blocks: int = 3, poison: float = float("nan")) -> PagedKV:
    """Random per-request K/V scattered into shuffled physical blocks; every slot that holds
    no request token is poisoned (NaN by default) so any read of it shows up."""
    need = [max(1, math.ceil(s / block_size)) for s in seq_lens]
    num_blocks = sum(need) + extra_blocks
    max_blocks = max(need) + 1  # one spare column: padding entries point at block 0
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)
    shape = (gpu_kv_cache_shape if layout == "gpu" else cpu_kv_cache_shape)(
        num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.full(shape, poison, dtype=dtype)
    k_all, v_all = split_kv_cache(kv_cache, layout)
    dense_k, dense_v, used = [], [], 0
    for b, s in enumerate(seq_lens):
        blocks = perm[used: used + need[b]]
        used += need[b]
        block_table[b, : need[b]] = blocks.to(torch.int32)
        k = torch.randn((s, num_kv_heads, head_dim), generator=g).to(dtype)
        v = torch.randn((s, num_kv_heads, head_dim), generator=g).to(dtype)
        pos = torch.arange(s)
        k_all[blocks[pos // block_size], pos % block_size] = k
        v_all[blocks[pos // block_size], pos % block_size] = v
        dense_k.append(k)
        dense_v.append(v)
    if layout == "cpu":
        nb, h, bs, two_d = kv_cache.shape
        key_cache, value_cache = kv_cache.view(nb, h, 2 * bs, two_d // 2).chunk(2, dim=2)
    elif layout == "gpu":
        key_cache, value_cache = kv_cache[0], kv_cache[1]
    else:
        key_cache, value_cache = k_all, v_all
    return PagedKV(kv_cache, key_cache, value_cache, block_table, dense_k, dense_v, layout)


# ------------------------------------------------------------------------------------------
# Attention batches
# ------------------------------------------------------------------------------------------


@dataclass
class AttnBatch:
    query: torch.Tensor
    paged: PagedKV
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    tree_base: torch.Tensor
    query_tree_row: torch.Tensor
    ancestor_words: torch.Tensor
    scale: float

    def args(self):
        return (self.query, self.paged.key_cache, self.paged.value_cache, self.paged.block_table,
                self.query_start_loc, self.seq_lens, self.tree_base, self.query_tree_row,
                self.ancestor_words, self.scale)


def make_attn_batch(requests, num_heads, num_kv_heads, head_dim, block_size, dtype, layout, g,
                    n_budget=None, pad_tokens: int = 0) -> AttnBatch:
    """requests: list of dicts, one per request:
      {"kind": "causal", "ctx": c, "q": q}          q causal tokens after c cached tokens
      {"kind": "tree", "ctx": c, "parents": [...]}  verification: rows 0..n, tree_base = c
      {"kind": "frontier", "ctx": c, "parents": [...], "rows": [...]}
          draft expansion: all n+1 rows are cached, the query is only `rows`
    `pad_tokens` extra query tokens past the last request (must stay untouched)."""
    trees = [r.get("parents", []) for r in requests]
    n = max([len(t) for t in trees] + [n_budget or 0, 1])
    parent_row, num_nodes = pad_trees(trees, n)
    anc = ancestor_words_loop(parent_row, num_nodes)
    q_rows, seq_lens, bases = [], [], []
    for r in requests:
        if r["kind"] == "causal":
            rows = [-1] * r["q"]
            seq_lens.append(r["ctx"] + r["q"])
            bases.append(0)
        else:
            n_rows = len(r["parents"]) + 1
            rows = list(range(n_rows)) if r["kind"] == "tree" else list(r["rows"])
            seq_lens.append(r["ctx"] + n_rows)
            bases.append(r["ctx"])
        q_rows.append(rows)
    qsl = [0]
    for rows in q_rows:
        qsl.append(qsl[-1] + len(rows))
    t = qsl[-1] + pad_tokens
    flat_rows = [x for rows in q_rows for x in rows] + [-1] * pad_tokens
    paged = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, layout, g)
    query = torch.randn((t, num_heads, head_dim), generator=g).to(dtype)
    return AttnBatch(
        query=query, paged=paged,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        tree_base=torch.tensor(bases, dtype=torch.int32),
        query_tree_row=torch.tensor(flat_rows, dtype=torch.int32),
        ancestor_words=anc, scale=1.0 / math.sqrt(head_dim),
    )


def attention_bruteforce(batch: AttnBatch) -> torch.Tensor:
    """float64 attention straight from the contract: dense per-request K/V, a visibility
    mask built key by key with python ints, explicit softmax. Returns [T_real, Hq, D] fp64."""
    q_all = batch.query.double()
    num_heads = q_all.shape[1]
    qsl = batch.query_start_loc.tolist()
    outs = []
    for b in range(len(qsl) - 1):
        q0, q1 = qsl[b], qsl[b + 1]
        s = int(batch.seq_lens[b])
        base = int(batch.tree_base[b])
        k = batch.paged.dense_k[b].double()
        v = batch.paged.dense_v[b].double()
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)  # query head h uses kv head h // group
        v = v.repeat_interleave(group, dim=1)
        q_len = q1 - q0
        for t in range(q0, q1):
            r = int(batch.query_tree_row[t])
            vis = []
            for p in range(s):
                if r < 0:
                    ok = p <= s - q_len + (t - q0)
                else:
                    word = int(batch.ancestor_words[b, r, (p - base) // 32]) if p >= base else 0
                    ok = p < base or (base <= p < s and (word >> ((p - base) % 32)) & 1 == 1)
                vis.append(ok)
            vis_t = torch.tensor(vis)
            if not vis_t.any():
                outs.append(torch.zeros(num_heads, k.shape[-1], dtype=torch.float64))
                continue
            scores = torch.einsum("hd,phd->hp", q_all[t], k) * batch.scale
            scores = scores.masked_fill(~vis_t[None, :], float("-inf"))
            outs.append(torch.einsum("hp,phd->hd", torch.softmax(scores, dim=-1), v))
    return torch.stack(outs) if outs else torch.zeros((0, num_heads, q_all.shape[-1]), dtype=torch.float64)
