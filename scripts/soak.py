#!/usr/bin/env python
"""Soak: thousands of mixed requests at high concurrency against the real GSD server (tiny models).

The same request mix and checks as the CI load test (tests/engine/test_serve.py, through
scripts/tools/load.py), run long: prompt lengths up to the context limit, max_tokens 1..32,
streaming and not, greedy and seeded sampling, clients hanging up mid-stream, optionally a KV
cache small enough to force preemptions. Meanwhile the RSS of the server's process tree (API
server, engine core, worker) is sampled, and its growth per 1000 requests after a warm-up is fitted.
The server runs with jemalloc preloaded (--allocator glibc for glibc's malloc, under which the
worker's RSS climbs for ~12000 requests before levelling off); --speculation none runs the same
load on the target alone, the baseline for the memory curve.

    .venv/bin/python -m scripts.soak                          # 4000 requests, 256 in flight
    .venv/bin/python -m scripts.soak --requests 500 --out /tmp/soak
    .venv/bin/python -m scripts.soak --speculation none --allocator glibc --out /tmp/baseline

Greedy outputs are compared with an offline target-only engine (float32, same tokens), seeded
ones with an offline GSD engine in a quiet batch (seeded text does not depend on the batch). Writes
<out>/results.md and <out>/results.json; exits 1 if any request failed, a greedy one mismatched, the
server was unhealthy, it kept requests after the load, or memory grew faster than
--max-growth-mib-per-1k.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
PROMPT_LENGTHS = (4, 16, 48, 120, 250)
KV_BLOCK_SIZE = 32


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    parser.add_argument("--kv-blocks", type=int, default=480,
                        help="KV cache blocks of 32 slots (--num-gpu-blocks-override): small "
                             "enough to preempt requests at this concurrency; 0 = vLLM's default")
    parser.add_argument("--sample-every-s", type=float, default=2.0, help="RSS sampling interval")
    parser.add_argument("--warmup-fraction", type=float, default=0.25,
                        help="requests left out of the memory fit (allocator and cache warm-up)")
    parser.add_argument("--max-growth-mib-per-1k", type=float, default=5.0)
    parser.add_argument("--speculation", choices=("gsd", "none"), default="gsd",
                        help="none: the same load on the target alone (a baseline for the memory curve)")
    parser.add_argument("--allocator", choices=("jemalloc", "glibc"), default="jemalloc",
                        help="the server's malloc: jemalloc (from the ray wheel, preloaded, as vLLM's CPU "
                             "build expects a preloaded allocator) or glibc's")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "soak")
    return parser.parse_args()


def seeded(request) -> bool:
    """A sampled request with a seed: its text is compared with a quiet offline batch."""
    return not request.greedy and request.seed is not None


def offline_references(target: str, spec: dict | None, mix) -> dict:
    """Greedy requests: the target alone; seeded ones: the served configuration in a quiet
    offline batch."""
    from scripts.tools.load import references
    from vllm_gsd.testing.engines import make_llm

    refs = {}
    for engine_spec, requests in ((None, [r for r in mix if r.greedy]), (spec, [r for r in mix if seeded(r)])):
        if not requests:
            continue
        llm = make_llm(target, engine_spec)
        try:
            refs.update(references(llm, requests))
        finally:
            llm.llm_engine.engine_core.shutdown()
    return refs


def soak(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from scripts.tools import load
    from scripts.tools.memory import RssSampler, growth_per_1k
    from scripts.tools.server import jemalloc_library, scrape_metrics, serve, wait_drained
    from vllm_gsd.testing.engines import gsd_config
    from vllm_gsd.testing.tiny_models import tiny_draft, tiny_target

    target, draft = str(tiny_target()), str(tiny_draft("perturbed"))
    tokenizer = AutoTokenizer.from_pretrained(target)
    pool = load.prompt_pool(tokenizer, PROMPT_LENGTHS, per_length=8)
    mix = load.build_requests(pool, args.requests, seed=args.seed)
    if args.speculation == "none":
        # vLLM 0.32's own CPU sampler fails on a seeded request whose prefill is chunked
        # ("CPU Generator does not use offset", gpu_model_runner._bookkeeping_sync), which kills
        # the engine; the baseline samples those requests unseeded and compares only greedy ones.
        mix = [dataclasses.replace(r, seed=None) for r in mix]
    spec = gsd_config(draft) if args.speculation == "gsd" else None
    print(f"soak: {len(mix)} requests, offline references...", flush=True)
    references = offline_references(target, spec, mix)

    server_args = list(load.SERVER_ARGS)
    if args.kv_blocks:
        # Small blocks: decoding requests need new ones often, so a full cache preempts them.
        server_args += ["--num-gpu-blocks-override", str(args.kv_blocks), "--block-size", str(KV_BLOCK_SIZE)]
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = Path(tempfile.gettempdir()) / "vllm-gsd-soak-server.log"
    preload = jemalloc_library() if args.allocator == "jemalloc" else None
    with serve(target, spec, log_path, server_args, preload=preload) as server:
        before = scrape_metrics(server.url)
        done = 0

        def count(result) -> None:
            nonlocal done
            done += 1
            if done % 500 == 0:
                print(f"soak: {done}/{len(mix)} done", flush=True)

        with RssSampler(server.process.pid, lambda: done, args.sample_every_s) as sampler:
            report = load.run_load(server.url, target, mix, args.concurrency, on_done=count)
        try:
            after, drained = wait_drained(server.url), True
        except TimeoutError:
            after, drained = scrape_metrics(server.url), False
        alive = server.process.poll() is None
        log_has_traceback = "Traceback" in server.log_tail(10**9)

    problems = load.problems(mix, report)
    greedy_wrong = load.mismatches([r for r in mix if r.greedy],
                                   [x for r, x in zip(mix, report.results) if r.greedy], references)
    seeded_wrong = load.mismatches([r for r in mix if seeded(r)],
                                   [x for r, x in zip(mix, report.results) if seeded(r)], references)
    first, last = sampler.samples[0], sampler.samples[-1]
    growth = growth_per_1k(sampler.samples, int(args.warmup_fraction * len(mix)))

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    return {
        "requests": len(mix),
        "concurrency": args.concurrency,
        "served": report.served,
        "aborted": report.aborted,
        "client_hang_ups_planned": sum(r.disconnects for r in mix),
        "greedy": sum(r.greedy for r in mix),
        "sampled": sum(not r.greedy for r in mix),
        "seeded": sum(seeded(r) for r in mix),
        "streaming": sum(r.stream for r in mix),
        "preempted": int(delta("vllm:num_preemptions_total")),
        "greedy_mismatches": len(greedy_wrong),
        "seeded_differences": len(seeded_wrong),
        "problems": len(problems),
        "peak_in_flight": report.peak_in_flight,
        "server_peak_running": report.server.peak_running,
        "health_checks": report.server.health_checks,
        "health_failures": len(report.server.health_failures),
        "drained": drained,
        "server_alive": alive,
        "server_log_traceback": log_has_traceback,
        "trees_verified": int(delta("vllm:gsd_trees_verified_total")),
        "accepted_nodes": int(delta("vllm:gsd_accepted_nodes_total")),
        "output_tokens": sum(len(r.token_ids) for r in report.results),
        "wall_s": round(report.wall_s, 1),
        "rss_start_mib": round(first.total / 2**20, 1),
        "rss_end_mib": round(last.total / 2**20, 1),
        "rss_growth_mib_per_1k_requests": round(growth, 3),
        "rss_by_process_start_mib": {k: round(v / 2**20, 1) for k, v in first.rss_by_process.items()},
        "rss_by_process_end_mib": {k: round(v / 2**20, 1) for k, v in last.rss_by_process.items()},
        "rss_samples": [(round(s.elapsed_s, 1), s.requests_done, round(s.total / 2**20, 1))
                        for s in sampler.samples],
        "first_problems": (problems + greedy_wrong + seeded_wrong)[:20],
        "kv_blocks": args.kv_blocks or None,
        "server_log": str(log_path),
        "speculative_config": spec,
        "allocator": "jemalloc (preloaded)" if preload or "jemalloc" in os.environ.get("LD_PRELOAD", "")
                     else "glibc malloc",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def failed_checks(result: dict, max_growth: float) -> list[str]:
    """The pass criteria this result misses (empty: it passes)."""
    checks = [
        (result["problems"] == 0, f"{result['problems']} requests failed"),
        (result["greedy_mismatches"] == 0, f"{result['greedy_mismatches']} greedy mismatches"),
        (result["drained"], "requests held after the load"),
        (result["server_alive"] and not result["server_log_traceback"], "server died or logged a traceback"),
        (result["served"] + result["aborted"] == result["requests"], "requests neither served nor aborted"),
        (result["rss_growth_mib_per_1k_requests"] <= max_growth,
         f"RSS growth {result['rss_growth_mib_per_1k_requests']} > {max_growth} MiB per 1000 requests"),
    ]
    return [message for ok, message in checks if not ok]


def markdown(result: dict, failed: list[str], command: str) -> str:
    rows = [
        ("requests sent", result["requests"]),
        ("concurrency (client, in flight at most)", f"{result['concurrency']} ({result['peak_in_flight']})"),
        ("running in the server at most (sampled)", result["server_peak_running"]),
        ("served (finish_reason received)", result["served"]),
        ("aborted (client hung up mid-stream)", f"{result['aborted']} of {result['client_hang_ups_planned']} planned"),
        ("greedy / sampled / streaming", f"{result['greedy']} / {result['sampled']} / {result['streaming']}"),
        (f"preempted (KV cache: {result['kv_blocks'] or 'default'} blocks of {KV_BLOCK_SIZE})", result["preempted"]),
        ("greedy mismatches against the target alone (must be 0)", result["greedy_mismatches"]),
        ("seeded requests whose text differs from a quiet offline GSD batch",
         f"{result['seeded_differences']} of {result['seeded']}"),
        ("other problems (errors, short outputs, failed health checks)", result["problems"]),
        ("/health checks during the load", f"{result['health_checks']}, {result['health_failures']} failed"),
        ("requests held after the load", "none" if result["drained"] else "SOME"),
        ("trees verified / accepted nodes", f"{result['trees_verified']} / {result['accepted_nodes']}"),
        ("output tokens, wall time", f"{result['output_tokens']}, {result['wall_s']} s"),
        ("server RSS start -> end", f"{result['rss_start_mib']} -> {result['rss_end_mib']} MiB"),
        ("RSS growth after warm-up", f"{result['rss_growth_mib_per_1k_requests']} MiB per 1000 requests"),
    ]
    lines = [
        "# Soak: the GSD server under load" if result["speculative_config"] else "# Soak baseline: the target alone",
        "",
        f"`{command}` on {result['machine']}, {result['date']}. Result: "
        + ("**PASS**." if not failed else f"**FAIL** ({'; '.join(failed)})."),
        "",
        "| figure | value |",
        "|---|---|",
        *[f"| {name} | {value} |" for name, value in rows],
        "",
        "RSS at the end, per process (MiB): "
        + ", ".join(f"{name} {mib}" for name, mib in result["rss_by_process_end_mib"].items()) + ".",
        "",
        "Tiny models (vllm_gsd/testing/tiny_models.py), float32, "
        + (f"speculative config `{json.dumps(spec['gsd'])}` with {spec['num_speculative_tokens']} nodes"
           if (spec := result["speculative_config"]) else "no speculation (the baseline)")
        + f", allocator {result['allocator']}. RSS samples (seconds, requests done, MiB) are in results.json.",
    ]
    if result["first_problems"]:
        lines += ["", "First problems:", "", *[f"- {p}" for p in result["first_problems"]]]
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse_args()
    result = soak(args)
    failed = failed_checks(result, args.max_growth_mib_per_1k)
    command = ("python -m scripts.soak " + " ".join(sys.argv[1:])).strip()
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "results.md").write_text(markdown(result, failed, command))
    print(markdown(result, failed, command))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
