"""Compile GSD's Triton kernels during vLLM's warm-up, not while serving (issue 39).

vLLM's profile, warm-up and capture runs carry no trees (their attention plan is None), so
without this the graph-attention and compaction kernels would first launch, and compile, on the
first tree steps: up to 8 forward + 6 reduce binaries of graph attention per attention shape and
one compaction binary, on every rank, at 0.5-2 s each, inside served steps (and inside the
adaptive budget's first timings).

A *launch bucket* (kernels/launch_buckets.py) is what Triton compiles one binary for. For this
engine's shapes the buckets serving can reach are a pure function of the launchers'
``_launch_constants`` and a few bounds, all known at warm-up:

* graph attention (``kernels/graph_attention.py``), per distinct attention shape of the target's
  and the draft's layers (head counts, head size, cache block size, dtype, cache strides): the
  forward kernel's ``BLOCK_Q`` follows the longest query of the rows it attends, at most
  ``N + 1`` rows (a verified tree: root + N nodes; a decode beside it at most
  1 + num_speculative_tokens = N + 1; a draft level has at most N frontier rows), and ``SPLIT_K``
  and the reduce kernel's ``SPLITS_PAD`` follow the split heuristic, which depends on those
  rows' tokens, the longest sequence (``<= max_model_len``) and the GPU's SM count. The
  split count is largest for one token, and every smaller count is reached by a
  shorter sequence, so the heuristic over (one token, query hint ``q``, sequence hint ``S``) for
  ``q`` in the powers of two up to ``N + 1`` and ``S`` up to ``max_model_len`` reaches every
  bucket a served batch can (`attention_launches`);
* KV compaction (``kernels/kv_compaction.py``): one bucket per target cache shape (its
  constexprs are the model's and the cache's), launched on every target cache as served.

Each bucket is launched once, through the entry points serving uses (the CUDA backend's
``attend_tree`` on a real layer and its real cache; ``compact_kv`` on the live target caches),
on a one-token tree in vLLM's null block (block 0, never given to a request): attention only
reads it and writes a scratch output; the compaction "moves" row 1 onto itself, so it writes
nothing. The query-length and sequence-length hints pick the bucket (the kernel takes hints
above the real lengths: spare tiles, empty splits).

The tree walk and ancestor-mask Triton kernels (``triton_walk_tree``,
``triton_ancestor_words_from_parents``) are not launched while serving: the engine uses their
torch twins in vllm_gsd.graph. They are not warmed up; the registry would show any serving launch
of them as a new bucket.

On the CPU (vLLM's CPU backend runs the torch references) nothing is launched:
`plan_runner` lists the buckets the CUDA path would need, for a given SM count. Under the
Triton interpreter (tests) the warm-up runs on CPU tensors and compiles nothing: its time is
interpreter time, not compile time.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from vllm_gsd.kernels import launch_buckets

# vLLM's null block: the block pool's first block, never allocated to a request.
NULL_BLOCK = 0
# The layout sampling_hooks._compact_target_kv passes compact_kv for TRITON_ATTN's caches.
COMPACTION_LAYOUT = "gpu_bhnc"
# H100 / H200 SM count: the default for planning the CUDA path where no GPU is present.
DEFAULT_NUM_SMS = 132


@dataclass(frozen=True)
class AttentionShape:
    """What the graph-attention buckets of a layer depend on besides the batch."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    page: int  # the cache block size
    dtype: torch.dtype


def attention_launches(shape: AttentionShape, max_rows: int, max_seq_len: int, *, num_sms: int,
                       interpret: bool) -> list[dict]:
    """Launch hints ``{"max_query_len", "max_seq_len", "fwd", "reduce"}`` of a one-token tree
    that together reach every (forward, reduce) bucket serving can (see module docstring):
    ``max_rows`` = longest tree query (N + 1), ``max_seq_len`` = max_model_len."""
    GA = importlib.import_module("vllm_gsd.kernels.graph_attention")  # the package's name is the function

    def constants(q: int, s: int) -> dict:
        return GA._launch_constants(
            num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_size=shape.head_size,
            page=shape.page, dtype=shape.dtype, num_tokens=1, num_reqs=1, max_query_len=q,
            max_seq_len=s, num_sms=num_sms, interpret=interpret)

    max_rows, max_seq_len = max(1, max_rows), max(1, max_seq_len)
    queries = sorted({1, max_rows} | {1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows})
    block_n = constants(1, 1)["fwd"]["BLOCK_N"]
    # The heuristic sees the sequence only as KV tiles of BLOCK_N: (kv tiles // 4) or kv tiles.
    seqs = sorted({1, max_seq_len} | {m * block_n for m in range(1, 4 * GA.MAX_SPLITS + 1)
                                      if m * block_n <= max_seq_len})
    launches, fwd_seen, reduce_seen = [], set(), set()
    for q in queries:
        for s in seqs:
            lc = constants(q, s)
            fwd = tuple(lc["fwd"].values())
            red = None if lc["reduce"] is None else tuple(lc["reduce"].values())
            if fwd in fwd_seen and (red is None or red in reduce_seen):
                continue
            fwd_seen.add(fwd)
            if red is not None:
                reduce_seen.add(red)
            launches.append({"max_query_len": q, "max_seq_len": s, "fwd": lc["fwd"], "reduce": lc["reduce"]})
    return launches


