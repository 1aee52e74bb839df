"""Kernels compiled during warm-up, not while serving (issue 39; vllm_v0_32/kernel_warmup.py).

The CUDA path on CPU tensors, its Triton kernels in the interpreter (as tests/engine/
test_gpu_path.py drives it): a runner whose target and draft layers are GSD's TRITON_ATTN impls
with caches in that backend's layout is warmed up by the `_dummy_run` wrapper, then serves tree
steps of every shape (1..N nodes, 1..6 requests, short contexts and long ones that split the KV,
verification trees mixed with other rows, draft levels of frontier rows, compaction of accepted
paths) through the same entry points as serving: vLLM's TRITON_ATTN metadata builder with GSD's
plan, the impl's forward, compact_kv. The launch registry (kernels/launch_buckets.py) must show
no bucket while serving that the warm-up did not launch. Interpreter time is not compile time.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_gsd.kernels import launch_buckets

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")

BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN, NODE_BUDGET = 16, 48, 256, 12
TARGET = dict(num_heads=4, num_kv_heads=2, head_size=32)  # GROUP 2: BLOCK_Q 8 or 16 for <= 13 rows
DRAFT = dict(num_heads=2, num_kv_heads=2, head_size=16)  # another attention shape (GROUP 1)
DTYPE = torch.float32


@pytest.fixture(scope="module")
def vllm_config(tiny_target_path):
    from vllm.config import ModelConfig, VllmConfig

    return VllmConfig(model_config=ModelConfig(model=str(tiny_target_path), dtype="float32",
                                               max_model_len=MAX_MODEL_LEN))


@pytest.fixture(autouse=True)
def fresh_registry():
    launch_buckets.reset()
    yield
    launch_buckets.reset()


def make_impl(vllm_config, shape):
    from vllm.config import set_current_vllm_config

    from vllm_gsd.vllm_v0_32.attention.triton_backend import GsdTritonAttentionImpl

    with set_current_vllm_config(vllm_config):
        return GsdTritonAttentionImpl(num_heads=shape["num_heads"], head_size=shape["head_size"],
                                      scale=shape["head_size"] ** -0.5, num_kv_heads=shape["num_kv_heads"],
                                      alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")


def make_builder(vllm_config, shape):
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_gsd.engine.tree_batch import TreeSlot
    from vllm_gsd.vllm_v0_32.attention.triton_backend import GsdTritonAttentionMetadataBuilder

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=shape["num_kv_heads"],
                             head_size=shape["head_size"], dtype=DTYPE)
    with set_current_vllm_config(vllm_config):
        made = GsdTritonAttentionMetadataBuilder(spec, ["layer.0"], vllm_config, torch.device("cpu"))
    made.tree_slot = TreeSlot()
    return made


def triton_cache(shape, seed):
    """A layer's cache as TRITON_ATTN receives it: [blocks, Hkv, block, 2 * D]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((NUM_BLOCKS, shape["num_kv_heads"], BLOCK_SIZE, 2 * shape["head_size"]), generator=gen)


@pytest.fixture
def runner(vllm_config):
    """A gsd runner as kernel_warmup and the `_dummy_run` wrapper see it: two target layers of
    one shape, one draft layer of another, caches bound."""
    from vllm_gsd.vllm_v0_32.runner.state import GsdRunnerState

    layers = {f"model.layers.{i}.attn": SimpleNamespace(impl=make_impl(vllm_config, TARGET),
                                                       kv_cache=triton_cache(TARGET, i)) for i in range(2)}
    layers["draft_model.layers.0.attn"] = SimpleNamespace(impl=make_impl(vllm_config, DRAFT),
                                                          kv_cache=triton_cache(DRAFT, 9))
    return SimpleNamespace(
        speculative_config=SimpleNamespace(method="gsd", num_speculative_tokens=NODE_BUDGET),
        max_model_len=MAX_MODEL_LEN, layers=layers,
        compilation_config=SimpleNamespace(static_forward_context=layers),
        gsd=GsdRunnerState(target_kv_caches=[layers[f"model.layers.{i}.attn"].kv_cache for i in range(2)]),
        drafter=SimpleNamespace(dummy_run=lambda num_tokens, **kwargs: None))


def dummy_run(runner, num_tokens=8):
    """vLLM's `_dummy_run` as the gsd wrapper installs it (vLLM's own body stubbed)."""
    from vllm_gsd.vllm_v0_32.runner.setup_hooks import wrap_dummy_run

    return wrap_dummy_run(lambda self, n, *args, **kwargs: "vllm's dummy run")(runner, num_tokens)


# ------------------------------------------------------------------------------- serving steps


def random_tree(rng, n):
    return np.array([rng.integers(0, row) for row in range(1, n + 1)], dtype=np.int64)


