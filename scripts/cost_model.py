"""Roofline cost model of speculative decoding: predicted speedup of GSD (or a chain) over plain
decoding for a target/draft pair on a given accelerator, batch size and context length.

Model (every figure per accelerator, i.e. per tensor-parallel rank):
* one forward over n new tokens, for a batch of B requests with C tokens of context each, costs
      max(bytes / bandwidth, flops / flop_rate) + comm + overhead
  bytes = the rank's weights + the KV it reads (B * C tokens), flops = 2 * params * n plus the
  attention over the context; comm = two all-reduces per layer over tensor parallelism (latency
  + ring transfer of n * hidden activations); overhead = a fixed cost per forward (launches,
  the framework's step);
* plain decoding: one target forward over B tokens per step, B tokens out;
* speculation: D draft forwards (the first catches the draft up on the L tokens accepted last
  step, the others expand the frontier, sharing the step's remaining draft tokens), then one
  target forward over B * (1 + N) tokens; B * L tokens out (L = mean acceptance length, N =
  nodes verified per request per step, both as scripts/bench.py measures them);
* speedup = (L / speculative step time) / (1 / plain step time).

The ridge point of the roofline (n where weight reads and compute take equally long) bounds the
useful verification width: B * (1 + N) beyond it makes every verified node cost compute.

Host costs (`HostCosts`, off unless given): what a GPU step pays beside the model math, which the
roofline cannot see and the CPU benchmarks hide under 100-300 ms of math. Per speculative step:
the host work the device waits for (graph building, scoring: `--host-step-ms`, and between two
draft levels: `--host-level-ms`), each device-to-host read (`--syncs-per-step` x `--sync-us`: the
stream drains and the host must re-fill it), the launches the tree rows add per target layer
(`--tree-launches-per-layer` x `--launch-us`), and, for an eager draft (outside CUDA graphs),
every draft layer's launches (`--draft-launches-per-layer` x `--launch-us` per layer per draft
forward). The measured figures come from the CPU proxies (docs/results/host-reads.md,
launches.md and the null-pair benchmark); `--launch-us` and `--sync-us` are a GPU's, assumed.

CLI:
  predict:  cost_model.py --target llama-70b --draft llama-1b --gpu H100 --tp 8 --batch 1,8,32,64 \\
                --context 2048 --acceptance-length 4.0 --nodes-per-step 24 --depth 6
  check:    cost_model.py --check docs/bench/qwen/results.json [--fit-on none,chain]
            fits the machine's effective figures (bandwidth, flop rate, overhead per target
            forward, per draft forward and per request per step) to the rows of the --fit-on
            methods (default: no speculation and vLLM's draft_model chain; `none` alone fits the
            first three), or takes them as --bandwidth-gbs/--tflops/--overhead-ms/...; then prints
            predicted against measured ratio to no speculation for every speculative row, marking
            which rows were fitted and which are predictions (GSD's, by default).
Pure module (scipy for the fit only; no vLLM or torch); results.json is read by field name.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path


# ------------------------------------------------------------------------------ models and hardware

@dataclass(frozen=True)
class ModelShape:
    """What the cost of a forward depends on. params counts every weight (embeddings included)."""

    name: str
    params: float
    layers: int
    hidden: int  # = query heads x head size for these models
    kv_heads: int
    head_dim: int

    def weight_bytes(self, dtype_bytes: float, tp: int) -> float:
        return self.params * dtype_bytes / tp

    def kv_bytes_per_token(self, dtype_bytes: float, tp: int) -> float:
        """KV cache bytes one token holds on one rank (vLLM replicates KV heads when tp > kv_heads)."""
        heads_per_rank = max(self.kv_heads // tp, 1)
        return 2 * self.layers * heads_per_rank * self.head_dim * dtype_bytes

    def flops(self, new_tokens: float, context: float, tp: int) -> float:
        """Multiply-adds x 2 of a forward over new_tokens, each attending to `context` tokens."""
        dense = 2.0 * self.params * new_tokens
        attention = 4.0 * self.layers * self.hidden * context * new_tokens
        return (dense + attention) / tp


# Public model cards (parameter counts include embeddings).
MODELS: dict[str, ModelShape] = {m.name: m for m in [
    ModelShape("llama-70b", 70.6e9, 80, 8192, 8, 128),   # Llama 3.1 70B
    ModelShape("llama-8b", 8.03e9, 32, 4096, 8, 128),    # Llama 3.1 8B
    ModelShape("llama-3b", 3.21e9, 28, 3072, 8, 128),    # Llama 3.2 3B
    ModelShape("llama-1b", 1.24e9, 16, 2048, 8, 64),     # Llama 3.2 1B
    ModelShape("qwen-72b", 72.7e9, 80, 8192, 8, 128),    # Qwen2.5 72B
    ModelShape("qwen-7b", 7.62e9, 28, 3584, 4, 128),     # Qwen2.5 7B
    ModelShape("qwen-1.5b", 1.54e9, 28, 1536, 2, 128),   # Qwen2.5(-Coder) 1.5B
    ModelShape("qwen-0.5b", 0.494e9, 24, 896, 2, 64),    # Qwen2.5(-Coder) 0.5B
    ModelShape("smollm-135m", 0.135e9, 30, 576, 3, 64),  # SmolLM2 135M
]}


@dataclass(frozen=True)
class Hardware:
    """One accelerator: peak (or effective) memory bandwidth and dense bf16 flop rate, the link
    tensor-parallel all-reduces use, and the fixed cost of one forward."""

    name: str
    bandwidth: float  # bytes/s
    flop_rate: float  # FLOP/s
    link_bandwidth: float = 450e9  # bytes/s per direction (NVLink)
    allreduce_latency: float = 10e-6  # s per all-reduce
    overhead: float = 0.3e-3  # s per forward
    request_overhead: float = 0.0  # s per request per step (scheduling, sampling, detokenizing)


# Datasheet peaks (SXM parts, dense bf16, no sparsity). Real kernels reach 70-90 % of them.
GPUS: dict[str, Hardware] = {g.name: g for g in [
    Hardware("H100", 3.35e12, 989e12, link_bandwidth=450e9),
    Hardware("H200", 4.8e12, 989e12, link_bandwidth=450e9),
    Hardware("A100", 2.039e12, 312e12, link_bandwidth=300e9),
]}


def roofline_time(nbytes: float, flops: float, hw: Hardware) -> float:
    """Seconds of a kernel stream that must read nbytes and compute flops: the slower of the two."""
    return max(nbytes / hw.bandwidth, flops / hw.flop_rate)


def ridge_tokens(model: ModelShape, hw: Hardware, dtype_bytes: float) -> float:
    """New tokens per forward at which reading the weights and computing on them take equally long
    (context ignored; independent of tp, which divides both)."""
    return (model.params * dtype_bytes / hw.bandwidth) / (2.0 * model.params / hw.flop_rate)


def comm_time(model: ModelShape, hw: Hardware, new_tokens: float, dtype_bytes: float, tp: int) -> float:
    """Two ring all-reduces per layer of the forward's activations (zero without tp)."""
    if tp == 1:
        return 0.0
    message = new_tokens * model.hidden * dtype_bytes
    one = hw.allreduce_latency + 2.0 * (tp - 1) / tp * message / hw.link_bandwidth
    return 2 * model.layers * one


