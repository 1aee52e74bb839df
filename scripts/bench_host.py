"""Host time of a step on a null pair: GSD's drafted step against vLLM's draft_model chain and
plain decoding, where the model math is negligible (issue 39, proxy 3).

On a GPU a 70B step at tensor parallelism 8 takes ~7-10 ms and what is not model math decides
whether speculation pays; on this CPU the math of a real pair (100-300 ms a step) hides it. The
tiny test pair (vllm_gsd/testing/tiny_models.py: a few layers of width 64-128 over a 1k
vocabulary) makes a step almost all host work: Python, vLLM's scheduling, input preparation,
sampling, GSD's graph building and scoring. Three engines in vLLM's default mode run the same
prompts in turns (the order rotating between prompt groups), greedy:

* no_spec: a plain step = vLLM's time per output token (TPOT);
* draft_model_k4: vLLM's chain, K = 4; a step = TPOT x its mean acceptance length;
* gsd_fixed: GSD with trees on every step (adaptive budget off, depth 4, N 12); a step = TPOT x
  its mean acceptance length, split by GSD's own timers (per decode step) into the target
  forward, the draft's layers, its LM head, the rest of the drafting (graph building, forward
  metadata: the host work between draft forwards) and the verification.

The goal the issue sets: GSD's drafted step at most 1.3x the chain's. A CPU's host is not a
GPU server's, so the figures are a proxy: ratios matter, milliseconds are this machine's.

    .venv/bin/python -m scripts.bench_host [--batches 1,8] [--rounds 2] [--out docs/results/host-time.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

DEPTH = 4


def configurations(draft: str) -> dict[str, dict | None]:
    return {
        "no_spec": None,
        "draft_model_k4": {"method": "draft_model", "model": draft, "num_speculative_tokens": DEPTH},
        "gsd_fixed": {"method": "gsd", "model": draft, "num_speculative_tokens": 12,
                      "gsd": {"top_k": 3, "max_depth": DEPTH, "adaptive": False}},
    }


def step_figures(name: str, outs: list, stats_before, stats_after) -> dict:
    """Milliseconds of one step of a configuration at one batch size (see the module docstring)."""
    from scripts.bench import tpot_of
    from vllm_gsd.testing.engines import acceptance_of

    tpot = tpot_of(outs)
    if name == "no_spec":
        return {"step_ms": tpot, "tokens_per_step": 1.0}
    # A decode step emits the mean acceptance length: TPOT x that length is the step's time.
    steps, accepted = acceptance_of(outs)
    length = 1.0 + accepted / max(steps, 1)
    step = {"step_ms": round(tpot * length, 2), "tokens_per_step": round(length, 2)}
    if name == "draft_model_k4":
        return step
    delta = {k: getattr(stats_after, k) - getattr(stats_before, k) for k in vars(stats_after)}
    decode_steps = max(delta["decode_steps"], 1)
    levels = max(delta["levels_drafted"], 1)
    draft_host = delta["draft_step_us"] - delta["draft_model_us"] - delta["draft_logits_us"]
    return {
        **step,
        "target_forward_ms": round(delta["target_forward_us"] / 1e3 / decode_steps, 2),
        "draft_layers_ms": round(delta["draft_model_us"] / 1e3 / decode_steps, 2),
        "draft_head_ms": round(delta["draft_logits_us"] / 1e3 / decode_steps, 2),
        "draft_host_ms": round(draft_host / 1e3 / decode_steps, 2),
        "host_per_level_ms": round(draft_host / 1e3 / levels, 3),
        "verify_ms": round(delta["verify_us"] / 1e3 / decode_steps, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from scripts.bench import emit, generate_timed, machine_text, prompt_token_ids, resolve_pair, start_engine, stop_engine
    from vllm_gsd.engine.metrics import gsd_stats

    pair = resolve_pair("tiny", args.num_prompts)
    prompts = [{"prompt_token_ids": ids} for ids in prompt_token_ids(pair, args.max_tokens)]
    batches = [int(b) for b in args.batches.split(",")]
    specs = configurations(pair.draft)
    engines = {name: start_engine(pair, spec, max(batches)) for name, spec in specs.items()}
    measured = {}  # (name, batch) -> [figures per round]
    try:
        for round_index in range(args.rounds):
            for batch in batches:
                outs = {name: [] for name in engines}
                before = gsd_stats(engines["gsd_fixed"])
                names = list(engines)
                for k, start in enumerate(range(0, len(prompts), batch)):
                    shift = (k + round_index) % len(names)
                    for name in names[shift:] + names[:shift]:
                        chunk, _ = generate_timed(engines[name], prompts[start:start + batch], args.max_tokens)
                        outs[name] += chunk
                after = gsd_stats(engines["gsd_fixed"])
                for name in names:
                    figures = step_figures(name, outs[name], before, after)
                    measured.setdefault((name, batch), []).append(figures)
                    print(f"round {round_index + 1} batch {batch} {name}: {figures}", flush=True)
    finally:
        for llm in engines.values():
            stop_engine(llm)

    def median(name, batch, key):
        values = [f[key] for f in measured[name, batch] if f.get(key) is not None]
        return round(statistics.median(values), 3) if values else None

    lines = [
        "# Host time of a step on a null pair",
        "",
        f"`python -m scripts.bench_host {' '.join(sys.argv[1:] if argv is None else argv)}` on "
        f"{machine_text()}, {time.strftime('%Y-%m-%d')}; the tiny pair "
        f"(float32), vLLM's default (compiled) mode, {len(prompts)} prompts x {args.max_tokens} tokens, "
        f"greedy, {args.rounds} rounds in turns; medians over rounds. What each column is: "
        "scripts/bench_host.py.",
        "",
        "| batch | plain step ms | chain (K=4) step ms | GSD drafted step ms | GSD / chain | GSD tokens / step "
        "| chain tokens / step | target fwd ms | draft layers ms | draft head ms | draft host ms "
        "| host per draft level ms | verify ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for batch in batches:
        plain, chain = median("no_spec", batch, "step_ms"), median("draft_model_k4", batch, "step_ms")
        gsd = {key: median("gsd_fixed", batch, key) for key in measured["gsd_fixed", batch][0]}
        ratio = round(gsd["step_ms"] / chain, 2) if chain else None
        lines.append(
            f"| {batch} | {plain} | {chain} | {gsd['step_ms']} | {ratio} | {gsd['tokens_per_step']} | "
            f"{median('draft_model_k4', batch, 'tokens_per_step')} | {gsd['target_forward_ms']} | "
            f"{gsd['draft_layers_ms']} | {gsd['draft_head_ms']} | {gsd['draft_host_ms']} | "
            f"{gsd['host_per_level_ms']} | {gsd['verify_ms']} |")
    emit("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
