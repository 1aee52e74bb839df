#!/usr/bin/env python
"""GPU check of the vllm-gsd Triton kernels: the deployment probe (scripts/gpu_probe.py), correctness
against the torch references, then a timing table for graph-masked attention.

Runs on a CUDA machine with torch + triton and WITHOUT vLLM (nothing imported here needs it),
from the repository root, as a module (no install of vllm-gsd needed: `python -m` puts the root on
sys.path, and kernels/ is loaded as vllm_gsd.kernels when the package is not installed):

    python -m scripts.gpu_check --out $OUT                  # everything: probe, checks, benchmark
    python -m scripts.gpu_check --no-bench --no-probe       # correctness only
    python -m scripts.gpu_check --cpu-smoke --out /tmp/gc   # tiny shapes, CPU interpreter

--out DIR writes DIR/gpu_check.md and DIR/gpu_check.json (--out FILE.md: that file and FILE.json),
rewritten after every section so a run cut short still leaves its results; without --out, $OUT
when set. The run stops adding work when --budget-s runs out (each section notes what it skipped)
and prints a short summary table last. docs/gpu-check.md: the one-call command and the sections.

Random inputs and loop oracles come from scripts/tools/kernel_testutils.py (shared with
tests/kernels). Nothing here needs vLLM or numba: vllm_gsd.graph references are loaded through
gpu_probe.graph_module.

Probe (scripts/gpu_probe.py; --probe picks sections, --no-probe skips them): launch buckets
compiled with their resources, deployment shapes on vLLM-strided NaN-poisoned caches, offsets past
2**31 elements, host vs device microseconds over 80 layers, tree-walk syncs, Gumbel noise cost.

Correctness (exit status 1 if any fails):
  * graph_attention (Triton) vs graph_attention_ref over layouts gpu / gpu_bhnc (strided) / cpu,
    fp32 / bf16 / fp16, head dims 64/80/96/128, block sizes 16/128, GQA, split counts, a
    256-node tree, mixed causal + tree batches, and one 32k-token context;
  * graph_attention_ref vs a brute-force dense fp64 oracle (small case);
  * triton_ancestor_words_from_parents vs a python oracle and vllm_gsd.graph's torch reference;
  * compact_kv and compact_kv_ref vs a sequential python copy;
  * triton_walk_tree vs a python oracle and vllm_gsd.graph.acceptance.walk_tree.

Benchmark (bf16, head dim 128, 32 query heads / 8 kv heads, block size 16; batch 1/16/64,
N = 16/64 tree nodes, context 1k/8k; every request is a verification tree of N+1 rows):
  * graph   : graph_attention with the tree mask;
  * causal  : the SAME kernel on the same query tokens, seq_lens and paged cache, with every
              query row marked causal (query_tree_row = -1). This is the fair baseline: it is
              plain causal paged attention over the same T = B*(N+1) tokens, so graph/causal is
              exactly the cost of the graph mask;
  * sdpa    : torch scaled_dot_product_attention with an explicit boolean mask on dense,
              pre-gathered, pre-GQA-expanded K/V (gathering the paged cache is NOT timed, which
              favours SDPA).
Times are medians from triton.testing.do_bench, in milliseconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

if not __package__:  # run as a file: the scripts package is not importable from scripts/
    sys.exit("run from the repository root as a module: python -m scripts.gpu_check [options]")

ROOT = Path(__file__).resolve().parent.parent


def _parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                    help="report folder (gpu_check.md + gpu_check.json), or a .md file; default $OUT")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="stop adding work after this many seconds (sections note what they skip)")
    ap.add_argument("--probe", default="buckets,deploy,offsets,host,walk,gumbel",
                    help="probe sections to run, in this order (scripts/gpu_probe.py)")
    ap.add_argument("--no-probe", action="store_true", help="skip the probe sections")
    ap.add_argument("--no-bench", action="store_true", help="correctness checks only")
    ap.add_argument("--no-check", action="store_true", help="benchmark only")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="no GPU: run tiny shapes in the Triton interpreter (sets TRITON_INTERPRET=1)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--nodes", default="16,64")
    ap.add_argument("--contexts", default="1024,8192")
    return ap.parse_args()


ARGS = _parse()
START = time.monotonic()
if ARGS.cpu_smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import
elif "TRITON_CACHE_DIR" not in os.environ:
    # Cold compiles: the bucket section reports compile seconds, which a warm on-disk cache
    # (a second run on the same machine) would hide.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="gsd-triton-cache-")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def _load_kernels():
    """vllm_gsd.kernels if installed, else the repo's kernels/ loaded under that name (the
    package maps kernels/ -> vllm_gsd.kernels; vllm_gsd/__init__.py is light and vLLM-free, and
    imports from the repository root, which `python -m` put on sys.path)."""
    try:
        import vllm_gsd.kernels as k  # noqa: PLC0415

        return k
    except ImportError:
        pass
    import vllm_gsd  # noqa: F401, PLC0415 - the parent package, for vllm_gsd.graph references

    spec = importlib.util.spec_from_file_location(
        "vllm_gsd.kernels", ROOT / "kernels" / "__init__.py",
        submodule_search_locations=[str(ROOT / "kernels")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vllm_gsd.kernels"] = mod
    spec.loader.exec_module(mod)
    return mod


K = _load_kernels()
from scripts import gpu_probe as P  # noqa: E402 - imports vllm_gsd.kernels, loaded above
from scripts.tools import kernel_testutils as TU  # noqa: E402

if ARGS.cpu_smoke:
    DEV = torch.device("cpu")
elif not torch.cuda.is_available():
    print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False). "
          "Run on a GPU machine, or use --cpu-smoke for a tiny interpreter run.", file=sys.stderr)
    sys.exit(2)
else:
    DEV = torch.device("cuda")

FAILURES: list[str] = []
LOG: list[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)
    LOG.append(msg)


def check(name: str, fn) -> None:
    t0 = time.time()
    try:
        fn()
        log(f"PASS  {name}  ({time.time() - t0:.1f}s)")
    except Exception as e:  # noqa: BLE001 - every failure is reported, the run goes on
        FAILURES.append(name)
        log(f"FAIL  {name}: {type(e).__name__}: {str(e)[:2000]}")
        traceback.print_exc()


def graph_ref(module: str, attr: str):
    """The graph room's torch reference vllm_gsd.graph.<module>.<attr>, loaded without vLLM and,
    where numba is missing, without the graph package's numba-compiled builder."""
    return getattr(P.graph_module(module), attr)