def forward_time(model: ModelShape, hw: Hardware, *, new_tokens: float, batch: int, context: float,
                 dtype_bytes: float, tp: int, overhead: float | None = None) -> float:
    """Seconds of one forward over new_tokens (all requests together), batch requests of `context`
    tokens each already in the KV cache."""
    nbytes = model.weight_bytes(dtype_bytes, tp) + batch * context * model.kv_bytes_per_token(dtype_bytes, tp)
    flops = model.flops(new_tokens, context, tp)
    fixed = hw.overhead if overhead is None else overhead
    return roofline_time(nbytes, flops, hw) + comm_time(model, hw, new_tokens, dtype_bytes, tp) + fixed


# ------------------------------------------------------------------------------ host costs

@dataclass(frozen=True)
class HostCosts:
    """Seconds a speculative step waits on the host beyond the roofline (see the module docstring)."""

    step: float = 0.0  # host work per speculative step the device waits for
    per_level: float = 0.0  # host work between two draft forwards
    syncs_per_step: float = 0.0  # device-to-host reads per speculative step
    sync: float = 20e-6  # what one read costs: the stream drains, then the host re-fills it
    tree_launches_per_layer: float = 0.0  # launches the tree rows add per target attention layer
    launch: float = 5e-6  # host time of one kernel launch
    eager_draft: bool = False  # draft forwards outside CUDA graphs: every layer's launches on the host
    draft_launches_per_layer: float = 12.0  # launches of one eager transformer layer (norms, GEMMs, rope, attention)

    def speculative_step(self, setup: "Setup", spec: "Speculation") -> float:
        seconds = self.step + self.syncs_per_step * self.sync
        seconds += self.tree_launches_per_layer * self.launch * setup.target.layers
        seconds += max(spec.draft_forwards - 1, 0) * self.per_level
        if self.eager_draft and setup.draft is not None:
            seconds += spec.draft_forwards * setup.draft.layers * self.draft_launches_per_layer * self.launch
        return seconds


