"""What vLLM's async scheduling is worth on this machine: no speculation with and without it.

vLLM 0.32 turns async scheduling off for gsd (it schedules every draft slot of the next step
ahead, which a tree of varying size cannot use), so every gsd step, plain or drafted, runs the
engine core's scheduling and output processing between forwards. Two no-speculation engines
(Qwen pair, default mode, prompts from the 41st on, 48 tokens) generate each prompt group in
turns, twice in alternating order; the ratio is what running without it costs a plain step here
(docs/bench/async-scheduling.md: other measurements disagree; this VM swings by as much).

    .venv/bin/python -m scripts.bench_async_scheduling
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main():
    from vllm import SamplingParams

    from scripts.bench import prompt_token_ids, resolve_pair, start_engine

    pair = resolve_pair("qwen", 32, 40)
    prompts = [{"prompt_token_ids": ids} for ids in prompt_token_ids(pair, 48)]
    engines = {flag: start_engine(pair, None, 32, async_scheduling=flag) for flag in (True, False)}
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for batch in (8, 32):
        times = {True: 0.0, False: 0.0}
        for rnd in range(2):
            for start in range(0, 32, batch):
                for flag in ((True, False) if rnd == 0 else (False, True)):
                    t = time.perf_counter()
                    engines[flag].generate(prompts[start:start + batch], params, use_tqdm=False)
                    times[flag] += time.perf_counter() - t
        tokens = 2 * 32 * 48
        print(f"batch {batch}: async {tokens / times[True]:.2f} tok/s, sync {tokens / times[False]:.2f} tok/s, "
              f"sync / async {times[True] / times[False]:.3f}", flush=True)


if __name__ == "__main__":
    main()
