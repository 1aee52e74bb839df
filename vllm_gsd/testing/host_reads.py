"""Host reads per step: a CPU proxy for the device-to-host stalls a step would have on a GPU.

On a GPU every read of a device tensor by the host (`item`, `tolist`, `cpu()` / `to("cpu")`,
`numpy`, `bool()` / `int()` / `float()` of it, a copy into a host tensor) waits for the stream
to get there, and so does a pageable host-to-device copy (`torch.tensor(list, device=cuda)`, a
blocking `.to(cuda)` of a host tensor); `torch.cuda.synchronize` waits for everything. On the
CPU these cost nothing, so `HostReadCounter` counts the calls that would stall, by where they are
made (file:line), per worker step.

What counts as a device tensor (provenance, tracked by a `TorchFunctionMode`):

* the sources: what the target's forward and LM head return (the runner's `_model_forward`,
  its model's `compute_logits`), what the draft model and the gsd draft head return, vLLM's
  device-side buffers (every `CpuGpuBuffer.gpu` of the runner and of its block tables, the
  runner's and its drafter's other tensors but those named *cpu* or *pinned*, the input
  batch's device tensors: on the CPU vLLM makes them the host tensors themselves, so the
  counter gives each a view of its own, same storage, that it can tell apart), what vLLM's
  `async_tensor_h2d` returns (the CPU runner's keeps host tensors; on a GPU a non-blocking copy
  from pinned memory), what our `HostStaging.stage` returns (the same, engine/staging.py),
  and tensors made with a device argument that names the accelerator (below);
* anything a torch function computes from a device tensor (views, indexing, arithmetic,
  samplers), except that an in-place op or a copy leaves its destination what it was.

What is counted (one per call), in three kinds:

* reads (device to host): `item`, `tolist`, `numpy`, `__array__`, `__bool__`, `__int__`,
  `__float__`, `__index__`, `equal`, `allclose`, `cpu()`, `to("cpu")` of a device tensor,
  `copy_` of one into a host tensor, a host tensor indexed by or assigned from a device tensor;
* h2d (pageable host to device): `torch.tensor` / `torch.as_tensor` of host data with an
  accelerator device argument, a `to(device)` / `cuda()` / `copy_` of a host tensor into a
  device one without non_blocking (vLLM's non-blocking copies are from pinned memory on a GPU),
  a device tensor indexed by (or assigned) a host tensor of more than one element;
* stalls: our `synchronize` helper (engine/cost_calibration.py) where it would wait (any
  device: the counter asks it), `torch.cuda.synchronize`, `torch.accelerator.synchronize`.

Approximations (the figures are a proxy, not a profile):

* "the accelerator" is told from the device argument's spelling: a `torch.device` object or an
  int or a string other than "cpu" means the device (code passes the runner's or a tensor's
  `.device`), the string "cpu" means the host. Code that builds host tensors with
  `device=some_host_tensor.device` is counted as making device tensors.
* The forwards (target, draft, LM heads) are opaque: nothing inside them is counted (on the
  CPU they run other kernels and backends than on a GPU), their outputs are device tensors.
  So is code that runs on the CPU only where a GPU runs a kernel (`CPU_ONLY_FILES`, the CPU
  tree-attention plan; `CPU_ONLY_FUNCTIONS`, the CPU KV compaction's moves).
* Where our code picks a branch by device, the GPU's is counted where it can run on the CPU:
  the tree walk (graph/acceptance.py) runs its torch branch, not the compiled CPU loop, and
  the sampled walk (engine/scorer.py) runs every level masked.
* Ops whose output shape depends on device data (boolean-mask indexing, `nonzero`, `unique`)
  also wait on a GPU; they are not counted.
* Only Python-level torch calls are seen: a custom op or a numba kernel that reads a tensor's
  memory itself is not counted (ours take host arrays, read before the call, which is counted).
* CUDA events (`Event.synchronize`, `query`) are not counted: vLLM's GPU path syncs on events
  where the CPU path calls `tolist` directly, so vLLM's own reads count the same either way.
* A non-blocking device-to-host copy counts as a read: the host waits for it before using it.

Install it in a test engine with `worker_extension_cls=HOST_READ_PROBES`, then
`llm.collective_rpc("gsd_test_count_host_reads")`; after a generate call,
`llm.collective_rpc("gsd_test_host_reads")` returns each worker's `StepReads` (as dicts) since
the last such call. `StepReads` keeps device-to-host reads, pageable host-to-device copies and
full stalls apart; `total` is all three.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
from dataclasses import asdict, dataclass, field, fields, is_dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

HOST_READ_PROBES = "vllm_gsd.testing.host_reads.HostReadProbes"

_T = torch.Tensor
_SCALAR_READS = frozenset((_T.item, _T.tolist, _T.numpy, _T.__array__, _T.__bool__, _T.__int__, _T.__float__,
                           _T.__index__, _T.equal, _T.allclose, torch.equal, torch.allclose))
_NEW_FROM_DATA = frozenset((torch.tensor, torch.as_tensor))
_SKIPPED_DIRS = (os.path.dirname(torch.__file__), os.path.abspath(__file__))


@dataclass
class StepReads:
    """One worker step (from execute_model to the next one): its reads by site."""

    num_reqs: int = 0
    decode: bool = True  # every request decoded (no prompt tokens)
    verified: bool = False  # it verified drafts (trees or chains)
    drafted: bool = False  # gsd: the drafter drafted this step
    levels: int = 0  # gsd: draft forwards (catch-up included)
    reads: dict[str, int] = field(default_factory=dict)  # site -> device-to-host reads
    h2d: dict[str, int] = field(default_factory=dict)  # site -> pageable (blocking) host-to-device copies
    stalls: dict[str, int] = field(default_factory=dict)  # site -> full synchronisations

    @property
    def num_reads(self) -> int:
        return sum(self.reads.values())

    @property
    def num_h2d(self) -> int:
        return sum(self.h2d.values())

    @property
    def num_stalls(self) -> int:
        return sum(self.stalls.values())

    @property
    def total(self) -> int:
        """Every call that would make the host wait for the stream."""
        return self.num_reads + self.num_h2d + self.num_stalls


def is_device_like(device) -> bool:
    """Whether a device argument names the accelerator (see the module docstring)."""
    if isinstance(device, str):
        return device.split(":")[0] != "cpu"
    return isinstance(device, (torch.device, int))


# Code that runs on the CPU only, where a GPU runs a kernel instead: its reads are not counted.
# Files anywhere on the stack; (file, function) as the reading frame.
CPU_ONLY_FILES = ("vllm_gsd/engine/cpu_attention.py", "vllm_gsd/vllm_v0_32/attention/cpu_backend.py")
CPU_ONLY_FUNCTIONS = (("kernels/kv_compaction.py", "compact_kv_cpu"),)


def _site() -> str | None:
    """file:line of the innermost caller outside torch and this module; None inside CPU-only code."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED_DIRS):
        frame = frame.f_back
    if frame is None:
        return "?"
    if any(frame.f_code.co_filename.endswith(f) and frame.f_code.co_name == fn for f, fn in CPU_ONLY_FUNCTIONS):
        return None
    outer = frame
    while outer is not None:
        if outer.f_code.co_filename.endswith(CPU_ONLY_FILES):
            return None
        outer = outer.f_back
    name = frame.f_code.co_filename
    for marker in ("site-packages/", "/work/main/"):
        if marker in name:
            name = name.split(marker, 1)[1]
            break
    return f"{name}:{frame.f_lineno}"