def warm_up_attention(impl, kv_cache: torch.Tensor, launches: list[dict], block: int = NULL_BLOCK) -> None:
    """Launch `impl.attend_tree` (GsdTritonAttentionImpl) once per hint set, on a one-token tree
    reading slot 0 of `block` of this layer's `kv_cache`, planned by the backend's own
    `prepare_graph_attention` as a whole-batch plan; the output is scratch."""
    from vllm_gsd.kernels.graph_attention import prepare_graph_attention
    from vllm_gsd.vllm_v0_32.attention.triton_backend import TritonTreePlan

    dev = kv_cache.device

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=dev)

    query = torch.zeros((1, impl.num_heads, impl.head_size), dtype=kv_cache.dtype, device=dev)
    output = torch.empty_like(query)
    metadata = SimpleNamespace(num_actual_tokens=1)
    tree = dict(num_tokens=1, block_table=i32([[block]]), query_start_loc=i32([0, 1]), seq_lens=i32([1]),
                tree_base=i32([0]), query_tree_row=i32([0]), ancestor_words=i32([[[1]]]), layout="gpu")
    for hints in launches:
        launch = prepare_graph_attention(**tree, max_seq_len=hints["max_seq_len"], max_query_len=hints["max_query_len"])
        plan = TritonTreePlan(launch=launch, rest=None, kind="warm-up")
        impl.attend_tree(query, kv_cache, metadata, plan, output)


def warm_up_compaction(kv_caches: list[torch.Tensor], max_rows: int, layout: str = COMPACTION_LAYOUT,
                       block: int = NULL_BLOCK) -> None:
    """`compact_kv` on every cache as served (accepted rows N + 1 wide), moving tree row 1 of a
    tree at position 0 of `block` onto itself: every launch runs, nothing is written."""
    from vllm_gsd.kernels.kv_compaction import compact_kv
    from vllm_gsd.kernels.paged_layout import split_kv_cache

    if not kv_caches or max_rows < 2:
        return
    dev = kv_caches[0].device
    block_size = split_kv_cache(kv_caches[0], layout)[0].shape[1]
    rows = torch.full((1, max_rows), -1, dtype=torch.int64, device=dev)
    rows[0, :2] = torch.tensor([0, 1])
    compact_kv(kv_caches, torch.full((1, 1), block, dtype=torch.int32, device=dev), block_size,
               torch.zeros(1, dtype=torch.int32, device=dev), rows,
               torch.ones(1, dtype=torch.int64, device=dev), layout=layout)


def compaction_buckets(kv_caches: list[torch.Tensor], layout: str = COMPACTION_LAYOUT) -> set[tuple]:
    KC = importlib.import_module("vllm_gsd.kernels.kv_compaction")
    from vllm_gsd.kernels.paged_layout import split_kv_cache

    found = set()
    for cache in kv_caches:
        k, _ = split_kv_cache(cache, layout)
        _, page, hkv, d = k.shape
        found.add((*KC._launch_constants(hkv, d, page).values(), k.dtype))
    return found


# ---------------------------------------------------------------------------- the runner


def _graph_attention_layers(runner) -> dict:
    """{(AttentionShape, cache strides, impl class): (impl, kv_cache)}: one layer per distinct
    attention shape among the target's and the draft's decoder layers with a cache bound."""
    from vllm.v1.attention.backend import AttentionType

    from vllm_gsd.vllm_v0_32.attention.graph_backend import GraphAttentionImpl

    found = {}
    for layer in runner.compilation_config.static_forward_context.values():
        impl, kv_cache = getattr(layer, "impl", None), getattr(layer, "kv_cache", None)
        if (not isinstance(impl, GraphAttentionImpl) or impl.attn_type != AttentionType.DECODER
                or not isinstance(kv_cache, torch.Tensor) or kv_cache.numel() == 0):
            continue
        # [nb, Hkv, bs, 2 D] as both backends receive it (paged_layout.py): bs = dim 2.
        shape = AttentionShape(impl.num_heads, impl.num_kv_heads, impl.head_size, kv_cache.shape[2], kv_cache.dtype)
        found.setdefault((shape, kv_cache.stride(), type(impl)), (impl, kv_cache))
    return found


def _bounds(runner) -> tuple[int, int]:
    """(longest tree query N + 1, max_model_len)."""
    return runner.speculative_config.num_speculative_tokens + 1, runner.max_model_len


