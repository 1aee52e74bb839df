"""CPU cost of one GSD step's graph work: drafting bookkeeping (all levels, including the draft
ancestor words the engine reads for each draft forward) + build_tree + acceptance (walk_tree on
the target's tokens), on synthetic draft top-k (random softmaxes). The draft/target forwards are
not timed, nor is the target's argmax over its logits (vLLM's sampler computes it; reported apart).

    python scripts/bench_graph.py [--batch 64] [--budget 64] [--top-k 4] [--max-depth 6]
    python scripts/bench_graph.py --repeats 5 --out docs/bench/graph.md   # the committed result
    python scripts/bench_graph.py --baseline e5bb6cf   # against the graph core of a commit

A shared VM's speed drifts (by up to 1.75x within minutes here), so absolute figures of runs
minutes apart differ; --baseline takes steps in turns with vllm_gsd/graph as it was at a git
commit, in this process, and reports the ratio, which the drift cannot skew.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import vllm_gsd.graph as graph_core
from vllm_gsd.graph import GraphParams, walk_tree


def synthetic_inputs(params: GraphParams, batch: int, vocab: int, seed: int):
    """Pre-drawn top-k tables so the timed loop measures only the graph code."""
    generator = torch.Generator().manual_seed(seed)
    rows = batch * (params.node_budget + 1)
    probs = torch.softmax(torch.randn(params.max_depth, rows, vocab, generator=generator) * 3.0, -1)
    top_probs, top_ids = probs.topk(params.top_k, dim=-1)
    roots = torch.randint(0, vocab, (batch,), generator=generator)
    history = torch.randint(0, vocab, (batch, 4), generator=generator)
    logits = torch.randn(batch, params.node_budget + 1, vocab, generator=generator)
    return top_ids, top_probs, roots, history, logits


def draft_levels(params, top_ids, top_probs, roots, history, core=graph_core):
    """The builder (of the graph package `core`) driven as the engine drives it: per level the
    frontier, the draft ancestor words (for the draft forward, which levels >= 1 take: level 0's
    top-k comes from the target's own logits at the root) and expand."""
    builder = core.GraphBuilder(params, roots, history)
    level = 0
    while (frontier := builder.frontier()) is not None:
        if level:
            builder.draft_ancestor_words  # the engine hands these to the draft forward
        count = frontier.request_index.numel()
        builder.expand(top_ids[level, :count], top_probs[level, :count])
        level += 1
    return builder, level


def one_step(params, top_ids, top_probs, roots, history, target_logits):
    builder, level = draft_levels(params, top_ids, top_probs, roots, history)
    tree = builder.build_tree()
    walk_tree(tree.draft_token_ids, tree.parent_row, tree.num_nodes, target_logits.argmax(-1))
    return tree, level


def measure(params, inputs, target, runs: int) -> dict[str, list[float]]:
    """CPU seconds of `runs` steps: the total, each phase, and (apart) the target argmax."""
    top_ids, top_probs, roots, history, logits = inputs
    times = {"step": [], "draft levels": [], "build_tree": [], "walk_tree": [], "argmax": [], "wall": []}
    for _ in range(runs):
        c0, w0 = time.process_time(), time.perf_counter()
        builder, _ = draft_levels(params, top_ids, top_probs, roots, history)
        c1 = time.process_time()
        tree = builder.build_tree()
        c2 = time.process_time()
        walk_tree(tree.draft_token_ids, tree.parent_row, tree.num_nodes, target)
        c3, w3 = time.process_time(), time.perf_counter()
        logits.argmax(-1)
        times["argmax"].append(time.process_time() - c3)
        for name, seconds in (("step", c3 - c0), ("draft levels", c1 - c0), ("build_tree", c2 - c1),
                              ("walk_tree", c3 - c2), ("wall", w3 - w0)):
            times[name].append(seconds)
    return times


def baseline_graph(commit: str):
    """vllm_gsd/graph as it was at `commit`, imported as a separate package (its modules import
    each other relatively)."""
    repo = Path(__file__).resolve().parents[1]
    root = Path(tempfile.mkdtemp(prefix="graph-baseline-"))
    archive = subprocess.run(["git", "-C", str(repo), "archive", commit, "vllm_gsd/graph"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    (root / "vllm_gsd" / "graph").rename(root / "baseline_graph")
    sys.path.insert(0, str(root))
    return importlib.import_module("baseline_graph")


def compare(params, inputs, target, runs: int, commit: str) -> list[str]:
    """CPU seconds of whole steps (drafting, build_tree, walk_tree) in turns with the commit's
    graph core on the same inputs: the medians and their ratio."""
    old = baseline_graph(commit)
    old_params = old.GraphParams(**vars(params))
    cores = (("this", graph_core, params), (commit, old, old_params))
    top_ids, top_probs, roots, history, _ = inputs
    times: dict[str, list[float]] = {name: [] for name, _, _ in cores}
    for step in range(runs + 10):
        for name, core, core_params in cores:
            c0 = time.process_time()
            builder, _ = draft_levels(core_params, top_ids, top_probs, roots, history, core)
            tree = builder.build_tree()
            core.walk_tree(tree.draft_token_ids, tree.parent_row, tree.num_nodes, target)
            if step >= 10:  # (the first steps compile and warm up)
                times[name].append(time.process_time() - c0)
    this, then = (statistics.median(times[name]) * 1e3 for name, _, _ in cores)
    return [f"in turns with the graph core of {commit}, {runs} steps each: this {this:.3f} ms, "
            f"{commit} {then:.3f} ms per step (medians): ratio {this / then:.3f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--max-depth", type=int, default=6)
    parser.add_argument("--merge-ngram", type=int, default=1)
    parser.add_argument("--min-child-ratio", type=float, default=0.0)
    parser.add_argument("--leaf-prob", type=float, default=0.0)
    parser.add_argument("--vocab", type=int, default=32, help="small vocab so merges happen")
    parser.add_argument("--runs", type=int, default=200, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=1,
                        help="repeat the timed loop (a shared VM drifts; each repeat's median is shown)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    parser.add_argument("--baseline", default=None,
                        help="also time the graph core of this git commit, steps in turns (see above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = GraphParams(node_budget=args.budget, top_k=args.top_k, max_depth=args.max_depth,
                         merge_ngram=args.merge_ngram, min_child_ratio=args.min_child_ratio,
                         leaf_prob=args.leaf_prob)
    inputs = synthetic_inputs(params, args.batch, args.vocab, 0)
    target = inputs[-1].argmax(-1)  # the target's greedy tokens per row (the sampler's work)
    for _ in range(10):
        tree, level = one_step(params, *inputs)
    repeats = [measure(params, inputs, target, args.runs) for _ in range(args.repeats)]
    every = {name: [s for times in repeats for s in times[name]] for name in repeats[0]}
    ms = lambda values: statistics.median(values) * 1e3  # noqa: E731
    lines = [
        f"B={args.batch} N={args.budget} top_k={args.top_k} max_depth={args.max_depth} "
        f"merge_ngram={args.merge_ngram} vocab={args.vocab} threads={args.threads}, "
        f"{args.repeats} x {args.runs} steps",
        f"levels={level} graph nodes/request={tree.num_graph_nodes.float().mean():.1f} "
        f"tree nodes/request={tree.num_nodes.float().mean():.1f} "
        f"merges/request={tree.num_merges.float().mean():.2f}",
        f"per step: CPU (process_time) median {ms(every['step']):.3f} ms "
        f"(min {min(every['step']) * 1e3:.3f}), wall median {ms(every['wall']):.3f} ms",
    ]
    if args.repeats > 1:
        lines.append("  median of each repeat: " + ", ".join(f"{ms(times['step']):.3f}" for times in repeats) + " ms")
    for name in ("draft levels", "build_tree", "walk_tree"):
        lines.append(f"  {name:>12}: CPU median {ms(every[name]):.3f} ms (min {min(every[name]) * 1e3:.3f})")
    lines.append(f"  not counted: target argmax over [B, N+1, V] logits: CPU median {ms(every['argmax']):.3f} ms")
    if args.baseline is not None:
        lines += compare(params, inputs, target, args.runs * args.repeats, args.baseline)
    print("\n".join(lines))
    if args.out is not None:
        command = "python scripts/bench_graph.py " + " ".join(sys.argv[1:])
        args.out.write_text(f"# Graph core CPU cost\n\n`{command}` on {platform.machine()}, {os.cpu_count()} cores, "
                            f"{time.strftime('%Y-%m-%d %H:%M')}\n\n```\n" + "\n".join(lines) + "\n```\n")


if __name__ == "__main__":
    main()