def _tensors(value, depth: int = 0):
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item, depth + 1)
    elif depth < 3 and is_dataclass(value) and not isinstance(value, type):
        for f in fields(value):
            yield from _tensors(getattr(value, f.name, None), depth + 1)


class HostReadCounter(TorchFunctionMode):
    """The mode that tracks device tensors and counts host reads (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._device = WeakIdKeyDictionary()
        self.step: StepReads | None = None

    # ------------------------------------------------------------------ provenance

    def is_device(self, value) -> bool:
        return isinstance(value, torch.Tensor) and value in self._device

    def mark(self, value):
        """Mark every tensor in `value` (tensor, sequence, dict, dataclass) a device tensor."""
        for t in _tensors(value):
            self._device[t] = True
        return value

    def count(self, kind: str = "reads") -> None:
        if self.step is not None:
            site = _site()
            if site is not None:
                counts = getattr(self.step, kind)
                counts[site] = counts.get(site, 0) + 1

    # ------------------------------------------------------------------ the mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SCALAR_READS:
            if any(self.is_device(a) for a in args[:2]):
                self.count()
            return func(*args, **kwargs)
        if func is _T.cpu or func is _T.to or func is _T.cuda:
            return self._move(func, args, kwargs)
        if func is _T.copy_:
            dst, src = args[0], args[1]
            if self.is_device(src) and not self.is_device(dst):
                self.count()
            elif self.is_device(dst) and not self.is_device(src) and not _non_blocking(args[2:], kwargs):
                self.count("h2d")
            return func(*args, **kwargs)
        if func is _T.__setitem__ or func is _T.__getitem__:
            target, index = args[0], args[1]
            value = args[2] if len(args) > 2 else None
            sources = [index, value]
            if not self.is_device(target) and any(self.is_device(t) for t in _tensors(sources)):
                self.count()
            elif self.is_device(target) and any(not self.is_device(t) and t.numel() > 1
                                                for t in _tensors(sources)):
                self.count("h2d")
        elif func in _NEW_FROM_DATA and is_device_like(kwargs.get("device")):
            if not any(self.is_device(t) for t in _tensors(args[:1])):
                self.count("h2d")
            return self.mark(func(*args, **kwargs))
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.endswith("__") or func is _T.__setitem__:
            return result  # in place: the destination stays what it was
        if is_device_like(kwargs.get("device")) or any(self.is_device(t) for t in _tensors((args, kwargs))):
            if not any(r is a for r in _tensors(result) for a in _tensors((args, kwargs))):
                self.mark(result)
        return result

    def _move(self, func, args, kwargs):
        source = args[0]
        if func is _T.cpu:
            to_device = False
        elif func is _T.cuda:
            to_device = True
        else:
            to_device = None
            for a in (*args[1:], kwargs.get("device"), kwargs.get("other")):
                if isinstance(a, torch.Tensor):
                    to_device = self.is_device(a)
                elif isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
                    to_device = is_device_like(a)
                if to_device is not None:
                    break
        result = func(*args, **kwargs)
        if to_device is None:  # a dtype change: stays where it is
            return self.mark(result) if self.is_device(source) and result is not source else result
        if self.is_device(source) != to_device:
            if self.is_device(source):
                self.count()
            elif not _non_blocking(args[1:], kwargs):
                self.count("h2d")
            if result is source:  # on the CPU a move returns the tensor itself: a new alias
                result = source.detach()
            return self.mark(result) if to_device else result
        return result

    # ------------------------------------------------------------------ opaque calls

    @contextlib.contextmanager
    def suspended(self):
        """Run without counting (a forward): the mode leaves the stack if it is on top."""
        top = torch._C._len_torch_function_stack()
        if top and torch._C._get_function_stack_at(top - 1) is self:
            with torch.overrides._pop_mode_temporarily():
                yield
        else:
            yield

    def opaque(self, fn):
        """fn, run suspended, its outputs device tensors."""
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self.suspended():
                return self.mark(fn(*args, **kwargs))

        return wrapper


def _non_blocking(positional, kwargs) -> bool:
    return bool(kwargs.get("non_blocking", False)) or any(a is True for a in positional)


class _OpaqueModel:
    """A model whose calls (and `compute_logits`) are opaque to the counter; the rest is the model."""

    def __init__(self, model, counter: HostReadCounter) -> None:
        self.__dict__["_model"], self.__dict__["_counter"] = model, counter

    def __call__(self, *args, **kwargs):
        return self._counter.opaque(self._model)(*args, **kwargs)

    def __getattr__(self, name):
        value = getattr(self._model, name)
        return self._counter.opaque(value) if name == "compute_logits" else value

    def __setattr__(self, name, value):
        setattr(self._model, name, value)


def _gsd_stats(runner):
    state = getattr(runner, "gsd", None)
    return None if state is None else state.metrics.stats


class _WorkerCounting:
    """A worker's counter and its step records."""

    def __init__(self, worker) -> None:
        self.counter = HostReadCounter()
        self.records: list[StepReads] = []
        self._stats_at_start = (0, 0)
        runner = worker.model_runner
        self.runner = runner
        self._mark_buffers(runner)
        runner._model_forward = self.counter.opaque(runner._model_forward)
        runner.model.compute_logits = self.counter.opaque(runner.model.compute_logits)
        drafter = getattr(runner, "drafter", None)
        if drafter is not None and getattr(drafter, "model", None) is not None:
            drafter.model = _OpaqueModel(drafter.model, self.counter)
            if getattr(drafter, "draft_head", None) is not None:
                drafter.draft_head = _OpaqueModel(drafter.draft_head, self.counter)
        # On the CPU vLLM's async_tensor_h2d keeps host tensors; on a GPU it makes device ones
        # (from pinned memory, non-blocking: no stall).
        from vllm.v1.worker import gpu_model_runner

        h2d = gpu_model_runner.async_tensor_h2d
        gpu_model_runner.async_tensor_h2d = functools.wraps(h2d)(lambda *a, **k: self.counter.mark(h2d(*a, **k)))
        # The tree walks take CPU-only branches on CPU tensors (a compiled loop; a sampled walk
        # that visits only walks still going): count the branches a GPU runs.
        from vllm_gsd.engine import scorer
        from vllm_gsd.graph import acceptance

        scorer.walk_tree = acceptance._walk_tree_torch
        scorer.HOST_DEVICE_TYPES = ()
        # On the CPU a stage's tensors are host arrays; on a GPU they arrive by one pinned,
        # non-blocking copy (engine/staging.py): device tensors, no wait.
        from vllm_gsd.engine import staging

        staging.STAGED_HOOKS.append(self.counter.mark)
        for name in ("execute_model", "sample_tokens", "take_draft_token_ids"):
            setattr(worker, name, self._counted(getattr(worker, name), starts_step=name == "execute_model"))
        self._patch_synchronize()

    def _mark_buffers(self, runner) -> None:
        from vllm.v1.utils import CpuGpuBuffer

        holders = [runner] + list(runner.input_batch.block_table.block_tables)
        if getattr(runner, "drafter", None) is not None:
            holders.append(runner.drafter)
        host = {id(v.cpu) for h in holders for v in vars(h).values() if isinstance(v, CpuGpuBuffer)}
        for holder in holders:
            for name, value in vars(holder).items():
                if isinstance(value, CpuGpuBuffer):
                    if value.gpu is value.cpu:
                        value.gpu = value.cpu.view_as(value.cpu)
                    self.counter.mark(value.gpu)
                elif (isinstance(value, torch.Tensor) and id(value) not in host
                      and "cpu" not in name and "pinned" not in name):
                    self.counter.mark(value)  # the runner's device-only tensors (positions, seq_lens...)
        batch = runner.input_batch
        for name, value in list(vars(batch).items()):
            if name.endswith("_cpu_tensor") and isinstance(getattr(batch, name[:-11], None), torch.Tensor):
                device_tensor = getattr(batch, name[:-11])
                if device_tensor is value:
                    device_tensor = value.view_as(value)
                    setattr(batch, name[:-11], device_tensor)
                self.counter.mark(device_tensor)

    def _patch_synchronize(self) -> None:
        from vllm_gsd.engine import cost_calibration

        cost_calibration.STALL_HOOKS.append(lambda: self.counter.count("stalls"))
        for module in (torch.cuda, getattr(torch, "accelerator", None)):
            if module is not None and hasattr(module, "synchronize"):
                original = module.synchronize

                @functools.wraps(original)
                def synchronize(*args, _original=original, **kwargs):
                    self.counter.count("stalls")
                    return _original(*args, **kwargs)

                module.synchronize = synchronize

    def _counted(self, method, starts_step: bool):
        @functools.wraps(method)
        def counted(*args, **kwargs):
            if starts_step:
                self._start_step(args[0] if args else kwargs.get("scheduler_output"))
            with self.counter:
                try:
                    return method(*args, **kwargs)
                finally:
                    self._note_drafting()

        return counted

    def _start_step(self, scheduler_output) -> None:
        from vllm_gsd.engine.metrics import decodes_only

        stats = _gsd_stats(self.runner)
        self._stats_at_start = (stats.steps_speculated, stats.levels_drafted) if stats is not None else (0, 0)
        spec = scheduler_output.scheduled_spec_decode_tokens
        self.counter.step = StepReads(num_reqs=len(scheduler_output.num_scheduled_tokens),
                                      decode=decodes_only(scheduler_output),
                                      verified=any(spec.values()))
        self.records.append(self.counter.step)

    def _note_drafting(self) -> None:
        stats, step = _gsd_stats(self.runner), self.counter.step
        if stats is not None and step is not None:
            step.drafted = stats.steps_speculated > self._stats_at_start[0]
            step.levels = stats.levels_drafted - self._stats_at_start[1]

    def take(self) -> list[dict]:
        records, self.records = self.records, []
        if self.counter.step is not None and records and records[-1] is self.counter.step:
            self.records.append(records.pop())  # the step still running
        return [asdict(r) for r in records if r.num_reqs]