# ------------------------------------------------------------------------------ one decoding step

@dataclass(frozen=True)
class Speculation:
    """Per request per step: L tokens out, N nodes verified, D draft forwards computing T draft
    tokens in all (T = 0 and D = 0: a draft that costs nothing, e.g. n-gram lookup)."""

    acceptance_length: float
    nodes_per_step: float
    draft_forwards: int
    draft_tokens_per_step: float

    @staticmethod
    def gsd(acceptance_length: float, nodes_per_step: float, depth: int,
            draft_tokens_per_accepted: float | None = None) -> Speculation:
        """GSD: catch-up + depth - 1 level forwards. Without a measured draft_tokens_per_accepted,
        every verified node is taken as expanded once (an upper bound: leaves are not)."""
        if draft_tokens_per_accepted is not None:
            tokens = draft_tokens_per_accepted * acceptance_length
        else:
            tokens = acceptance_length + nodes_per_step
        return Speculation(acceptance_length, nodes_per_step, depth, tokens)

    @staticmethod
    def chain(acceptance_length: float, k: int) -> Speculation:
        """vLLM's draft_model: K draft forwards, the first over the catch-up tokens."""
        return Speculation(acceptance_length, k, k, acceptance_length + k - 1)


@dataclass(frozen=True)
class Setup:
    target: ModelShape
    draft: ModelShape | None
    hw: Hardware
    tp: int = 1
    dtype_bytes: float = 2.0
    draft_overhead: float | None = None  # s per draft forward; None = hw.overhead
    draft_tp: int | None = None  # None = tp (vLLM 0.32's draft_model path requires it)
    host: HostCosts | None = None  # a speculative step's host costs; None: the roofline alone


def plain_step_time(setup: Setup, batch: int, context: float) -> float:
    return forward_time(setup.target, setup.hw, new_tokens=batch, batch=batch, context=context,
                        dtype_bytes=setup.dtype_bytes, tp=setup.tp) + batch * setup.hw.request_overhead


def draft_time(setup: Setup, spec: Speculation, batch: int, context: float) -> float:
    """The step's D draft forwards: catch-up over L tokens per request, then the rest of the
    draft tokens spread evenly over the other D - 1 forwards, at the draft's tp."""
    if spec.draft_forwards == 0 or spec.draft_tokens_per_step == 0:
        return 0.0
    if setup.draft is None:
        raise ValueError("a speculation with draft forwards needs a draft model")
    catch_up = min(spec.acceptance_length, spec.draft_tokens_per_step)
    per_level = (spec.draft_tokens_per_step - catch_up) / max(spec.draft_forwards - 1, 1)
    tokens = [catch_up] + [per_level] * (spec.draft_forwards - 1)
    return sum(forward_time(setup.draft, setup.hw, new_tokens=batch * t, batch=batch, context=context,
                            dtype_bytes=setup.dtype_bytes, tp=setup.draft_tp or setup.tp,
                            overhead=setup.draft_overhead)
               for t in tokens)