def plan_runner(runner, num_sms: int | None = None) -> dict:
    """The buckets the CUDA path needs for this runner's shapes, by kernel (no launch). On a CPU
    runner: what a GPU with `num_sms` SMs (default H100's) would compile."""
    from vllm_gsd.kernels.graph_attention import _num_sms

    max_rows, max_seq_len = _bounds(runner)
    fwd, red = set(), set()
    for (shape, _, _), (_, kv_cache) in _graph_attention_layers(runner).items():
        sms = num_sms or (_num_sms(kv_cache.device) if kv_cache.device.type == "cuda" else DEFAULT_NUM_SMS)
        for hints in attention_launches(shape, max_rows, max_seq_len, num_sms=sms, interpret=False):
            fwd.add((*hints["fwd"].values(), shape.dtype))
            if hints["reduce"] is not None:
                red.add((*hints["reduce"].values(), shape.dtype))
    compaction = compaction_buckets(runner.gsd.target_kv_caches)
    return {"graph_attention_fwd": len(fwd), "graph_attention_reduce": len(red), "compact_kv": len(compaction)}


def warm_up_runner(runner, force: bool = False) -> dict | None:
    """Launch every bucket serving can use, once, for this runner's live caches (see module
    docstring); again only when the caches were rebound. Returns what it did, or None when there
    is nothing to do: no cache bound yet, already warm for these caches, a CUDA stream capturing,
    or no layer on GSD's TRITON_ATTN backend (vLLM's CPU backend serves with torch code)."""
    from vllm_gsd.kernels._triton_compat import HAS_TRITON, interpreting
    from vllm_gsd.kernels.graph_attention import _num_sms
    from vllm_gsd.vllm_v0_32.attention.triton_backend import GsdTritonAttentionImpl

    caches = runner.gsd.target_kv_caches
    if not caches or not HAS_TRITON:
        return None
    bound = tuple(c.data_ptr() for c in caches)
    if not force and getattr(runner, "_gsd_kernels_warm_for", None) == bound:
        return None
    dev = caches[0].device
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    layers = {key: value for key, value in _graph_attention_layers(runner).items()
              if issubclass(key[2], GsdTritonAttentionImpl)}
    if not layers:
        runner._gsd_kernels_warm_for = bound  # vLLM's CPU backend: nothing to launch, now or later
        return None
    max_rows, max_seq_len = _bounds(runner)
    started = time.perf_counter()
    launches = 0
    with launch_buckets.warming_up(), torch.inference_mode():
        for (shape, _, _), (impl, kv_cache) in layers.items():
            hints = attention_launches(shape, max_rows, max_seq_len, num_sms=_num_sms(kv_cache.device),
                                       interpret=interpreting())
            warm_up_attention(impl, kv_cache, hints)
            launches += len(hints)
        warm_up_compaction(caches, max_rows)
        launches += 1  # one compact_kv call (one launch per kind of cache layer)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    runner._gsd_kernels_warm_for = bound
    result = {"seconds": time.perf_counter() - started, "launches": launches,
              "buckets": {k: len(v) for k, v in launch_buckets.buckets(launch_buckets.WARMUP).items()},
              "compiled": compiled_binaries()}
    runner._gsd_kernel_warmup = result
    _log(result)
    return result


def compiled_binaries() -> dict | None:
    """kernel -> binaries Triton holds for it on every device (CUDA); None under the interpreter,
    which compiles nothing. A count that grows while serving is a compile while serving."""
    GA = importlib.import_module("vllm_gsd.kernels.graph_attention")  # the package's name is the function
    KC = importlib.import_module("vllm_gsd.kernels.kv_compaction")

    kernels = {"graph_attention_fwd": GA._graph_attn_fwd_kernel, "graph_attention_reduce": GA._graph_attn_reduce_kernel,
               "compact_kv": KC._compact_kv_kernel}
    counts = {}
    for name, kernel in kernels.items():
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            return None
        counts[name] = sum(len(entry[0]) for entry in list(caches.values()))
    return counts


def _log(result: dict) -> None:
    from vllm.logger import init_logger

    init_logger(__name__).info(
        "gsd: warmed up %d Triton launch buckets (%s) in %.2f s", sum(result["buckets"].values()),
        ", ".join(f"{k} {v}" for k, v in sorted(result["buckets"].items())), result["seconds"])


def kernel_report(runner) -> dict:
    """What the worker probe returns: the launch registry's summary (kernels/launch_buckets.py),
    the warm-up's own figures (None if it did not run), the buckets planned for the CUDA path,
    and Triton's compiled binaries per kernel (None off CUDA)."""
    return {"registry": launch_buckets.report(), "warmup": getattr(runner, "_gsd_kernel_warmup", None),
            "planned": plan_runner(runner), "compiled": compiled_binaries()}