class HostReadProbes:
    """Worker-extension methods (self is the worker): see the module docstring."""

    def gsd_test_count_host_reads(self) -> None:
        if getattr(self, "_gsd_host_reads", None) is None:
            self._gsd_host_reads = _WorkerCounting(self)

    def gsd_test_host_reads(self) -> list[dict]:
        """The finished steps counted since the last call (a step still running stays)."""
        return self._gsd_host_reads.take()


def step_reads(records: list[dict]) -> list[StepReads]:
    return [StepReads(**r) for r in records]


def summarize(steps: list[StepReads], kind) -> dict:
    """Reads per step of the steps `kind` selects: their count, mean and max, and the sites
    with their total counts (most first)."""
    chosen = [s for s in steps if kind(s)]
    sites = collections.Counter()
    for s in chosen:
        sites.update({f"read {k}": v for k, v in s.reads.items()})
        sites.update({f"h2d {k}": v for k, v in s.h2d.items()})
        sites.update({f"stall {k}": v for k, v in s.stalls.items()})
    n = max(len(chosen), 1)
    return {"steps": len(chosen), "mean": sum(s.total for s in chosen) / n, "max": max((s.total for s in chosen), default=0),
            "mean_reads": sum(s.num_reads for s in chosen) / n, "max_reads": max((s.num_reads for s in chosen), default=0),
            "levels": sum(s.levels for s in chosen) / n, "sites": dict(sites.most_common())}