def speculative_step_time(setup: Setup, spec: Speculation, batch: int, context: float) -> float:
    verify = forward_time(setup.target, setup.hw, new_tokens=batch * (1 + spec.nodes_per_step), batch=batch,
                          context=context, dtype_bytes=setup.dtype_bytes, tp=setup.tp)
    host = setup.host.speculative_step(setup, spec) if setup.host is not None else 0.0
    return draft_time(setup, spec, batch, context) + verify + batch * setup.hw.request_overhead + host


def speedup(setup: Setup, spec: Speculation, batch: int, context: float) -> float:
    """(tokens per step / speculative step time) / (1 / plain step time), per request."""
    return (spec.acceptance_length / speculative_step_time(setup, spec, batch, context)) * \
        plain_step_time(setup, batch, context)


def max_useful_nodes(setup: Setup, batch: int, cap: int = 128) -> int:
    """Largest node budget N whose verification stays at or under the ridge point:
    batch * (1 + N) <= ridge tokens (0: at this batch the target is compute bound already)."""
    ridge = ridge_tokens(setup.target, setup.hw, setup.dtype_bytes)
    return max(0, min(cap, math.floor(ridge / batch) - 1))


# ------------------------------------------------------------------------------ fit and check

FIT_PARAMETERS = ("bandwidth", "flop_rate", "overhead", "draft_overhead", "request_overhead")
_FIT_START = {"bandwidth": 50e9, "flop_rate": 1e12, "overhead": 0.05, "draft_overhead": 0.01,
              "request_overhead": 0.005}


def _setup_from(values: dict[str, float], target: ModelShape, draft: ModelShape, dtype_bytes: float) -> Setup:
    hw = Hardware("fitted", values["bandwidth"], values["flop_rate"], overhead=values["overhead"],
                  request_overhead=values["request_overhead"])
    return Setup(target, draft, hw, tp=1, dtype_bytes=dtype_bytes, draft_overhead=values["draft_overhead"])


def fit_setup(results: dict, *, target: ModelShape, draft: ModelShape, context: float, dtype_bytes: float,
              depth: int, fit_on: tuple[str, ...] = ("none", "chain"),
              fixed: dict[str, float] | None = None) -> Setup:
    """The machine's effective figures (FIT_PARAMETERS) that best explain the results.json rows
    of the methods in `fit_on`: plain-decoding step times (batch / tokens_per_s) and, for the
    speculative methods, the ratio to plain decoding. Least squares on log errors
    (scipy.optimize.least_squares, in log space). `fixed` figures are taken as given. With only
    plain rows, a draft forward's overhead is taken equal to the target's and the per-request
    overhead is 0 unless fixed (three rows cannot tell more apart)."""
    from scipy.optimize import least_squares

    fixed = dict(fixed or {})
    if fit_on == ("none",):
        fixed.setdefault("request_overhead", 0.0)
    free = [name for name in FIT_PARAMETERS if name not in fixed
            and not (name == "draft_overhead" and fit_on == ("none",))]
    rows = modeled_rows(results)
    plain = {r["batch"]: r for r in rows if method_of(r["config"]) == "none"}
    used = [r for r in rows if method_of(r["config"]) in fit_on and r["batch"] in plain]
    if len(used) < len(free):
        raise ValueError(f"{len(used)} rows cannot fit {len(free)} figures ({', '.join(free)})")

    def values_of(x) -> dict[str, float]:
        values = {**fixed, **{name: math.exp(v) for name, v in zip(free, x)}}
        values.setdefault("draft_overhead", values["overhead"])
        return values

    def residuals(x):
        setup = _setup_from(values_of(x), target, draft, dtype_bytes)
        out = []
        for r in used:
            if method_of(r["config"]) == "none":
                out.append(math.log(plain_step_time(setup, r["batch"], context) * r["tokens_per_s"] / r["batch"]))
            else:
                measured = measured_ratio(r, plain)
                out.append(math.log(speedup(setup, speculation_of(r, depth), r["batch"], context) / measured))
        return out

    low, high = math.log(1e-9), math.log(1e17)
    start = [math.log(_FIT_START[name]) for name in free]
    fit = least_squares(residuals, start, bounds=([low] * len(free), [high] * len(free)))
    return _setup_from(values_of(fit.x), target, draft, dtype_bytes)


