"""Deployment probe of the vllm-gsd kernels: the sections of `python -m scripts.gpu_check` that
measure what a served model meets, beyond the unit-style correctness checks.

Run through scripts/gpu_check.py (which parses the options, loads ``vllm_gsd.kernels`` without
vLLM and owns the report); docs/gpu-check.md says what each section measures and why. Sections,
each a method of ``Probe`` that appends result rows and never raises (a failure is a FAIL row):

* ``buckets``  every launch-constant specialization (bucket) of every kernel for the deployment
  models, compiled once: compile seconds, registers, spills, shared memory, warps, stages;
* ``deploy``   deployment shapes in bf16 on KV caches strided as vLLM's TRITON_ATTN receives
  them, with NaN in every cache slot and query row no request owns: no NaN out, padded rows
  untouched, ``||out - ref|| / ||ref||`` against the torch reference;
* ``offsets``  one ~4.5 GB layer cache whose used blocks all sit past 2**31 elements: attention
  and KV compaction against the references on the gathered blocks (int32 offset overflow);
* ``host``     host microseconds (launch loop, no sync) against device microseconds (CUDA events)
  for 80 back-to-back layer calls of graph attention and one 80-layer KV compaction;
* ``walk``     the tree walk on device tensors (torch ``walk_tree`` and the Triton walk): time
  and device-to-host syncs;
* ``gumbel``   ``gumbel_noise`` at 32 and 256 rows of a 128k vocabulary: time and bytes.

Nothing here imports vLLM or numba (the GPU machine may have neither): vLLM's cache layout is
restated below (``VLLM_LAYOUT_ORDERS``, checked against vLLM by
tests/kernels/test_gpu_check_smoke.py) and ``graph_module`` loads ``vllm_gsd.graph`` modules
without the package ``__init__`` (whose builder needs numba).
"""

from __future__ import annotations

import importlib
import math
import statistics
import sys
import time
import types
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from vllm_gsd.kernels._triton_compat import jit, tl  # gpu_check has loaded vllm_gsd.kernels

ROOT = Path(__file__).resolve().parent.parent

# vLLM 0.32 KVCacheLayout (vllm/v1/kv_cache_layout.py): for each physical axis, outermost first,
# the logical axis of [L, B, H, N, C] it holds (layers, blocks, kv heads, tokens in a block,
# content = K | V, 2 * head_size elements). TRITON_ATTN declares no preference, so the default
# preference picks LBNHC ("NHD"); VLLM_KV_CACHE_LAYOUT=LBHNC ("HND") is the other layout it runs.
VLLM_LAYOUT_ORDERS = {"LBNHC": (0, 1, 3, 2, 4), "LBHNC": (0, 1, 2, 3, 4)}

# (label, Hq, Hkv, D) per GPU. 70B (64 q / 8 kv heads) at tp 8 leaves 8 / 1 per GPU.
DEPLOY_MODELS = [("70B tp8", 8, 1, 128), ("70B tp1", 64, 8, 128), ("8B", 32, 8, 128), ("gqa4 d64", 4, 1, 64)]
SMOKE_MODELS = [("tiny gqa4", 4, 1, 32), ("tiny gqa4 hkv2", 8, 2, 32)]
BLOCK_SIZE = 16  # vLLM's default cache block size on CUDA (TRITON_ATTN accepts multiples of 16)
NUM_LAYERS = 80  # Llama-3-70B
VOCAB = 128256  # Llama-3 vocabulary ("128k")
INT31 = 2 ** 31


# ------------------------------------------------------------------------------ imports