def serving_batch(rng, kinds, long_context: bool):
    """Requests ("tree", n nodes) / ("decode", 1) / ("prefill", q) / ("level", rows): what the
    runner hands the backend. A "level" request is a draft level: `rows` frontier rows, all
    tree rows (rows 1..rows of a graph whose ancestors sit before them)."""
    from vllm_gsd.graph import ancestor_words_from_parents

    q_lens, ctx, parents, first_row = [], [], [], []
    room = MAX_MODEL_LEN - NODE_BUDGET - 2
    for kind, size in kinds:
        q_lens.append(size + 1 if kind == "tree" else size)
        ctx.append(int(rng.integers(room // 2, room)) if long_context else int(rng.integers(0, 40)))
        if kind == "tree":
            parents.append(random_tree(rng, size))
            first_row.append(0)
        elif kind == "level":  # frontier rows `size`.. of a graph of 2 * size nodes
            parents.append(random_tree(rng, 2 * size))
            first_row.append(size)
        else:
            parents.append(None)
            first_row.append(None)
    seq_lens = np.array(ctx) + np.array(q_lens) + np.array([f or 0 for f in first_row])
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    blocks = -(-seq_lens // BLOCK_SIZE)
    # Blocks 1.. at random (block 0 is vLLM's null block, the warm-up's); requests may share
    # blocks: only the buckets matter here.
    table = torch.from_numpy(rng.integers(1, NUM_BLOCKS, (len(kinds), int(blocks.max()))).astype(np.int32))
    trees = [b for b, p in enumerate(parents) if p is not None]
    qtr = np.full(int(qsl[-1]), -1, dtype=np.int32)
    width = max((len(parents[b]) for b in trees), default=1)
    padded = torch.full((len(trees), width), -1, dtype=torch.int64)
    for k, b in enumerate(trees):
        rows = np.arange(q_lens[b]) + first_row[b]
        qtr[qsl[b]: qsl[b + 1]] = rows
        padded[k, : len(parents[b])] = torch.from_numpy(parents[b])
    words = ancestor_words_from_parents(padded, torch.tensor([len(parents[b]) for b in trees]))
    return SimpleNamespace(qsl=qsl, seq_lens=seq_lens, ctx=np.array(ctx), table=table, trees=np.array(trees),
                           qtr=qtr, words=words, num_tokens=int(qsl[-1]), q_lens=np.array(q_lens))


def serve_attention(builder, impl, kv_cache, batch):
    """One forward of one layer as served: vLLM's TRITON_ATTN metadata + GSD's plan, impl.forward."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_gsd.engine.tree_batch import TreeAttention

    qsl = torch.from_numpy(batch.qsl.astype(np.int32))
    seq_lens = torch.from_numpy(batch.seq_lens.astype(np.int32))
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(batch.q_lens, batch.seq_lens)])
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens, num_reqs=len(batch.seq_lens),
        num_actual_tokens=batch.num_tokens, max_query_len=int(batch.q_lens.max()),
        max_seq_len=int(batch.seq_lens.max()), block_table_tensor=batch.table,
        slot_mapping=torch.zeros(batch.num_tokens, dtype=torch.int64), causal=True, positions=positions,
        seq_lens_cpu_upper_bound=seq_lens)
    index = batch.trees
    starts = batch.qsl[index]
    tree = TreeAttention.build(index, starts, batch.qsl[index + 1] - starts, batch.ctx[index], batch.words, batch.qtr,
                               torch.device("cpu"))
    with builder.tree_slot.holding(tree):
        metadata = builder.build(0, common)
    assert metadata.tree is not None
    query = torch.randn(batch.num_tokens, impl.num_heads, impl.head_size)
    output = torch.zeros(batch.num_tokens, impl.num_heads, impl.head_size)
    impl.forward(None, query, None, None, kv_cache, metadata, output)
    return output


@pytest.fixture
def vllm_kernel_stand_in(monkeypatch):
    """vLLM's own Triton kernel cannot run on CPU; rows without a tree get zeros."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    monkeypatch.setattr(TritonAttentionImpl, "forward", lambda self, layer, query, key, value, kv_cache,
                        attn_metadata, output, *args: output.zero_())


def serving_steps(rng, num_steps):
    """(kinds, long_context) of varied tree steps: node counts 1..N, 1..6 requests, draft levels,
    other rows (decodes, prefill chunks) beside the trees."""
    steps = [([("tree", NODE_BUDGET)], True), ([("tree", 1)], False), ([("level", NODE_BUDGET)], True),
             ([("tree", n) for n in range(1, 7)], True)]
    while len(steps) < num_steps:
        kinds = []
        for _ in range(int(rng.integers(1, 5))):
            kind = rng.choice(["tree", "tree", "level", "decode", "prefill"])
            size = {"tree": int(rng.integers(1, NODE_BUDGET + 1)), "level": int(rng.integers(1, NODE_BUDGET + 1)),
                    "decode": 1, "prefill": int(rng.integers(1, 24))}[kind]
            kinds.append((kind, size))
        if not any(k in ("tree", "level") for k, _ in kinds):
            kinds.append(("tree", int(rng.integers(1, NODE_BUDGET + 1))))
        steps.append((kinds, bool(rng.integers(0, 2))))
    return steps


def serve(runner, vllm_config, num_steps, seed=0):
    """Tree steps through every target and draft layer shape, and the target's compaction."""
    from vllm_gsd.kernels.kv_compaction import compact_kv

    rng = np.random.default_rng(seed)
    builders = {name: make_builder(vllm_config, TARGET if name.startswith("model") else DRAFT)
                for name in runner.layers}
    for kinds, long_context in serving_steps(rng, num_steps):
        batch = serving_batch(rng, kinds, long_context)
        for name, layer in runner.layers.items():
            if name == "model.layers.1.attn":
                continue  # layer 0's shape and plan: the same buckets, twice the interpreter time
            out = serve_attention(builders[name], layer.impl, layer.kv_cache, batch)
            assert torch.isfinite(out).all()
        # Compaction of the verified trees' accepted paths, as sampling_hooks calls it.
        num_reqs = len(batch.seq_lens)
        rows = torch.full((num_reqs, NODE_BUDGET + 1), -1, dtype=torch.int64)
        rows[:, 0] = 0
        accepted = torch.zeros(num_reqs, dtype=torch.int64)
        for b, (kind, size) in enumerate(kinds):
            if kind == "tree":
                a = int(rng.integers(0, size + 1))
                rows[b, 1: a + 1] = torch.from_numpy(np.sort(rng.choice(np.arange(1, size + 1), a, replace=False)))
                accepted[b] = a
        if int(accepted.max()):
            tree_base = torch.from_numpy(batch.ctx.astype(np.int32))
            compact_kv(runner.gsd.target_kv_caches, batch.table, BLOCK_SIZE, tree_base, rows, accepted,
                       layout="gpu_bhnc")


# ----------------------------------------------------------------------------------------- tests


def test_serving_after_warm_up_launches_no_new_bucket(runner, vllm_config, vllm_kernel_stand_in):
    caches_before = [layer.kv_cache.clone() for layer in runner.layers.values()]
    started = time.perf_counter()
    assert dummy_run(runner) == "vllm's dummy run"
    warm_s = time.perf_counter() - started
    warm = runner._gsd_kernel_warmup
    assert warm is not None and launch_buckets.new_while_serving() == {}
    for before, layer in zip(caches_before, runner.layers.values()):
        assert torch.equal(before, layer.kv_cache), "the warm-up wrote a cache"
    warmed = launch_buckets.buckets(launch_buckets.WARMUP)
    # What it launched is what the planner says the shapes need (here: the interpreter's buckets).
    assert set(warmed) == {"graph_attention_fwd", "graph_attention_reduce", "compact_kv"}
    assert len(warmed["compact_kv"]) == 1
    dummy_run(runner)  # later dummy runs: nothing more
    assert runner._gsd_kernel_warmup is warm

    started = time.perf_counter()
    serve(runner, vllm_config, num_steps=10)
    serve_s = time.perf_counter() - started
    served = launch_buckets.buckets(launch_buckets.SERVING)
    assert set(served) == {"graph_attention_fwd", "graph_attention_reduce", "compact_kv"}
    assert launch_buckets.new_while_serving() == {}, launch_buckets.report()
    # The steps reached both sides of every constexpr the batch moves: BLOCK_Q 8 and 16 (target),
    # split and unsplit KV, and more than one reduce width.
    fwd = [launch_buckets.as_dict("graph_attention_fwd", v) for v in served["graph_attention_fwd"]]
    assert {f["BLOCK_Q"] for f in fwd if f["NUM_HQ"] == TARGET["num_heads"]} == {8, 16}
    assert {f["SPLIT_K"] for f in fwd} == {False, True}
    assert len(served["graph_attention_reduce"]) >= 2
    from vllm_gsd.testing.worker_probes import WorkerProbes

    report = WorkerProbes.gsd_test_kernel_buckets(SimpleNamespace(model_runner=runner))
    assert report["warmup"] is warm and report["compiled"] is None  # the interpreter compiles nothing
    assert all(not entry["new_while_serving"] for entry in report["registry"].values())
    print(f"\nwarm-up (interpreter, not compile time): {warm_s:.2f} s, {warm['launches']} launches, "
          f"buckets {warm['buckets']}; 10 serving steps: {serve_s:.2f} s; registry {report['registry']}")


def test_without_warm_up_serving_compiles(runner, vllm_config, vllm_kernel_stand_in):
    """The registry sees what the warm-up prevents: every serving bucket is new."""
    serve(runner, vllm_config, num_steps=3, seed=1)
    new = launch_buckets.new_while_serving()
    assert set(new) == {"graph_attention_fwd", "graph_attention_reduce", "compact_kv"}
    assert new == launch_buckets.buckets(launch_buckets.SERVING)


def test_warm_up_waits_for_caches_and_reruns_when_they_are_rebound(runner):
    caches = runner.gsd.target_kv_caches
    runner.gsd.target_kv_caches = []  # vLLM's profile run: no cache bound yet
    dummy_run(runner)
    assert not hasattr(runner, "_gsd_kernel_warmup") and launch_buckets.buckets() == {}
    runner.gsd.target_kv_caches = caches
    dummy_run(runner)
    first = runner._gsd_kernel_warmup
    dummy_run(runner)
    assert runner._gsd_kernel_warmup is first
    runner.gsd.target_kv_caches = [c.clone() for c in caches]  # the caches rebuilt after profiling
    dummy_run(runner)
    assert runner._gsd_kernel_warmup is not first


def test_cpu_backend_runner_launches_nothing_and_plans_the_cuda_path(runner, monkeypatch):
    """vLLM's CPU backend serves with torch code: no Triton launch; the plan lists what the CUDA
    path would compile for these shapes (H100 SM count)."""
    from vllm_gsd.vllm_v0_32 import kernel_warmup
    from vllm_gsd.vllm_v0_32.attention.graph_backend import GraphAttentionImpl

    triton_layers = kernel_warmup._graph_attention_layers(runner)
    cpu_layers = {(shape, strides, GraphAttentionImpl): layer for (shape, strides, _), layer in triton_layers.items()}
    monkeypatch.setattr(kernel_warmup, "_graph_attention_layers", lambda r: cpu_layers)
    assert kernel_warmup.warm_up_runner(runner) is None and launch_buckets.buckets() == {}
    runner.max_model_len = 512  # on CUDA (BLOCK_N 64) the split count is at most 512 / 64 / 4 = 2
    plan = kernel_warmup.plan_runner(runner)
    # Target (GROUP 2, <= 13 rows): BLOCK_Q 8, 16; draft (GROUP 1): 16; each split and not.
    assert plan == {"graph_attention_fwd": 6, "graph_attention_reduce": 2, "compact_kv": 1}


# Common deployments: (name, Hq, Hkv, D, block, dtype); the bound per shape is 8 forward + 6 reduce.
DEPLOYMENTS = [
    ("Llama-3-8B", 32, 8, 128, 16, torch.bfloat16),
    ("Llama-3-70B tp8", 8, 1, 128, 16, torch.bfloat16),
    ("Llama-3.2-1B draft", 32, 8, 64, 16, torch.bfloat16),
    ("Qwen2-7B", 28, 4, 128, 16, torch.bfloat16),
    ("Qwen2-0.5B draft", 14, 2, 64, 16, torch.bfloat16),
]


@pytest.mark.parametrize("node_budget", [8, 64, 128])
@pytest.mark.parametrize("max_model_len", [2048, 131072])
def test_cuda_plan_covers_the_heuristic_over_random_batches(node_budget, max_model_len):
    """The planned hints reach every bucket `_launch_constants` gives any served tree sub-batch
    (random batches, H100 SM count), and stay within the bound of test_kernel_specializations."""
    import importlib
    import random

    GA = importlib.import_module("vllm_gsd.kernels.graph_attention")
    from vllm_gsd.vllm_v0_32.kernel_warmup import AttentionShape, attention_launches

    rng = random.Random(node_budget + max_model_len)
    for _, hq, hkv, d, bs, dtype in DEPLOYMENTS:
        shape = AttentionShape(hq, hkv, d, bs, dtype)
        plan = attention_launches(shape, node_budget + 1, max_model_len, num_sms=132, interpret=False)
        fwd = {tuple(p["fwd"].values()) for p in plan}
        red = {tuple(p["reduce"].values()) for p in plan if p["reduce"] is not None}
        assert len(fwd) <= 8 and len(red) <= 6
        for _ in range(400):
            b = rng.choice([1, 2, rng.randint(1, 64), rng.randint(1, 256)])
            q_lens = [rng.randint(1, node_budget + 1) for _ in range(b)]
            lc = GA._launch_constants(num_heads=hq, num_kv_heads=hkv, head_size=d, page=bs, dtype=dtype,
                                      num_tokens=sum(q_lens), num_reqs=b, max_query_len=max(q_lens),
                                      max_seq_len=rng.choice([rng.randint(1, max_model_len), max_model_len]),
                                      num_sms=132)
            assert tuple(lc["fwd"].values()) in fwd
            assert lc["reduce"] is None or tuple(lc["reduce"].values()) in red