@dataclass(frozen=True)
class CheckRow:
    config: str
    batch: int
    measured: float  # ratio to no speculation at the same batch
    predicted: float

    @property
    def error(self) -> float:
        """Relative error of the predicted ratio."""
        return self.predicted / self.measured - 1.0


def method_of(config: str) -> str | None:
    """The method of a scripts/bench.py config name (no_spec, ngram_k4, draft_model_k4, gsd_*),
    None for one this model does not know."""
    for prefix, method in (("no_spec", "none"), ("ngram", "ngram"), ("draft_model", "chain"), ("gsd", "gsd")):
        if config.startswith(prefix):
            return method
    return None


def modeled_rows(results: dict) -> list[dict]:
    """The rows this model can read: a known method, and acceptance figures where it speculates."""
    out = []
    for row in results["rows"]:
        method = method_of(row["config"])
        if method is None:
            continue
        if method != "none" and (row.get("mean_acceptance_length") is None or row.get("nodes_per_step") is None):
            continue
        out.append(row)
    return out


def speculation_of(row: dict, depth: int) -> Speculation:
    method = method_of(row["config"])
    length, nodes = row["mean_acceptance_length"], row["nodes_per_step"]
    if method == "ngram":
        return Speculation(length, nodes, 0, 0.0)
    if method == "chain":
        return Speculation.chain(length, round(nodes))
    return Speculation.gsd(length, nodes, depth, row.get("draft_tokens_per_accepted"))


def preset_for(name: str) -> ModelShape | None:
    """A preset whose family and size both appear in a model name (e.g. qwen2.5-coder-1.5b-...)."""
    lowered = name.lower()
    for preset in MODELS.values():
        family, size = preset.name.split("-")
        if family in lowered and re.search(rf"(?<![\d.]){re.escape(size)}", lowered):
            return preset
    return None


def bench_depth(meta: dict, default: int = 4) -> int:
    """The gsd depth scripts/bench.py ran with (its --depth, default 4)."""
    if "depth" in meta:
        return int(meta["depth"])
    argv = shlex.split(meta.get("argv", ""))
    for i, arg in enumerate(argv):
        if arg == "--depth" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--depth="):
            return int(arg.split("=", 1)[1])
    return default


def measured_ratio(row: dict, plain: dict) -> float:
    """A speculative row's ratio to no speculation: the one bench.py paired it with (interleaved
    runs measure each configuration beside its own no speculation), else to the no_spec row."""
    paired = row.get("ratio_to_no_spec")
    return float(paired) if paired else row["tokens_per_s"] / plain[row["batch"]]["tokens_per_s"]


def check(results: dict, setup: Setup, *, context: float, depth: int) -> list[CheckRow]:
    """Predicted against measured ratio to no speculation for every speculative row of a
    scripts/bench.py results.json (rows of unknown configs left out)."""
    rows = modeled_rows(results)
    plain = {r["batch"]: r for r in rows if method_of(r["config"]) == "none"}
    out = []
    for row in rows:
        if method_of(row["config"]) == "none" or row["batch"] not in plain:
            continue
        measured = measured_ratio(row, plain)
        predicted = speedup(setup, speculation_of(row, depth), row["batch"], context)
        out.append(CheckRow(row["config"], row["batch"], measured, predicted))
    return out


# ------------------------------------------------------------------------------ CLI

def _model(name: str) -> ModelShape:
    if name in MODELS:
        return MODELS[name]
    raise SystemExit(f"unknown model preset {name!r}; known: {', '.join(MODELS)} "
                     "(or give --target-params/--draft-params with a preset of the same shape)")


def _with_params(model: ModelShape, params_b: float | None) -> ModelShape:
    return model if params_b is None else replace(model, params=params_b * 1e9)