def _identity_njit(*args, **kwargs):
    """Stand-in for numba.njit while importing a module whose device path needs no numba: the
    decorated function stays plain Python (its CPU path would run uncompiled, the probe calls
    only device paths)."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda fn: fn


def _numba_importable() -> bool:
    try:
        import numba  # noqa: F401, PLC0415

        return True
    except ImportError:
        return False


def graph_module(name: str) -> types.ModuleType:
    """``vllm_gsd.graph.<name>`` (ancestors, acceptance, gumbel): a plain import where numba is
    installed; otherwise the module alone, under a bare ``vllm_gsd.graph`` package whose
    ``__init__`` is not run (it imports the numba-compiled builder), with a no-op ``numba.njit``
    while the module loads (acceptance decorates its CPU walk; the device walk is torch)."""
    full = f"vllm_gsd.graph.{name}"
    if full in sys.modules:
        return sys.modules[full]
    if _numba_importable():
        return importlib.import_module(full)
    import vllm_gsd  # noqa: F401, PLC0415 - the light parent package

    if "vllm_gsd.graph" not in sys.modules:
        pkg = types.ModuleType("vllm_gsd.graph", "vllm_gsd.graph without its __init__ (no numba here)")
        pkg.__path__ = [str(ROOT / "vllm_gsd" / "graph")]
        pkg.__package__ = "vllm_gsd.graph"
        sys.modules["vllm_gsd.graph"] = pkg
    had, prev = "numba" in sys.modules, sys.modules.get("numba")
    shim = types.ModuleType("numba", "no-op stand-in, see scripts/gpu_probe.py")
    shim.njit = _identity_njit
    sys.modules["numba"] = shim
    try:
        return importlib.import_module(full)
    finally:  # the shim must not outlive this import
        if had:
            sys.modules["numba"] = prev
        else:
            sys.modules.pop("numba", None)


# ------------------------------------------------------------------------------ KV caches


def vllm_layer_caches(num_layers: int, num_blocks: int, num_kv_heads: int, head_size: int, dtype,
                      device, order: str = "LBNHC", fill: float = float("nan")) -> list[torch.Tensor]:
    """One buffer for `num_layers` layers in vLLM's physical `order`, returned as per-layer
    logical views ``[num_blocks, num_kv_heads, BLOCK_SIZE, 2 * head_size]`` (K | V in the last
    axis), the tensor TritonAttentionImpl.forward receives; split_kv_cache(view, "gpu_bhnc") is
    its ``transpose(1, 2).split(head_size, -1)``. Every element starts as `fill` (NaN: any read
    of a slot no request wrote shows up in the output)."""
    logical = (num_layers, num_blocks, num_kv_heads, BLOCK_SIZE, 2 * head_size)
    perm = VLLM_LAYOUT_ORDERS[order]
    raw = torch.full([logical[axis] for axis in perm], fill, dtype=dtype, device=device)
    view = raw.permute(*[perm.index(axis) for axis in range(5)])  # logical axis order
    return list(view.unbind(0))


@dataclass
class Batch:
    """One attention step on vLLM-layout caches (all tensors on the probe's device).

    query [T_pad, Hq, D] (rows past ``num_tokens`` are NaN padding, as vLLM pads to a captured
    size); layers: per-layer logical caches (vllm_layer_caches); block_table int32 [B, W]
    (padding entries point at block 0, a NaN block, as vLLM's null block); query_start_loc
    int32 [B + 1]; seq_lens, tree_base int32 [B]; query_tree_row int32 [T_pad]; ancestor_words
    int32 [B, N + 1, words]; used_blocks int64: the blocks requests own."""

    query: torch.Tensor
    layers: list
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    tree_base: torch.Tensor
    query_tree_row: torch.Tensor
    ancestor_words: torch.Tensor
    scale: float
    num_tokens: int
    max_seq_len: int
    max_query_len: int
    used_blocks: torch.Tensor
    parents: torch.Tensor  # int64 [B, N], -1 padded
    num_nodes: torch.Tensor  # int64 [B]

    def attn_args(self, layer: int = 0):
        key, value = _split(self.layers[layer])
        return (self.query, key, value, self.block_table, self.query_start_loc, self.seq_lens,
                self.tree_base, self.query_tree_row, self.ancestor_words, self.scale)

    def hints(self) -> dict:
        """Host-side maxima, as the engine passes them (no sync inside the launcher)."""
        return dict(max_seq_len=self.max_seq_len, max_query_len=self.max_query_len)


def _split(layer_cache):
    from vllm_gsd.kernels import split_kv_cache  # noqa: PLC0415 - loaded by gpu_check

    return split_kv_cache(layer_cache, "gpu_bhnc")


def build_batch(requests: list[dict], num_heads: int, layers: list, g: torch.Generator,
                pad_tokens: int = 0, first_block: int = 1) -> Batch:
    """Scatter random K/V of `requests` into `layers` and build the step's metadata.

    requests: ``{"kind": "tree", "ctx": c, "parents": [...]}`` (rows 0..n verified after c
    cached tokens) or ``{"kind": "causal", "ctx": c, "q": q}`` (decode or prefill chunk). Blocks
    are drawn at random from ``[first_block, num_blocks)``; block 0 and every slot past a
    request's length stay as the caches were filled (NaN)."""
    from scripts.tools import kernel_testutils as TU  # noqa: PLC0415

    nb, hkv, bs, two_d = layers[0].shape
    d = two_d // 2
    dev = layers[0].device
    trees = [r.get("parents", []) for r in requests]
    n = max([len(t) for t in trees] + [1])
    parents, num_nodes = TU.pad_trees(trees, n)
    q_lens = [len(r["parents"]) + 1 if r["kind"] == "tree" else r["q"] for r in requests]
    seq_lens = [r["ctx"] + q for r, q in zip(requests, q_lens)]
    need = [max(1, -(-s // bs)) for s in seq_lens]
    if first_block + sum(need) > nb:
        raise ValueError(f"cache of {nb} blocks cannot hold {sum(need)} blocks from block {first_block}")
    pool = first_block + torch.randperm(nb - first_block, generator=g)[: sum(need)]
    block_table = torch.zeros((len(requests), max(need) + 1), dtype=torch.int32)  # 0 = NaN block
    used = 0
    for b, k in enumerate(need):
        block_table[b, :k] = pool[used: used + k].to(torch.int32)
        used += k
    # Every cached token of every request, vectorized: (request, position) -> (block, slot).
    req = torch.repeat_interleave(torch.arange(len(requests)), torch.tensor(seq_lens))
    starts = torch.tensor([0] + seq_lens[:-1]).cumsum(0)
    pos = torch.arange(len(req)) - starts[req]
    blk = block_table[req, pos // bs].long().to(dev)
    slot = (pos % bs).to(dev)
    for layer in layers:
        key, value = _split(layer)
        key[blk, slot] = torch.randn((len(req), hkv, d), device=dev).to(layer.dtype)
        value[blk, slot] = torch.randn((len(req), hkv, d), device=dev).to(layer.dtype)
    rows, bases = [], []
    for r, q in zip(requests, q_lens):
        rows += list(range(q)) if r["kind"] == "tree" else [-1] * q
        bases.append(r["ctx"] if r["kind"] == "tree" else 0)
    num_tokens = sum(q_lens)
    query = torch.randn((num_tokens + pad_tokens, num_heads, d), device=dev).to(layers[0].dtype)
    query[num_tokens:] = float("nan")  # padded rows: must neither be read into real rows nor written
    anc = graph_module("ancestors").ancestor_words_from_parents(parents.to(dev), num_nodes.to(dev))
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    return Batch(
        query=query, layers=layers, block_table=block_table.to(dev), query_start_loc=qsl.to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        tree_base=torch.tensor(bases, dtype=torch.int32, device=dev),
        query_tree_row=torch.tensor(rows + [-1] * pad_tokens, dtype=torch.int32, device=dev),
        ancestor_words=anc.to(torch.int32), scale=1.0 / math.sqrt(d), num_tokens=num_tokens,
        max_seq_len=max(seq_lens), max_query_len=max(q_lens), used_blocks=pool.to(dev),
        parents=parents.to(dev), num_nodes=num_nodes.to(dev))


def random_tree(n: int, g: torch.Generator, kind: str = "random") -> list[int]:
    from scripts.tools import kernel_testutils as TU  # noqa: PLC0415

    return TU.random_parents(n, g, kind)


def accepted_paths(batch: Batch, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random root-to-leaf path per tree request: (accepted_rows int64 [B, N + 1] -1 padded,
    num_accepted int64 [B]); causal requests accept nothing."""
    parents = batch.parents.cpu()
    num_nodes = batch.num_nodes.cpu()
    b, n = parents.shape
    rows = torch.full((b, n + 1), -1, dtype=torch.int64)
    acc = torch.zeros(b, dtype=torch.int64)
    for i in range(b):
        children: dict[int, list[int]] = {}
        for c in range(int(num_nodes[i])):
            children.setdefault(int(parents[i, c]), []).append(c + 1)
        path = [0]
        while path[-1] in children:
            kids = children[path[-1]]
            path.append(kids[int(torch.randint(len(kids), (1,), generator=g))])
        rows[i, : len(path)] = torch.tensor(path)
        acc[i] = len(path) - 1
    return rows, acc


def compare(out: torch.Tensor, ref: torch.Tensor, num_tokens: int) -> dict:
    """Real rows: NaN count, ||out - ref|| / ||ref|| and max |out - ref| (fp64); padded rows:
    how many elements were written (they were NaN before)."""
    o, r = out[:num_tokens].double(), ref[:num_tokens].double()
    nan = int(torch.isnan(o).sum())
    diff = torch.nan_to_num(o - r, nan=float("inf"))
    rel = float(diff.norm() / r.norm().clamp(min=1e-30))
    return dict(nan_out=nan, rel_l2=rel, max_abs=float(diff.abs().max()) if o.numel() else 0.0,
                pad_written=int((~torch.isnan(out[num_tokens:])).sum()))


REL_TOL = 1e-2  # bf16 operands: METHOD.md expects 1e-3..1e-2


# ------------------------------------------------------------------------------ timing


class HostReadCounter(TorchFunctionMode):
    """Counts the torch calls that read a device tensor's value on the host (each a
    device-to-host sync on CUDA): bool(t), t.item(), t.tolist(), int(t), .cpu(), .numpy(), ...
    On a CPU run it counts the same calls, the syncs a CUDA run would make."""

    READS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "numpy", "nonzero", "cpu", "to"}

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.calls: Counter = Counter()

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self.READS and args and isinstance(args[0], torch.Tensor) \
                and args[0].device.type == self.device.type:
            to_cpu = name == "cpu" or (name == "to" and any(str(a).startswith("cpu")
                                                            for a in (*args[1:], *kwargs.values())))
            moves_to_host = self.device.type != "cpu" and to_cpu
            if name not in ("cpu", "to") or moves_to_host:
                self.calls[name] += 1
        return func(*args, **kwargs)


def count_syncs(fn, device: torch.device) -> dict:
    """Runs fn once; returns host reads of device tensors (HostReadCounter) and, on CUDA, the
    synchronizing operations torch reports in sync debug mode."""
    counter = HostReadCounter(device)
    cuda_syncs = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with counter:
                fn()
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
    if device.type == "cuda":
        cuda_syncs = sum("synchroniz" in str(w.message) for w in caught)
    return dict(host_reads=sum(counter.calls.values()), host_read_calls=dict(counter.calls), cuda_syncs=cuda_syncs)


class Clock:
    """Host and device time of a callable, in microseconds (medians).

    * host_us: perf_counter around the call from an idle GPU, no sync after it: what the CPU
      spends launching (a callable that syncs also waits for the device here);
    * wall_us: the same start to the end of the device work (call + synchronize): host and
      device in lockstep, what the call costs if nothing overlaps it;
    * device_us: CUDA events around the call's work, enqueued behind a spin kernel long enough
      that every launch is queued before the GPU reaches them: device time alone. If the host
      still launched when the spin ended (starved_reps > 0; always for a callable that syncs)
      the GPU waited for it and device_us includes those gaps.
    On a CPU (interpreter) run all three are the same host time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.cycles_per_us = None
        if self.cuda:  # calibrate torch.cuda._sleep: cycles per microsecond
            torch.cuda._sleep(1000)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            torch.cuda._sleep(10_000_000)
            e1.record()
            torch.cuda.synchronize()
            self.cycles_per_us = 10_000_000 / max(1.0, e0.elapsed_time(e1) * 1e3)

    def measure(self, fn, reps: int) -> dict:
        fn()  # warm: compile, allocator
        host, wall, dev = [], [], []
        for _ in range(reps):
            self._sync()
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e6)
            self._sync()
            wall.append((time.perf_counter() - t0) * 1e6)
        if not self.cuda:
            return dict(host_us=statistics.median(host), device_us=statistics.median(wall),
                        wall_us=statistics.median(wall), starved=None)
        spin_us = 3 * max(host) + 200  # the queue must outlast the launch loop
        starved = 0
        for _ in range(reps):
            torch.cuda.synchronize()
            torch.cuda._sleep(int(spin_us * self.cycles_per_us))
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t0 = time.perf_counter()
            fn()
            launched = (time.perf_counter() - t0) * 1e6
            e1.record()
            torch.cuda.synchronize()
            dev.append(e0.elapsed_time(e1) * 1e3)
            starved += launched > spin_us
        return dict(host_us=statistics.median(host), device_us=statistics.median(dev),
                    wall_us=statistics.median(wall), starved=starved)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def graph_us(self, fn, reps: int):
        """Device microseconds of fn captured in one CUDA graph and replayed (no launch gaps),
        or None off CUDA / when capture fails (the reason is returned instead)."""
        if not self.cuda:
            return None
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graph.replay()
            samples = []
            for _ in range(reps):
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                graph.replay()
                e1.record()
                torch.cuda.synchronize()
                samples.append(e0.elapsed_time(e1) * 1e3)
            del graph
            return statistics.median(samples)
        except Exception as e:  # noqa: BLE001 - reported, the section goes on
            torch.cuda.synchronize()
            return f"capture failed: {type(e).__name__}: {str(e)[:120]}"


def jit_cache(kernel) -> dict:
    """Compiled binaries a Triton JITFunction holds, key -> CompiledKernel (empty under the
    interpreter, which compiles nothing)."""
    out = {}
    for entry in getattr(kernel, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(cache, dict):
            out.update(cache)
    return out


def binary_stats(compiled) -> dict:
    """Resources of one CompiledKernel: registers and spills (from the loaded binary), shared
    memory bytes, warps and stages (from its metadata)."""
    try:
        compiled._init_handles()  # loads the binary: n_regs / n_spills are read at load
    except Exception as e:  # noqa: BLE001 - an out-of-resources binary is itself a result
        return dict(load_error=f"{type(e).__name__}: {str(e)[:120]}")
    meta = compiled.metadata
    return dict(regs=getattr(compiled, "n_regs", None), spills=getattr(compiled, "n_spills", None),
                shared=getattr(meta, "shared", None), num_warps=getattr(meta, "num_warps", None),
                num_stages=getattr(meta, "num_stages", None))


@jit
def _touch_kernel(x, n: tl.constexpr):
    """x[:n] += 1: the throwaway launch of Probe._warm_triton."""
    i = tl.arange(0, n)
    tl.store(x + i, tl.load(x + i) + 1)


# ------------------------------------------------------------------------------ the probe


class Probe:
    """The probe sections on `device` (CPU = Triton interpreter, tiny sizes when `smoke`).

    `log` prints and records a line; every FAIL is appended to `failures`; `results` maps a
    section to ``{"rows": [...], "notes": [...]}`` (the JSON report); a section stops adding
    work once ``time.monotonic()`` passes `deadline` and says so in a note."""

    def __init__(self, device: torch.device, smoke: bool, log, failures: list, deadline: float):
        self.dev = device
        self.smoke = smoke
        self.log = log
        self.failures = failures
        self.deadline = deadline
        self.results: dict[str, dict] = {}
        self.clock = Clock(device)
        self.models = SMOKE_MODELS if smoke else DEPLOY_MODELS
        self.K = importlib.import_module("vllm_gsd.kernels")

    # -- bookkeeping

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def _section(self, name: str) -> dict:
        return self.results.setdefault(name, {"rows": [], "notes": []})

    def note(self, section: str, text: str) -> None:
        self._section(section)["notes"].append(text)
        self.log(f"  note: {text}")

    def row(self, section: str, **row) -> None:
        self._section(section)["rows"].append(row)
        if row.get("status") == "FAIL":
            self.failures.append(f"{section}: {row.get('case', '')} {row.get('why', '')}".strip())

    def out_of_time(self, section: str, what: str, reserve_s: float) -> bool:
        if self.time_left() >= reserve_s:
            return False
        self.note(section, f"skipped {what}: under {reserve_s:.0f} s of the time budget left")
        return True

    def guarded(self, section: str, case: str, fn) -> None:
        """Runs fn(); an exception becomes a FAIL row of `case` (the section goes on)."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            import traceback  # noqa: PLC0415

            traceback.print_exc()
            self.row(section, case=case, status="FAIL", why=f"{type(e).__name__}: {str(e)[:300]}")
        finally:
            if self.dev.type == "cuda":
                torch.cuda.empty_cache()

    def run(self, sections: list[str], on_section_done=None) -> None:
        order = {"buckets": self.buckets, "deploy": self.deploy, "offsets": self.offsets,
                 "host": self.host_vs_device, "walk": self.walk, "gumbel": self.gumbel}
        for name in sections:
            self.log(f"\n## probe: {name}\n")
            t0 = time.monotonic()
            self._section(name)
            self.guarded(name, f"section {name}", order[name])
            self.results[name]["seconds"] = round(time.monotonic() - t0, 2)
            self.log(markdown_table(self.results[name]["rows"]))
            if on_section_done is not None:
                on_section_done()

    # -- 3. buckets

    def buckets(self) -> None:
        """Every bucket of every kernel compiled once, through the real launchers on vLLM-layout
        caches (so pointer alignment and stride specializations are the served ones).

        Attention: per model, each BLOCK_Q bucket with and without split-K, then each reduce
        SPLITS_PAD; ancestor words and the walk: each bucket of a node budget N <= 128;
        compaction: one binary per model. Compile seconds = first launch minus a repeat (both
        synced); a bucket compiled earlier in the run shows compiled=False."""
        K = self.K
        GA = importlib.import_module("vllm_gsd.kernels.graph_attention")
        AM = importlib.import_module("vllm_gsd.kernels.ancestor_masks")
        TA = importlib.import_module("vllm_gsd.kernels.tree_acceptance")
        KC = importlib.import_module("vllm_gsd.kernels.kv_compaction")
        interp = self.dev.type != "cuda"
        if interp:
            self.note("buckets", "interpreter run: nothing is compiled; seconds are interpreted launches")
        self._warm_triton()
        g = torch.Generator().manual_seed(3)
        dtype = torch.bfloat16

        def launch(case, kernels, fn, **labels):
            before = {id(k): set(jit_cache(k)) for k in kernels}
            self._sync()
            t0 = time.perf_counter()
            fn()
            self._sync()
            first = time.perf_counter() - t0
            again = 0.0
            if not interp:  # the interpreter compiles nothing: no repeat to subtract
                t0 = time.perf_counter()
                fn()
                self._sync()
                again = time.perf_counter() - t0
            new = [(k, c) for k in kernels for key, c in jit_cache(k).items() if key not in before[id(k)]]
            if not new:
                self.row("buckets", **{"case": case, **labels, "compiled": False if not interp else None,
                                       "first_launch_s": round(first, 3), "status": "ok"})
            for i, (kernel, compiled) in enumerate(new):  # the binary's warps / stages override the labels
                # One launch may compile two binaries (forward + reduce): its seconds go on the first.
                self.row("buckets", **{"case": case, "kernel": getattr(kernel, "__name__", str(kernel)), **labels,
                                       "compiled": True, "compile_s": round(first - again, 3) if i == 0 else None,
                                       **binary_stats(compiled), "status": "ok"})

        # Smoke: one model, short contexts and N <= 32 (each interpreted launch costs ~0.1-1 s).
        models, ctx, max_n = (self.models[:1], 10, 32) if self.smoke else (self.models, 100, 128)
        for label, hq, hkv, d in models:
            if self.out_of_time("buckets", f"attention buckets of {label}", 60):
                break
            group_pad = GA.next_pow2(hq // hkv)
            lo, hi = GA._block_q_bounds(group_pad, max(16, GA.next_pow2(d)))
            block_qs = [lo << i for i in range(int(math.log2(hi // lo)) + 1)]
            layers = vllm_layer_caches(1, 64, hkv, d, dtype, self.dev)
            kernels = [GA._graph_attn_fwd_kernel, GA._graph_attn_reduce_kernel]
            reduce_pads = (4,) if self.smoke else (4, 8, 16, 32, GA.MAX_SPLITS)  # 2 comes with split-K
            plan = [(bq, s) for bq in block_qs for s in (1, 2)] + [(lo, s) for s in reduce_pads]
            for bq, splits in plan:
                batch = build_batch([{"kind": "tree", "ctx": ctx, "parents": random_tree(bq - 1, g)}], hq, layers, g)
                lc = GA._launch_constants(num_heads=hq, num_kv_heads=hkv, head_size=d, page=BLOCK_SIZE, dtype=dtype,
                                          num_tokens=batch.num_tokens, num_reqs=1, num_splits=splits,
                                          num_sms=GA._num_sms(self.dev), interpret=interp, **batch.hints())
                out = torch.empty_like(batch.query)
                fn = (lambda b=batch, s=splits, o=out:
                      K.graph_attention(*b.attn_args(), out=o, num_splits=s, **b.hints()))
                red = lc["reduce"]
                self.guarded("buckets", f"graph_attention {label} BLOCK_Q={bq} splits={splits}", lambda: launch(
                    f"graph_attention {label}", kernels, fn, BLOCK_Q=lc["fwd"]["BLOCK_Q"], BLOCK_M=lc["fwd"]["BLOCK_M"],
                    SPLIT_K=lc["fwd"]["SPLIT_K"], SPLITS_PAD=red["SPLITS_PAD"] if red else None))
            self.guarded("buckets", f"compact_kv {label}", lambda: self._compact_bucket(launch, KC, layers, hq, g))
        if self.out_of_time("buckets", "tree buckets", 20):
            return
        for name, mod, kernel, call in (
                ("ancestor_words", AM, AM._ancestor_words_kernel,
                 lambda p, nn: K.triton_ancestor_words_from_parents(p, nn)),
                ("walk_tree", TA, TA._walk_tree_kernel,
                 lambda p, nn: K.triton_walk_tree(torch.where(p >= 0, 0, -1), p, nn, torch.zeros(
                     (p.shape[0], p.shape[1] + 1), dtype=torch.int64, device=p.device)))):
            reps = {}
            for n in range(0, max_n + 1):  # the largest N of each bucket
                reps[tuple(sorted(mod._launch_constants(n).items()))] = n
            for key, n in reps.items():
                parents, num_nodes = self._trees(4, n, g)
                self.guarded("buckets", f"{name} N={n}", lambda: launch(
                    name, [kernel], lambda p=parents, nn=num_nodes: call(p, nn), N=n, **dict(key)))

    def _compact_bucket(self, launch, KC, layers, hq, g):
        batch = build_batch([{"kind": "tree", "ctx": 20, "parents": random_tree(12, g, "chain")}], hq, layers, g)
        rows, acc = (t.to(self.dev) for t in accepted_paths(batch, g))
        fn = (lambda: self.K.compact_kv(batch.layers, batch.block_table, BLOCK_SIZE, batch.tree_base, rows, acc,
                                        layout="gpu_bhnc"))
        _, hkv, _, two_d = layers[0].shape
        launch("compact_kv", [KC._compact_kv_kernel], fn, **KC._launch_constants(hkv, two_d // 2, BLOCK_SIZE))

    def _warm_triton(self) -> None:
        """One throwaway Triton launch first, so the first bucket's compile time does not carry
        Triton's one-off driver build and CUDA context set-up."""
        x = torch.zeros(16, device=self.dev)
        _touch_kernel[(1,)](x, 16)
        self._sync()

    def _trees(self, b: int, n: int, g) -> tuple[torch.Tensor, torch.Tensor]:
        from scripts.tools import kernel_testutils as TU  # noqa: PLC0415

        kinds = ["random", "chain", "star"]
        parents, num_nodes = TU.pad_trees([random_tree(n, g, kinds[i % 3]) for i in range(b)], n)
        return parents.to(self.dev), num_nodes.to(self.dev)

    def _sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    # -- 1. deployment shapes

    def _requests(self, kind: str, g) -> tuple[list[dict], int]:
        """(requests, padded query rows) of a deployment batch. mixed: verification trees of
        random / chain / star shapes, decode rows and a prefill chunk; long: two trees after
        long contexts (the split-K path)."""
        r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
        n, ctx, chunk, long_ctx = (6, 40, 5, (150, 260)) if self.smoke else (64, 3000, 200, (16000, 30000))
        if kind == "long":
            return [{"kind": "tree", "ctx": c, "parents": random_tree(n, g)} for c in long_ctx], 0
        trees = [{"kind": "tree", "ctx": r(1, ctx), "parents": random_tree(n if i % 3 else r(1, n), g,
                                                                           ["random", "chain", "star"][i % 3])}
                 for i in range(2 if self.smoke else 6)]
        trees.append({"kind": "tree", "ctx": 0, "parents": random_tree(n, g)})  # tree_base 0: no context
        decode = [{"kind": "causal", "ctx": r(1, ctx), "q": 1} for _ in range(1 if self.smoke else 4)]
        prefill = [{"kind": "causal", "ctx": ctx // 6, "q": chunk}]
        return trees + decode + prefill, 3 if self.smoke else 7

    def deploy(self) -> None:
        """Per (model, vLLM layout, batch): graph_attention vs graph_attention_ref on caches whose
        unused blocks, unused slots and padded query rows are NaN. Pass: no NaN in real rows,
        padded rows untouched, rel L2 <= REL_TOL."""
        g = torch.Generator().manual_seed(11)
        GA = importlib.import_module("vllm_gsd.kernels.graph_attention")
        for label, hq, hkv, d in self.models:
            for order in VLLM_LAYOUT_ORDERS:
                for kind in ("mixed", "long"):
                    if self.out_of_time("deploy", f"{label} {order} {kind}", 15):
                        return
                    case = f"{label} Hq={hq} Hkv={hkv} D={d} {order} {kind}"
                    self.guarded("deploy", case, lambda: self._deploy_case(case, kind, hq, hkv, d, order, g, GA))

    def _deploy_case(self, case, kind, hq, hkv, d, order, g, GA):
        requests, pad = self._requests(kind, g)
        blocks = sum(-(-(r["ctx"] + len(r.get("parents", [])) + r.get("q", 1)) // BLOCK_SIZE) for r in requests)
        layers = vllm_layer_caches(1, blocks + 9, hkv, d, torch.bfloat16, self.dev, order)
        batch = build_batch(requests, hq, layers, g, pad_tokens=pad)
        nan = torch.full_like(batch.query, float("nan"))
        out = self.K.graph_attention(*batch.attn_args(), out=nan.clone(), **batch.hints())
        ref = self.K.graph_attention_ref(*batch.attn_args(), out=nan.clone())
        m = compare(out, ref, batch.num_tokens)
        splits = GA._launch_constants(num_heads=hq, num_kv_heads=hkv, head_size=d, page=BLOCK_SIZE,
                                      dtype=torch.bfloat16, num_tokens=batch.query.shape[0],
                                      num_reqs=len(requests), num_sms=GA._num_sms(self.dev),
                                      interpret=self.dev.type != "cuda", **batch.hints())["num_splits"]
        ok = m["nan_out"] == 0 and m["pad_written"] == 0 and m["rel_l2"] <= REL_TOL
        key_stride = tuple(_split(layers[0])[0].stride())
        self.row("deploy", case=case, tokens=batch.num_tokens, pad_rows=pad, num_splits=splits,
                 key_strides=str(key_stride), **{k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in m.items()},
                 status="ok" if ok else "FAIL",
                 why="" if ok else f"nan={m['nan_out']} pad_written={m['pad_written']} rel={m['rel_l2']:.3g}")

    # -- 2. offsets past 2**31 elements

    def offsets(self) -> None:
        """One layer cache (vLLM LBNHC, 8B model's 8 kv heads x 128) of ~4.5 GB whose used blocks
        all start past 2**31 elements: attention and compaction on it vs the references on a copy
        of just the used blocks. Skipped, with the size it needs, when the GPU lacks the memory."""
        hq, hkv, d = (32, 8, 128) if not self.smoke else (4, 1, 32)
        threshold = INT31 if not self.smoke else 2 ** 14  # smoke: same code, a small threshold
        per_block = BLOCK_SIZE * hkv * 2 * d  # elements
        first = threshold // per_block + 1  # block `first` starts past the threshold
        g = torch.Generator().manual_seed(5)
        requests = [{"kind": "tree", "ctx": c, "parents": random_tree(n, g)}
                    for c, n in ((2000, 64), (777, 64), (0, 32))] if not self.smoke else \
                   [{"kind": "tree", "ctx": c, "parents": random_tree(6, g)} for c in (30, 9)]
        requests.append({"kind": "causal", "ctx": 1500 if not self.smoke else 20, "q": 1})
        need_blocks = sum(-(-(r["ctx"] + len(r.get("parents", [])) + r.get("q", 1)) // BLOCK_SIZE) for r in requests)
        num_blocks = first + need_blocks + 4
        elems = num_blocks * per_block
        need_bytes = elems * 2 + 512 * 2 ** 20  # bf16 cache + copies and workspace
        if self.dev.type == "cuda":
            free = torch.cuda.mem_get_info()[0]
            if free < need_bytes:
                self.row("offsets", case="cache past 2^31 elements", status="skipped",
                         why=f"needs {need_bytes / 1e9:.1f} GB free on the GPU, {free / 1e9:.1f} GB free")
                self.log(f"SKIP  offsets: needs {need_bytes / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
                return
        layers = vllm_layer_caches(1, num_blocks, hkv, d, torch.bfloat16, self.dev)
        batch = build_batch(requests, hq, layers, g, pad_tokens=2, first_block=first)
        big = layers[0]
        lowest = int(batch.used_blocks.min()) * per_block
        common = dict(cache_gb=round(big.numel() * 2 / 1e9, 2), elements=big.numel(),
                      lowest_used_offset=lowest, past_threshold=lowest >= threshold)
        # The same blocks gathered into a small cache ([n, Hkv, bs, 2D], a different stride
        # order), block table renumbered: what the reference reads.
        used = torch.unique(batch.block_table.long().flatten())  # includes block 0 (padding)
        small = big.index_select(0, used)
        remap = torch.full((num_blocks,), -1, dtype=torch.int64, device=self.dev)
        remap[used] = torch.arange(len(used), device=self.dev)
        small_bt = remap[batch.block_table.long()].to(torch.int32)

        def attention():
            nan = torch.full_like(batch.query, float("nan"))
            out = self.K.graph_attention(*batch.attn_args(), out=nan.clone(), **batch.hints())
            key, value = _split(small)
            ref = self.K.graph_attention_ref(batch.query, key, value, small_bt, *batch.attn_args()[4:], out=nan.clone())
            m = compare(out, ref, batch.num_tokens)
            ok = m["nan_out"] == 0 and m["pad_written"] == 0 and m["rel_l2"] <= REL_TOL and common["past_threshold"]
            self.row("offsets", case="graph_attention", **common, rel_l2=f"{m['rel_l2']:.2e}", nan_out=m["nan_out"],
                     pad_written=m["pad_written"], status="ok" if ok else "FAIL",
                     why="" if ok else f"rel={m['rel_l2']:.3g} nan={m['nan_out']}")

        def compaction():
            rows, acc = (t.to(self.dev) for t in accepted_paths(batch, g))
            self.K.compact_kv([big], batch.block_table, BLOCK_SIZE, batch.tree_base, rows, acc, layout="gpu_bhnc")
            self.K.compact_kv_ref([small], small_bt, BLOCK_SIZE, batch.tree_base, rows, acc, layout="gpu_bhnc")
            same = torch.equal(big.index_select(0, used).view(torch.int16), small.view(torch.int16))  # NaN-safe
            self.row("offsets", case="compact_kv", **common, moved=int(acc.sum()), status="ok" if same else "FAIL",
                     why="" if same else "compacted blocks differ from the reference")

        self.guarded("offsets", "graph_attention", attention)
        self.guarded("offsets", "compact_kv", compaction)

    # -- 4. host vs device

    def host_vs_device(self) -> None:
        """80 back-to-back graph_attention calls (one per layer, each its own cache: no layer
        hits another's KV in L2) and one 80-layer compact_kv, for the 70B-at-tp-8 shape."""
        label, hq, hkv, d = self.models[0]
        layers_n = NUM_LAYERS if not self.smoke else 2
        reps = 20 if not self.smoke else 1
        configs = [(1, 64, 4096), (16, 64, 2048), (64, 16, 2048), (64, 0, 2048)] if not self.smoke \
            else [(2, 6, 40), (2, 0, 40)]
        g = torch.Generator().manual_seed(21)
        self.note("host", f"{label}: Hq={hq} Hkv={hkv} D={d} bf16, {layers_n} layers, vLLM LBNHC caches; "
                          "N=0 rows are plain decode (one causal row per request)")
        for b, n, ctx in configs:
            if self.out_of_time("host", f"B={b} N={n}", 30):
                return
            self.guarded("host", f"B={b} N={n} ctx={ctx}",
                         lambda: self._host_case(hq, hkv, d, layers_n, reps, b, n, ctx, g))

    def _host_case(self, hq, hkv, d, layers_n, reps, b, n, ctx, g):
        requests = [{"kind": "tree", "ctx": ctx, "parents": random_tree(n, g)} if n else
                    {"kind": "causal", "ctx": ctx, "q": 1} for _ in range(b)]
        blocks = b * (-(-(ctx + n + 1) // BLOCK_SIZE)) + 2
        layers = vllm_layer_caches(layers_n, blocks, hkv, d, torch.bfloat16, self.dev)
        batch = build_batch(requests, hq, layers, g)
        out = torch.empty_like(batch.query)
        views = [_split(layer) for layer in layers]
        args = batch.attn_args()
        hints = batch.hints()

        def step():
            for key, value in views:
                self.K.graph_attention(args[0], key, value, *args[3:], out=out, **hints)

        t = self.clock.measure(step, reps)
        graph = self.clock.graph_us(step, reps)
        case = f"graph_attention B={b} N={n} ctx={ctx}"
        self.row("host", case=case, layers=layers_n, **_us_row(t, layers_n, graph), status="ok")
        if n:
            rows, acc = (x.to(self.dev) for x in accepted_paths(batch, g))
            compact = (lambda: self.K.compact_kv(layers, batch.block_table, BLOCK_SIZE, batch.tree_base, rows, acc,
                                                 layout="gpu_bhnc"))
            t = self.clock.measure(compact, reps)
            self.row("host", case=f"compact_kv B={b} N={n} (accepted {int(acc.sum())})", layers=layers_n,
                     **_us_row(t, layers_n, self.clock.graph_us(compact, reps)), status="ok")

    # -- 5. tree walk syncs

    def walk(self) -> None:
        """walk_tree (torch, the engine's device path) and triton_walk_tree on device tensors:
        same results, time, and device-to-host syncs per call. Tokens come from a 2-token
        vocabulary so paths run deep (neither should sync: the torch walk takes a fixed number of
        gathers, no early-exit read)."""
        acceptance = graph_module("acceptance")
        # walk_tree takes its torch path on device tensors; CPU tensors would take the numba
        # loop, so the smoke run calls the device path itself (its host reads = a GPU's syncs).
        walk_torch = acceptance.walk_tree if self.dev.type == "cuda" else acceptance._walk_tree_torch
        g = torch.Generator().manual_seed(9)
        for b, n in ((16, 64), (256, 64)) if not self.smoke else ((4, 8),):
            if self.out_of_time("walk", f"B={b} N={n}", 10):
                return
            parents, num_nodes = self._trees(b, n, g)
            draft = torch.randint(0, 2, (b, n), generator=g).to(self.dev)
            draft = torch.where(parents >= 0, draft, -1)
            target = torch.randint(0, 2, (b, n + 1), generator=g).to(self.dev)
            inputs = (draft, parents, num_nodes, target)

            def case(name, fn):
                def run():
                    syncs = count_syncs(fn, self.dev)
                    t = self.clock.measure(fn, 20 if not self.smoke else 1)
                    self.row("walk", case=f"{name} B={b} N={n}", host_us=round(t["host_us"], 1),
                             device_us=round(t["device_us"], 1), wall_us=round(t["wall_us"], 1),
                             starved_reps=t["starved"], host_reads=syncs["host_reads"],
                             cuda_syncs=syncs["cuda_syncs"], reads=str(syncs["host_read_calls"]), status="ok")
                self.guarded("walk", f"{name} B={b} N={n}", run)

            def agree():
                e = walk_torch(*inputs)
                rows, toks, acc = self.K.triton_walk_tree(*inputs)
                same = (torch.equal(rows, e.accepted_rows) and torch.equal(toks, e.output_token_ids)
                        and torch.equal(acc, e.num_accepted.long()))
                self.row("walk", case=f"triton == torch B={b} N={n}", max_accepted=int(acc.max()),
                         status="ok" if same else "FAIL", why="" if same else "walks differ")

            self.guarded("walk", f"agree B={b} N={n}", agree)
            case("walk_tree (torch)", lambda: walk_torch(*inputs))
            case("triton_walk_tree", lambda: self.K.triton_walk_tree(*inputs))

    # -- 6. Gumbel noise

    def gumbel(self) -> None:
        """gumbel_noise (float64 [R, V], one generator seeding and one uniform_ launch per row)
        at 32 and 256 rows of a 128k vocabulary: host / device / wall time, peak bytes allocated,
        the bytes its passes move (counted: uniform write, four in-place passes plus the clamp,
        each a read and a write, and the final row gather's read and write: 13 x R x V x 8) and
        the bandwidth that implies; plus gumbel_argmax on bf16 scores."""
        import numpy as np  # noqa: PLC0415

        gm = graph_module("gumbel")
        vocab = VOCAB if not self.smoke else 1000
        for rows in (32, 256) if not self.smoke else (2, 4):
            if self.out_of_time("gumbel", f"{rows} rows", 10):
                return
            keys = np.arange(rows, dtype=np.int64) + 1234
            positions = np.arange(rows, dtype=np.int64) + 4000

            def noise(keys=keys, positions=positions):
                return gm.gumbel_noise(keys, positions, vocab, device=self.dev)

            def run(rows=rows, noise=noise):
                out_bytes = rows * vocab * 8
                peak = None
                if self.dev.type == "cuda":
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    noise()
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated() - base
                t = self.clock.measure(noise, 5 if not self.smoke else 1)
                syncs = count_syncs(noise, self.dev)
                moved = 13 * out_bytes
                self.row("gumbel", case=f"gumbel_noise R={rows} V={vocab}", host_us=round(t["host_us"], 1),
                         device_us=round(t["device_us"], 1), wall_us=round(t["wall_us"], 1),
                         out_MB=round(out_bytes / 1e6, 1), peak_alloc_MB=None if peak is None else round(peak / 1e6, 1),
                         moved_MB=round(moved / 1e6, 1), GBps=round(moved / (t["device_us"] * 1e3), 1),
                         starved_reps=t["starved"], host_reads=syncs["host_reads"], cuda_syncs=syncs["cuda_syncs"],
                         status="ok")
                scores = torch.randn((rows, vocab), device=self.dev).to(torch.bfloat16)
                z = noise()
                t = self.clock.measure(lambda: gm.gumbel_argmax(scores, z), 5 if not self.smoke else 1)
                self.row("gumbel", case=f"gumbel_argmax R={rows} V={vocab}", host_us=round(t["host_us"], 1),
                         device_us=round(t["device_us"], 1), wall_us=round(t["wall_us"], 1), status="ok")

            self.guarded("gumbel", f"{rows} rows", run)

    # -- summary

    def summary(self) -> list[str]:
        """One line per section: the headline numbers (printed last by gpu_check)."""
        lines = ["| probe section | result |", "|---|---|"]
        for name, sec in self.results.items():
            rows = sec["rows"]
            fails = sum(r.get("status") == "FAIL" for r in rows)
            bits = [f"{len(rows)} rows, {fails} FAIL", f"{sec.get('seconds', '?')} s"]
            if name == "buckets":
                comp = [r for r in rows if r.get("compiled")]
                if comp:
                    bits.append(f"{len(comp)} binaries, {sum(r.get('compile_s') or 0 for r in comp):.1f} s compile, "
                                f"max regs {max((r.get('regs') or 0) for r in comp)}, "
                                f"spills {sum((r.get('spills') or 0) for r in comp)}")
            if name in ("deploy", "offsets"):
                rels = [float(r["rel_l2"]) for r in rows if "rel_l2" in r]
                if rels:
                    bits.append(f"worst rel {max(rels):.2e}")
                bits += [r["why"] for r in rows if r.get("status") == "skipped"]
            if name == "host":
                bits += [f"{r['case']}: host {r['host_us_per_layer']} / device {r['device_us_per_layer']} us per layer"
                         for r in rows if "host_us_per_layer" in r][:3]
            if name == "walk":
                bits += [f"{r['case']}: {r['cuda_syncs'] if r['cuda_syncs'] is not None else r['host_reads']} syncs, "
                         f"{r['wall_us']} us" for r in rows if "host_reads" in r]
            if name == "gumbel":
                bits += [f"{r['case']}: {r['wall_us'] / 1e3:.2f} ms" for r in rows if "wall_us" in r]
            bits += [n for n in sec["notes"] if n.startswith("skipped")]
            lines.append(f"| {name} | {'; '.join(map(str, bits))} |")
        return lines


def _us_row(t: dict, layers: int, graph) -> dict:
    """Columns of one host-vs-device row: totals and per layer."""
    row = dict(host_us=round(t["host_us"], 1), device_us=round(t["device_us"], 1), wall_us=round(t["wall_us"], 1),
               host_us_per_layer=round(t["host_us"] / layers, 2), device_us_per_layer=round(t["device_us"] / layers, 2),
               host_bound=t["host_us"] > t["device_us"], starved_reps=t["starved"])
    row["graph_replay_us"] = round(graph, 1) if isinstance(graph, float) else graph
    return row


def markdown_table(rows: list[dict]) -> str:
    """Rows (dicts) as one markdown table; columns in first-seen order, blanks where a row lacks one."""
    if not rows:
        return "(no rows)"
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    fmt = lambda v: "" if v is None else str(v).replace("|", "/")  # noqa: E731
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                     + ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows])
