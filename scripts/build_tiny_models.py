#!/usr/bin/env python
"""Build (or find in the cache) every tiny test model and report how well each draft agrees.

    .venv/bin/python -m scripts.build_tiny_models [--max-new-tokens 48] [--no-agreement]

Prints one line per model: name, directory, build seconds (0.0 when cached) and, for drafts,
the greedy agreement with the target (HF transformers, the fixed tiny prompts, teacher forcing
on the target's greedy continuation). Cache: $VLLM_GSD_CACHE or ~/.cache/vllm-gsd.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from vllm_gsd.testing import tiny_models
from vllm_gsd.testing.prompts import tiny_prompts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--no-agreement", action="store_true", help="only build, do not measure")
    return parser.parse_args(argv)


def timed(build) -> tuple[Path, float]:
    """Return (build(), seconds it took)."""
    start = time.perf_counter()
    path = build()
    return path, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    """Build all tiny models, print paths, build times and draft agreement rates."""
    args = parse_args(argv)
    builders = {"target": tiny_models.tiny_target}
    builders.update(
        {
            f"draft-{kind}": (lambda k=kind: tiny_models.tiny_draft(k))
            for kind in tiny_models.DRAFT_KINDS
        }
    )
    builders["draft-other-vocab"] = tiny_models.tiny_draft_other_vocab
    total_start = time.perf_counter()
    paths = {}
    for name, build in builders.items():
        paths[name], seconds = timed(build)
        print(f"{name:18s} {paths[name]}  built in {seconds:.1f} s", flush=True)
    print(f"total build {time.perf_counter() - total_start:.1f} s")
    if args.no_agreement:
        return 0
    prompts = tiny_prompts()
    for kind in tiny_models.DRAFT_KINDS:
        rate = tiny_models.greedy_agreement(
            paths["target"], paths[f"draft-{kind}"], prompts, args.max_new_tokens
        )
        print(f"greedy agreement draft-{kind:10s} {rate:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