def _hardware(args) -> Hardware | None:
    base = GPUS[args.gpu] if args.gpu else None
    if base is None and args.bandwidth_gbs is None:
        return None
    base = base or Hardware("custom", 1e12, 1e14)
    return replace(base,
                   bandwidth=base.bandwidth if args.bandwidth_gbs is None else args.bandwidth_gbs * 1e9,
                   flop_rate=base.flop_rate if args.tflops is None else args.tflops * 1e12,
                   overhead=base.overhead if args.overhead_ms is None else args.overhead_ms * 1e-3,
                   request_overhead=(base.request_overhead if args.request_overhead_ms is None
                                     else args.request_overhead_ms * 1e-3),
                   link_bandwidth=base.link_bandwidth if args.link_gbs is None else args.link_gbs * 1e9,
                   allreduce_latency=(base.allreduce_latency if args.allreduce_us is None
                                      else args.allreduce_us * 1e-6))


def _describe(hw: Hardware, draft_overhead: float | None = None) -> str:
    text = (f"{hw.name}: bandwidth {hw.bandwidth / 1e9:.1f} GB/s, {hw.flop_rate / 1e12:.3f} TFLOP/s, "
            f"overhead {hw.overhead * 1e3:.2f} ms per forward")
    if draft_overhead is not None:
        text += f" ({draft_overhead * 1e3:.2f} ms per draft forward)"
    if hw.request_overhead:
        text += f", {hw.request_overhead * 1e3:.2f} ms per request per step"
    return text


def _fixed_figures(args) -> dict[str, float]:
    given = {"bandwidth": (args.bandwidth_gbs, 1e9), "flop_rate": (args.tflops, 1e12),
             "overhead": (args.overhead_ms, 1e-3), "draft_overhead": (args.draft_overhead_ms, 1e-3),
             "request_overhead": (args.request_overhead_ms, 1e-3)}
    return {name: value * scale for name, (value, scale) in given.items() if value is not None}


def run_check(args) -> int:
    results = json.loads(Path(args.check).read_text())
    pair = results.get("pair", {})
    target = _model(args.target) if args.target else preset_for(pair.get("target", ""))
    draft = _model(args.draft) if args.draft else preset_for(pair.get("draft", ""))
    if target is None or draft is None:
        raise SystemExit(f"no preset matches the pair {pair.get('target')!r} / {pair.get('draft')!r}; "
                         "name them with --target and --draft")
    target = _with_params(target, args.target_params)
    draft = _with_params(draft, args.draft_params)
    dtype_bytes = args.dtype_bytes or (4.0 if pair.get("dtype") == "float32" else 2.0)
    depth = args.depth or bench_depth(results.get("meta", {}))
    fit_on = tuple(args.fit_on.split(","))
    fixed = _fixed_figures(args)
    setup = fit_setup(results, target=target, draft=draft, context=args.context, dtype_bytes=dtype_bytes,
                      depth=depth, fit_on=fit_on, fixed=fixed)
    rows = check(results, setup, context=args.context, depth=depth)
    print(f"{args.check}: target {target.name}, draft {draft.name}, context {args.context:g}, gsd depth {depth}")
    print(f"fitted on the rows of: {', '.join(fit_on)}; given: {', '.join(fixed) or 'nothing'}")
    print(_describe(setup.hw, setup.draft_overhead))
    print(f"{'config':16s} {'batch':>5s} {'measured':>9s} {'predicted':>9s} {'error':>7s}")
    for r in rows:
        role = "fitted" if method_of(r.config) in fit_on else ("not modeled" if method_of(r.config) == "ngram"
                                                               else "predicted")
        print(f"{r.config:16s} {r.batch:5d} {r.measured:9.2f} {r.predicted:9.2f} {100 * r.error:+6.0f}%  {role}")
    left_out = sorted({r["config"] for r in results["rows"]} - {r["config"] for r in modeled_rows(results)})
    if left_out:
        print(f"left out (unknown config or no acceptance figures): {', '.join(left_out)}")
    for method in ("chain", "gsd"):
        errors = [abs(r.error) for r in rows if method_of(r.config) == method]
        if errors:
            kind = "fitted" if method in fit_on else "predicted"
            print(f"{method}: mean |error| {100 * sum(errors) / len(errors):.0f}%, "
                  f"max {100 * max(errors):.0f}% over {len(errors)} rows ({kind})")
    return 0