# ---------------------------------------------------------------------------------- helpers


def batch_to_device(batch):
    """Move an AttnBatch (built on CPU by the test utils) to DEV, keeping cache views."""
    p = batch.paged
    kv = p.kv_cache.to(DEV)
    if p.layout == "cpu":
        nb, h, bs, two_d = kv.shape
        kc, vc = kv.view(nb, h, 2 * bs, two_d // 2).chunk(2, dim=2)
    elif p.layout == "gpu":
        kc, vc = kv[0], kv[1]
    else:
        kc, vc = K.split_kv_cache(kv, p.layout)
    paged = TU.PagedKV(kv, kc, vc, p.block_table.to(DEV), p.dense_k, p.dense_v, p.layout)
    return TU.AttnBatch(
        query=batch.query.to(DEV), paged=paged, query_start_loc=batch.query_start_loc.to(DEV),
        seq_lens=batch.seq_lens.to(DEV), tree_base=batch.tree_base.to(DEV),
        query_tree_row=batch.query_tree_row.to(DEV), ancestor_words=batch.ancestor_words.to(DEV),
        scale=batch.scale)


TOL = {torch.float32: 1e-4, torch.bfloat16: 2.5e-2, torch.float16: 4e-3}


def mixed_requests(g, bs, n):
    par = TU.random_parents(n, g)
    return [
        {"kind": "causal", "ctx": bs + 3, "q": 37},
        {"kind": "tree", "ctx": 5 * bs - 1, "parents": par},
        {"kind": "tree", "ctx": 5, "parents": []},
        {"kind": "tree", "ctx": 2 * bs, "parents": TU.random_parents(9, g, "chain")},
        {"kind": "frontier", "ctx": 70, "parents": par, "rows": list(range(len(par) // 2, len(par) + 1))},
        {"kind": "causal", "ctx": 3 * bs, "q": 1},
        {"kind": "causal", "ctx": 0, "q": 1},
    ]


def attn_case(seed, reqs_fn, layout, dtype, hq, hkv, d, bs, splits, pad=3):
    def run():
        g = TU.gen(seed)
        batch = TU.make_attn_batch(reqs_fn(g, bs), hq, hkv, d, bs, dtype, layout, g, pad_tokens=pad)
        batch = batch_to_device(batch)
        attn_layout = "cpu" if layout == "cpu" else "gpu"
        poison = torch.full_like(batch.query, float("nan"))
        ref = K.graph_attention_ref(*batch.args(), out=poison.clone(), layout=attn_layout)
        out = K.graph_attention(*batch.args(), out=poison.clone(), layout=attn_layout, num_splits=splits)
        t = int(batch.query_start_loc[-1])
        tol = TOL[dtype]
        torch.testing.assert_close(out[:t].float(), ref[:t].float(), atol=tol, rtol=tol)
        assert torch.isnan(out[t:]).all(), "padding tokens were written"
    return run


def check_attention():
    small = TU.attention_bruteforce

    def ref_vs_bruteforce():
        g = TU.gen(1)
        batch = TU.make_attn_batch(mixed_requests(g, 16, 12), 4, 2, 32, 16, torch.float32, "gpu", g)
        expect = small(batch)
        batch = batch_to_device(batch)
        out = K.graph_attention_ref(*batch.args())
        torch.testing.assert_close(out.double().cpu(), expect, atol=1e-5, rtol=1e-5)

    check("graph_attention_ref == brute force (fp32)", ref_vs_bruteforce)
    mixed = lambda n: (lambda g, bs: mixed_requests(g, bs, n))  # noqa: E731
    cases = [
        (11, mixed(24), "gpu", torch.float32, 4, 2, 64, 16, None),
        (12, mixed(24), "gpu", torch.bfloat16, 32, 8, 128, 16, None),
        (13, mixed(24), "gpu", torch.bfloat16, 32, 8, 128, 16, 5),
        (14, mixed(64), "gpu", torch.float16, 8, 8, 64, 128, None),
        (15, mixed(24), "gpu_bhnc", torch.bfloat16, 16, 4, 128, 16, None),
        (16, mixed(24), "cpu", torch.bfloat16, 8, 2, 128, 32, None),
        (17, mixed(24), "gpu", torch.float32, 6, 2, 80, 16, 3),
        (18, mixed(24), "gpu", torch.bfloat16, 12, 4, 96, 16, None),
        (19, mixed(256), "gpu", torch.bfloat16, 16, 4, 64, 16, None),
        (20, mixed(256), "cpu", torch.float32, 4, 1, 64, 32, 2),
        (21, lambda g, bs: [{"kind": "tree", "ctx": 32768, "parents": TU.random_parents(64, g)},
                            {"kind": "causal", "ctx": 20000, "q": 5}],
         "gpu", torch.bfloat16, 32, 8, 128, 16, None),
    ]
    if ARGS.cpu_smoke:  # interpreter: keep it to a couple of tiny cases
        cases = [(11, mixed(12), "gpu", torch.float32, 4, 2, 32, 16, None),
                 (16, mixed(12), "cpu", torch.bfloat16, 4, 2, 32, 32, 2)]
    for seed, fn, layout, dtype, hq, hkv, d, bs, splits in cases:
        name = (f"graph_attention seed={seed} layout={layout} {str(dtype)[6:]} Hq={hq} Hkv={hkv} "
                f"D={d} bs={bs} splits={splits}")
        check(name, attn_case(seed, fn, layout, dtype, hq, hkv, d, bs, splits))


def check_ancestors():
    ref = graph_ref("ancestors", "ancestor_words_from_parents")
    for seed, n, b in [(1, 16, 8), (2, 64, 16), (3, 256, 32), (4, 300, 4)]:
        def run(seed=seed, n=n, b=b):
            g = TU.gen(seed)
            trees = [TU.random_parents([n, 0, TU.randint(g, 1, n)][i % 3], g, ["random", "chain", "star"][i % 3])
                     for i in range(b)]
            parents, num_nodes = TU.pad_trees(trees, n)
            out = K.triton_ancestor_words_from_parents(parents.to(DEV), num_nodes.to(DEV)).cpu()
            torch.testing.assert_close(out, TU.ancestor_words_loop(parents, num_nodes), atol=0, rtol=0)
            if ref is not None:
                torch.testing.assert_close(out, ref(parents.to(DEV), num_nodes.to(DEV)).cpu(), atol=0, rtol=0)
        check(f"triton_ancestor_words_from_parents N={n} B={b} (torch ref {'yes' if ref else 'MISSING'})", run)


def check_compaction():
    for seed, layout, dtype, bs, hkv, d, n in [(1, "gpu", torch.bfloat16, 16, 8, 128, 64),
                                                (2, "cpu", torch.float32, 32, 2, 64, 40),
                                                (3, "gpu_bhnc", torch.float16, 16, 8, 128, 256)]:
        def run(seed=seed, layout=layout, dtype=dtype, bs=bs, hkv=hkv, d=d, n=n):
            g = TU.gen(seed)
            trees = [TU.random_parents(m, g, k) for m, k in ((n, "chain"), (n, "random"), (0, "star"), (n // 2, "random"))]
            ctxs = [bs - 3, 2 * bs - 1, 5, 100]
            seq_lens = [c + len(t) + 1 for c, t in zip(ctxs, trees)]
            rows = torch.full((4, n + 1), -1, dtype=torch.int64)
            acc = torch.zeros(4, dtype=torch.int64)
            for i, ps in enumerate(trees):
                path, r = [0], 0
                while True:
                    kids = [c + 1 for c, p in enumerate(ps) if p == r]
                    if not kids:
                        break
                    r = kids[TU.randint(g, 0, len(kids) - 1)]
                    path.append(r)
                rows[i, :len(path)] = torch.tensor(path)
                acc[i] = len(path) - 1
            paged = TU.make_paged_kv(seq_lens, hkv, d, bs, dtype, layout, g)
            layers = [torch.randn(paged.kv_cache.shape, generator=g).to(dtype) for _ in range(3)]
            tb = torch.tensor(ctxs, dtype=torch.int32)
            expect = [x.clone() for x in layers]
            for kv in expect:
                for cache in K.split_kv_cache(kv, layout):
                    for b in range(4):
                        for k in range(1, int(acc[b]) + 1):
                            src, dst = ctxs[b] + int(rows[b, k]), ctxs[b] + k
                            sb, db = int(paged.block_table[b, src // bs]), int(paged.block_table[b, dst // bs])
                            cache[db, dst % bs] = cache[sb, src % bs].clone()
            for fn in (K.compact_kv, K.compact_kv_ref):
                got = [x.to(DEV, copy=True) for x in layers]
                fn(got, paged.block_table.to(DEV), bs, tb.to(DEV), rows.to(DEV), acc.to(DEV), layout=layout)
                for e, x in zip(expect, got):
                    assert torch.equal(e, x.cpu()), f"{fn.__name__} differs from the sequential copy"
        check(f"compact_kv (+ref) layout={layout} {str(dtype)[6:]} bs={bs} N={n}", run)


def check_walk():
    ref = graph_ref("acceptance", "walk_tree")
    for seed, n, b in [(1, 16, 64), (2, 64, 64), (3, 256, 8)]:
        def run(seed=seed, n=n, b=b):
            g = TU.gen(seed)
            trees = [TU.random_parents([n, 0, TU.randint(g, 1, n)][i % 3], g, ["random", "chain", "star"][i % 3])
                     for i in range(b)]
            parents, num_nodes = TU.pad_trees(trees, n)
            draft = torch.randint(0, 4, (b, n), generator=g)
            draft[parents < 0] = -1
            target = torch.randint(0, 4, (b, n + 1), generator=g)
            rows, toks, acc = K.triton_walk_tree(draft.to(DEV), parents.to(DEV), num_nodes.to(DEV), target.to(DEV))
            # python oracle
            for i in range(b):
                r, k, path, out = 0, 0, [0], []
                while True:
                    t = int(target[i, r])
                    out.append(t)
                    kids = [c for c in range(int(num_nodes[i])) if int(parents[i, c]) == r and int(draft[i, c]) == t]
                    if not kids:
                        break
                    r, k = kids[0] + 1, k + 1
                    path.append(r)
                pad = [-1] * (n + 1)
                assert rows[i].tolist() == (path + pad)[: n + 1], f"rows differ for request {i}"
                assert toks[i].tolist() == (out + pad)[: n + 1], f"tokens differ for request {i}"
                assert int(acc[i]) == k
            if ref is not None:
                e = ref(draft.to(DEV), parents.to(DEV), num_nodes.to(DEV), target.to(DEV))
                assert torch.equal(rows.cpu(), e.accepted_rows.cpu())
                assert torch.equal(toks.cpu(), e.output_token_ids.cpu())
                assert torch.equal(acc.cpu(), e.num_accepted.cpu().long())
        check(f"triton_walk_tree N={n} B={b} (torch ref {'yes' if ref else 'MISSING'})", run)


# -------------------------------------------------------------------------------- benchmark


def bench_ms(fn) -> float:
    if ARGS.cpu_smoke:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing  # noqa: PLC0415

    try:
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    except TypeError:  # older signature
        return float(triton.testing.do_bench(fn, warmup=25, rep=100))


def bench_config(b, n, ctx, hq=32, hkv=8, d=128, bs=16, dtype=torch.bfloat16):
    """Every request: ctx cached tokens + a random N-node verification tree (N+1 rows)."""
    g = torch.Generator(device="cpu").manual_seed(1000 + b * 7 + n + ctx)
    q_len = n + 1
    s = ctx + q_len
    blocks_per = math.ceil(s / bs)
    num_blocks = b * blocks_per
    perm = torch.randperm(num_blocks, generator=g)
    block_table = perm.view(b, blocks_per).to(torch.int32).to(DEV)
    kv = torch.randn((2, num_blocks, bs, hkv, d), dtype=dtype, device=DEV)
    trees = [TU.random_parents(n, g) for _ in range(b)]
    parents, num_nodes = TU.pad_trees(trees, n)
    anc = K.triton_ancestor_words_from_parents(parents.to(DEV), num_nodes.to(DEV))
    t = b * q_len
    query = torch.randn((t, hq, d), dtype=dtype, device=DEV)
    qsl = (torch.arange(b + 1, dtype=torch.int32) * q_len).to(DEV)
    seq_lens = torch.full((b,), s, dtype=torch.int32, device=DEV)
    tree_base = torch.full((b,), ctx, dtype=torch.int32, device=DEV)
    rows = torch.arange(q_len, dtype=torch.int32, device=DEV).repeat(b)
    causal_rows = torch.full_like(rows, -1)
    out = torch.empty_like(query)
    scale = 1.0 / math.sqrt(d)
    hints = dict(max_seq_len=s, max_query_len=q_len)

    def graph():
        K.graph_attention(query, kv[0], kv[1], block_table, qsl, seq_lens, tree_base, rows, anc,
                          scale, out=out, **hints)

    def causal():
        K.graph_attention(query, kv[0], kv[1], block_table, qsl, seq_lens, tree_base, causal_rows,
                          anc, scale, out=out, **hints)

    # SDPA baseline: dense K/V gathered and GQA-expanded once, outside the timed region.
    pos = torch.arange(s, device=DEV)
    blk = block_table.long()[:, pos // bs]  # [B, S]
    kd = kv[0][blk, pos % bs].permute(0, 2, 1, 3).repeat_interleave(hq // hkv, dim=1).contiguous()
    vd = kv[1][blk, pos % bs].permute(0, 2, 1, 3).repeat_interleave(hq // hkv, dim=1).contiguous()
    qd = query.view(b, q_len, hq, d).transpose(1, 2).contiguous()
    mask = torch.stack([K.visibility_mask(rows[:q_len].long(), s, ctx, anc[i]) for i in range(b)])[:, None]

    def sdpa():
        F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)

    # The graph result must also match SDPA here (large shapes the checks above do not cover).
    graph()
    ref = F.scaled_dot_product_attention(qd.float(), kd.float(), vd.float(), attn_mask=mask, scale=scale)
    err = (out.view(b, q_len, hq, d).transpose(1, 2).float() - ref).abs().max().item()
    if not err <= TOL[dtype]:
        FAILURES.append(f"bench B={b} N={n} ctx={ctx}: graph vs SDPA max err {err:.3g}")
        log(f"FAIL  bench config B={b} N={n} ctx={ctx}: graph vs SDPA max err {err:.3g}")
    tg, tc, ts = bench_ms(graph), bench_ms(causal), bench_ms(sdpa)
    return tg, tc, ts


def run_bench() -> list[str]:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    batches, nodes, ctxs = ints(ARGS.batches), ints(ARGS.nodes), ints(ARGS.contexts)
    kw = {}
    if ARGS.cpu_smoke:
        batches, nodes, ctxs = [1, 2], [4], [40]
        kw = dict(hq=4, hkv=2, d=32)
    lines = [
        "| batch | N | context | graph (ms) | causal (ms) | graph/causal | SDPA+mask (ms) | graph/SDPA |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in batches:
        for n in nodes:
            for ctx in ctxs:
                if time.monotonic() - START > ARGS.budget_s - 15:
                    lines.append(f"| {b} | {n} | {ctx} | skipped: time budget | | | | |")
                    continue
                try:
                    tg, tc, ts = bench_config(b, n, ctx, **kw)
                    lines.append(f"| {b} | {n} | {ctx} | {tg:.4f} | {tc:.4f} | {tg / tc:.2f} | {ts:.4f} | {tg / ts:.2f} |")
                except Exception as e:  # noqa: BLE001
                    FAILURES.append(f"bench B={b} N={n} ctx={ctx}")
                    lines.append(f"| {b} | {n} | {ctx} | error: {type(e).__name__}: {str(e)[:80]} | | | | |")
                    traceback.print_exc()
                print(lines[-1], flush=True)
                if DEV.type == "cuda":
                    torch.cuda.empty_cache()
    return lines


def report_paths() -> tuple[Path, Path] | None:
    """(markdown, json) paths from --out: a .md file and its .json twin, or a folder's
    gpu_check.md / gpu_check.json; None without --out."""
    if ARGS.out is None:
        return None
    if ARGS.out.suffix == ".md":
        return ARGS.out, ARGS.out.with_suffix(".json")
    return ARGS.out / "gpu_check.md", ARGS.out / "gpu_check.json"


def write_report(probe, table: list[str], final: bool = False) -> None:
    """(Re)write the markdown and JSON reports with everything so far."""
    paths = report_paths()
    if paths is None:
        return
    md, js = paths
    md.parent.mkdir(parents=True, exist_ok=True)
    summary = probe.summary() if probe is not None else []
    md.write_text("\n".join(LOG + table + ["", "## Summary", ""] + summary
                            + ["", f"failures: {len(FAILURES)}"] + [f"- {f}" for f in FAILURES]) + "\n")
    data = dict(
        device=DEVICE_NAME, torch=torch.__version__, triton=TRITON_VERSION, smoke=ARGS.cpu_smoke,
        elapsed_s=round(time.monotonic() - START, 1), finished=final, budget_s=ARGS.budget_s,
        probe=probe.results if probe is not None else {},
        checks=[line for line in LOG if line.startswith(("PASS", "FAIL", "SKIP"))],
        bench=table, failures=FAILURES)
    js.write_text(json.dumps(data, indent=1, default=str) + "\n")


DEVICE_NAME = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (Triton interpreter)"
TRITON_VERSION = ""


def main() -> int:
    global TRITON_VERSION
    import triton  # noqa: PLC0415

    TRITON_VERSION = triton.__version__
    log(f"# vllm-gsd kernels GPU check\n\ndevice: {DEVICE_NAME}; torch {torch.__version__}; "
        f"triton {triton.__version__}; budget {ARGS.budget_s:.0f} s\n")
    probe = None
    if not ARGS.no_probe:
        sections = [x for x in ARGS.probe.split(",") if x]
        probe = P.Probe(DEV, ARGS.cpu_smoke, log, FAILURES, START + ARGS.budget_s)
        probe.run(sections, on_section_done=lambda: write_report(probe, []))
    if not ARGS.no_check:
        log("\n## Correctness\n")
        if time.monotonic() - START > ARGS.budget_s - 60:
            log("SKIP  correctness checks: under 60 s of the time budget left")
        else:
            check_attention()
            check_ancestors()
            check_compaction()
            check_walk()
        write_report(probe, [])
    table = []
    if not ARGS.no_bench:
        log("\n## Graph attention timing\n")
        log("bf16, head dim 128, 32 q heads / 8 kv heads, block size 16; causal = same kernel with "
            "the tree mask off (every row causal) over the same tokens; SDPA = torch SDPA with an "
            "explicit bool mask on dense pre-gathered, pre-expanded K/V (gather not timed).\n")
        table = run_bench()
    write_report(probe, table, final=True)
    if report_paths():
        print(f"report written to {', '.join(map(str, report_paths()))}")
    print(f"\nelapsed {time.monotonic() - START:.1f} s")
    if probe is not None:
        print("\n".join(probe.summary()))
    if FAILURES:
        print(f"\n{len(FAILURES)} FAILED: " + "; ".join(FAILURES), file=sys.stderr)
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
