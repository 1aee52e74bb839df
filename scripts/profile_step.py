#!/usr/bin/env python
"""Where a decoding step's time goes: no speculation, vLLM's draft_model chain and GSD, end to end.

Runs vLLM in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: engine core and worker here, so
every phase can be timed with the host clock; on CPU nothing is asynchronous), wraps the phases
of a step with timers, and reports per configuration the mean milliseconds per engine step of:

  step          LLMEngine.step, all of it
  schedule      the scheduler's schedule() and update_from_output()
  prepare       the runner's input preparation (_update_states, _prepare_inputs, attention metadata)
  target        the target model's forward (layers) and its LM head over the verified rows
  sample        sampling / the rejection sampler (GSD: the tree scorer and KV compaction)
  bookkeeping   the runner's _bookkeeping_sync (tokens to the requests, logprobs)
  draft         the drafter, of which (GSD) catch-up and level forwards (draft layers), draft LM
                head with softmax / top-k, and graph work (expand, unroll, budget)
  rest          step minus the phases above (engine-core and output-processor Python)

`--torch-profile` adds torch.profiler's top operators (self CPU time) per configuration.

    .venv/bin/python -m scripts.profile_step --pair qwen --configs no_spec,draft_model_k4,gsd_fixed
    .venv/bin/python -m scripts.profile_step --pair qwen --mode default --out docs/profile/qwen-default.md
"""

from __future__ import annotations

import collections
import functools
import gc
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


PHASES = ("step", "schedule", "prepare", "target", "sample", "bookkeeping", "draft",
          "draft.forward", "draft.lm_head", "draft.graph", "rest")


class Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)

    def wrap(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - started
                self.calls[phase] += 1

        setattr(owner, name, timed)


def instrument(llm, timers: Timers) -> None:
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    timers.wrap(engine, "step", "step")
    timers.wrap(core.scheduler, "schedule", "schedule")
    timers.wrap(core.scheduler, "update_from_output", "schedule")
    for name in ("_update_states", "_prepare_inputs", "_build_attention_metadata"):
        timers.wrap(runner, name, "prepare")
    timers.wrap(runner, "_model_forward", "target")
    timers.wrap(runner.model, "compute_logits", "target")
    timers.wrap(runner, "_sample", "sample")
    timers.wrap(runner, "_bookkeeping_sync", "bookkeeping")
    timers.wrap(runner, "propose_draft_token_ids", "draft")
    drafter = getattr(runner, "drafter", None)
    if drafter is not None and type(drafter).__name__ == "GsdProposer":
        timers.wrap(drafter, "_forward", "draft.forward")
        timers.wrap(drafter, "_children", "draft.lm_head")
        from vllm_gsd.graph import builder as graph_builder

        for name in ("expand", "build_tree", "frontier"):
            timers.wrap(graph_builder.GraphBuilder, name, "draft.graph")


def uninstrument_graph() -> None:
    from vllm_gsd.graph import builder as graph_builder

    for name in ("expand", "build_tree", "frontier"):
        function = getattr(graph_builder.GraphBuilder, name)
        while hasattr(function, "__wrapped__"):
            function = function.__wrapped__
        setattr(graph_builder.GraphBuilder, name, function)


def profile_config(pair, name: str, spec: dict | None, prompts, max_tokens: int, mode: str,
                   torch_profile: bool) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_gsd.testing.engines import mean_acceptance_length_of

    kwargs = {"enforce_eager": True} if mode == "eager" else {}
    llm = LLM(model=pair.target, dtype=pair.dtype, max_model_len=pair.max_model_len, seed=0, max_num_seqs=8,
              speculative_config=spec, **kwargs,
              **({"per_request_spec_decode_metrics": "summary"} if spec else {}))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    timers = Timers()
    instrument(llm, timers)
    profiler = None
    if torch_profile:
        import torch

        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.__enter__()
    started = time.perf_counter()
    outputs = []
    for prompt in prompts:
        outputs += llm.generate([prompt], params, use_tqdm=False)
    wall = time.perf_counter() - started
    if profiler is not None:
        profiler.__exit__(None, None, None)
    uninstrument_graph()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    steps = max(timers.calls["step"], 1)
    ms = {phase: 1e3 * timers.seconds[phase] / steps for phase in PHASES if phase != "rest"}
    ms["rest"] = ms["step"] - sum(ms[p] for p in ("schedule", "prepare", "target", "sample", "bookkeeping", "draft"))
    result = {"config": name, "tokens_per_s": tokens / wall, "steps": steps, "tokens_per_step": tokens / steps,
              "mean_acceptance_length": mean_acceptance_length_of(outputs) if spec else None, "ms": ms,
              "token_ids": [list(o.outputs[0].token_ids) for o in outputs]}
    if profiler is not None:
        result["top_ops"] = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


def render(pair, mode: str, results: list[dict], max_tokens: int, num_prompts: int) -> str:
    lines = [
        f"# Step profile: {pair.name} pair, batch 1, vLLM {'enforce_eager' if mode == 'eager' else 'default (compiled) mode'}",
        "",
        f"`python -m scripts.profile_step` ({time.strftime('%Y-%m-%d')}): {num_prompts} prompts one at a time x "
        f"{max_tokens} new tokens, greedy, {pair.dtype}, one process (host wall time, milliseconds per "
        "engine step; see the script's docstring for the phases).",
        "",
        "| config | tok/s | tokens / step | mean acc. len | step | schedule | prepare | target | sample "
        "| bookkeeping | draft | draft layers | draft LM head | graph | rest |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ms = r["ms"]
        mal = "" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        lines.append(
            f"| {r['config']} | {r['tokens_per_s']:.2f} | {r['tokens_per_step']:.2f} | {mal} | "
            + " | ".join(f"{ms[p]:.1f}" for p in PHASES) + " |")
    for r in results:
        if "top_ops" in r:
            lines += ["", f"## Top operators, {r['config']} (torch.profiler, self CPU time)", "", "```",
                      r["top_ops"], "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    from scripts.bench import configurations, emit, profiled_pair, profiling_parser

    parser = profiling_parser(__doc__, mode="eager", num_prompts=2)
    parser.add_argument("--torch-profile", action="store_true")
    args = parser.parse_args()
    pair = profiled_pair(args)
    configs = configurations(pair, 4)
    results = []
    for name in args.configs.split(","):
        print(f"[profile] {name}", flush=True)
        results.append(profile_config(pair, name, configs[name], pair.prompts, args.max_tokens, args.mode,
                                      args.torch_profile))
        print(render(pair, args.mode, results[-1:], args.max_tokens, len(pair.prompts)).splitlines()[-1],
              flush=True)  # a later engine may not start (memory): keep what was measured
    text = render(pair, args.mode, results, args.max_tokens, len(pair.prompts))
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