def run_predict(args) -> int:
    hw = _hardware(args)
    if hw is None:
        raise SystemExit("name --gpu (H100, H200, A100) or give --bandwidth-gbs and --tflops")
    target = _with_params(_model(args.target or "llama-70b"), args.target_params)
    draft = _with_params(_model(args.draft or "llama-1b"), args.draft_params)
    setup = Setup(target, draft, hw, tp=args.tp, dtype_bytes=args.dtype_bytes or 2.0,
                  draft_overhead=None if args.draft_overhead_ms is None else args.draft_overhead_ms * 1e-3,
                  draft_tp=args.draft_tp)
    spec = Speculation.gsd(args.acceptance_length, args.nodes_per_step, args.depth or 6,
                           args.draft_tokens_per_accepted)
    ridge = ridge_tokens(target, hw, setup.dtype_bytes)
    draft_tp = args.draft_tp or args.tp
    note = "" if draft_tp == args.tp else " (what-if: vLLM 0.32 runs the draft at the target's tp)"
    print(f"target {target.name} at tp {args.tp} + draft {draft.name} at tp {draft_tp}{note}, "
          f"context {args.context:g}; {_describe(hw)}")
    print(f"speculation: mean acceptance length {spec.acceptance_length:g}, {spec.nodes_per_step:g} nodes "
          f"verified per step, {spec.draft_forwards} draft forwards, {spec.draft_tokens_per_step:g} draft "
          f"tokens per request per step; roofline ridge {ridge:.0f} tokens per target forward")
    host = host_costs_of(args)
    roofline = replace(setup, host=None)
    if host is None:
        print(f"{'batch':>5s} {'plain ms':>9s} {'draft ms':>9s} {'verify ms':>9s} {'speedup':>8s} {'max useful N':>13s}")
    else:
        print(f"host costs per speculative step: {_describe_host(host)}")
        print(f"{'batch':>5s} {'plain ms':>9s} {'draft ms':>9s} {'verify ms':>9s} {'host ms':>8s} "
              f"{'speedup':>8s} {'w/o host':>9s} {'max useful N':>13s}")
    for batch in args.batch:
        plain = plain_step_time(setup, batch, args.context)
        drafting = draft_time(setup, spec, batch, args.context)
        verify = speculative_step_time(roofline, spec, batch, args.context) - drafting
        if host is None:
            print(f"{batch:5d} {plain * 1e3:9.2f} {drafting * 1e3:9.2f} {verify * 1e3:9.2f} "
                  f"{speedup(setup, spec, batch, args.context):7.2f}x {max_useful_nodes(setup, batch):13d}")
            continue
        with_host = replace(setup, host=host)
        print(f"{batch:5d} {plain * 1e3:9.2f} {drafting * 1e3:9.2f} {verify * 1e3:9.2f} "
              f"{host.speculative_step(setup, spec) * 1e3:8.2f} {speedup(with_host, spec, batch, args.context):7.2f}x "
              f"{speedup(roofline, spec, batch, args.context):8.2f}x {max_useful_nodes(setup, batch):13d}")
    return 0


def host_costs_of(args) -> HostCosts | None:
    """The --host-* / --syncs-per-step / ... arguments as HostCosts; None when none is given."""
    given = {name: getattr(args, name) for name in ("host_step_ms", "host_level_ms", "syncs_per_step",
                                                    "tree_launches_per_layer")}
    if all(v is None for v in given.values()) and not args.eager_draft:
        return None
    return HostCosts(step=(args.host_step_ms or 0.0) * 1e-3, per_level=(args.host_level_ms or 0.0) * 1e-3,
                     syncs_per_step=args.syncs_per_step or 0.0, sync=args.sync_us * 1e-6,
                     tree_launches_per_layer=args.tree_launches_per_layer or 0.0, launch=args.launch_us * 1e-6,
                     eager_draft=args.eager_draft)


def _describe_host(host: HostCosts) -> str:
    return (f"{host.step * 1e3:g} ms + {host.per_level * 1e3:g} ms per draft level, {host.syncs_per_step:g} "
            f"device reads x {host.sync * 1e6:g} us, {host.tree_launches_per_layer:g} tree launches per target "
            f"layer x {host.launch * 1e6:g} us" + (f", eager draft ({host.draft_launches_per_layer:g} launches "
                                                   "per draft layer)" if host.eager_draft else ", draft in CUDA graphs"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", metavar="RESULTS_JSON", help="compare with a scripts/bench.py results.json")
    parser.add_argument("--target", help=f"preset: {', '.join(MODELS)}")
    parser.add_argument("--draft", help="preset, as --target")
    parser.add_argument("--target-params", type=float, help="override the preset's parameter count (billions)")
    parser.add_argument("--draft-params", type=float, help="override the preset's parameter count (billions)")
    parser.add_argument("--dtype-bytes", type=float, help="bytes per weight / KV value (default 2: bf16)")
    parser.add_argument("--gpu", choices=sorted(GPUS), help="accelerator preset (datasheet peaks)")
    parser.add_argument("--bandwidth-gbs", type=float, help="memory bandwidth, GB/s (overrides the preset)")
    parser.add_argument("--tflops", type=float, help="dense flop rate, TFLOP/s (overrides the preset)")
    parser.add_argument("--overhead-ms", type=float, help="fixed cost per forward, ms (GPU presets: 0.3)")
    parser.add_argument("--draft-overhead-ms", type=float, help="fixed cost per draft forward (default: as target)")
    parser.add_argument("--request-overhead-ms", type=float, help="fixed cost per request per step (GPU presets: 0)")
    parser.add_argument("--fit-on", default="none,chain",
                        help="--check: methods whose rows calibrate the machine (none, chain, gsd, ngram)")
    parser.add_argument("--link-gbs", type=float, help="all-reduce link bandwidth per direction, GB/s")
    parser.add_argument("--allreduce-us", type=float, help="latency of one all-reduce, microseconds")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (target and draft)")
    parser.add_argument("--draft-tp", type=int, help="draft's tensor-parallel degree (default: --tp)")
    parser.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64])
    parser.add_argument("--context", type=float, default=None, help="tokens in context per request")
    parser.add_argument("--acceptance-length", type=float, default=4.0, help="mean acceptance length L")
    parser.add_argument("--nodes-per-step", type=float, default=24.0, help="nodes verified per request per step N")
    parser.add_argument("--depth", type=int, help="draft forwards per step (gsd max_depth)")
    parser.add_argument("--draft-tokens-per-accepted", type=float,
                        help="draft tokens computed per output token, as bench.py measures (default: L + N per step)")
    host = parser.add_argument_group("host costs of a speculative step (predict; off unless given)")
    host.add_argument("--host-step-ms", type=float, help="host work per speculative step the device waits for")
    host.add_argument("--host-level-ms", type=float, help="host work between two draft forwards")
    host.add_argument("--syncs-per-step", type=float, help="device-to-host reads per speculative step")
    host.add_argument("--sync-us", type=float, default=20.0, help="cost of one read (default 20, assumed)")
    host.add_argument("--tree-launches-per-layer", type=float, help="launches the tree rows add per target layer")
    host.add_argument("--launch-us", type=float, default=5.0, help="host time of one launch (default 5, assumed)")
    host.add_argument("--eager-draft", action="store_true", help="draft forwards outside CUDA graphs")
    args = parser.parse_args(argv)
    if args.context is None:
        args.context = 256.0 if args.check else 2048.0
    if args.tp < 1 or (args.draft_tp is not None and args.draft_tp < 1):
        parser.error("--tp and --draft-tp must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_check(args) if args.check else run_predict(args)


if __name__ == "__main__":
    sys.exit(main())
