#!/usr/bin/env python
"""Where a step's wall time goes in vLLM's real (multiprocess) engine, sampled with py-spy.

For each configuration an engine is started as users run it (engine core and worker in their
own processes), prompts are generated `--batch` at a time, and py-spy samples the worker's main
thread (idle time included) for the whole generation. Each sample is filed under the innermost
phase of its stack (see PHASES; the first match from the innermost frame outwards wins), so the
shares add up to the worker's wall time; times per step are shares x wall time / engine steps.

py-spy samples the engine core's main thread too: its time outside waiting (for the worker's
answer or for new requests) is the engine core's own work per step (scheduling, updating
requests from the model's output, sending outputs), which without async scheduling runs while
the worker waits. A configuration `NAME:sync` runs NAME with async scheduling off.

    .venv/bin/pip install py-spy      # not a dependency of vllm-gsd; only this script uses it
    .venv/bin/python -m scripts.profile_worker --pair qwen --configs no_spec,draft_model_k4,gsd_graph_fixed
    .venv/bin/python -m scripts.profile_worker --pair qwen --batch 8 --num-prompts 16 --configs no_spec,no_spec:sync,gsd
"""

from __future__ import annotations

import collections
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# (phase, function names that mark it). Checked from the innermost frame outwards.
PHASES = (
    ("draft: tree attention", ("attend_tree",), "propose_tree"),
    ("target: tree attention", ("attend_tree",), None),
    ("draft: LM head, top-k", ("_children",), None),
    ("draft: graph core", ("expand", "build_tree", "frontier", "select", "should_draft"), "propose_tree"),
    ("draft: layers", ("_forward", "dummy_run"), "propose_tree"),
    ("draft: other", ("propose_tree", "propose_draft_token_ids", "propose"), None),
    ("target: LM head", ("compute_logits",), None),
    ("target: layers", ("_model_forward",), None),
    ("scoring, compaction", ("_sample",), None),
    ("bookkeeping", ("_bookkeeping_sync",), None),
    ("input preparation", ("_prepare_inputs", "_update_states", "_build_attention_metadata", "_preprocess"), None),
    ("waiting for the engine core", ("sched_yield", "dequeue", "acquire_read", "wait", "recv", "poll"), None),
)

# The engine core's main thread: (phase, function names that mark it), checked the same way.
CORE_PHASES = (
    ("engine core: waiting for the worker", ("get_response", "_wait_for_response"), None),
    ("engine core: waiting for requests", ("_process_input_queue",), None),
)
CORE_BUSY = "engine core: own work"
WORKER_OTHER = "other (worker)"


def phase_of(frames: list[str], phases=PHASES, otherwise: str = WORKER_OTHER) -> str:
    """frames: function names, outermost first."""
    names = set(frames)
    for phase, markers, within in phases:
        if within is not None and within not in names:
            continue
        for frame in reversed(frames):
            if frame in markers:
                return phase
    return otherwise


def summarize(raw: Path, phases=PHASES, otherwise: str = WORKER_OTHER) -> dict[str, int]:
    """Samples per phase of the process's main thread."""
    counts: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if not frames[0].endswith(": MainThread"):  # py-spy: "thread (tid): name"
            continue
        frames = frames[1:]
        # py-spy frames read "Class.function (file:line)".
        names = [f.split(" (")[0].strip().rsplit(".", 1)[-1] for f in frames]
        counts[phase_of(names, phases, otherwise)] += int(count)
    return dict(counts)


def process_pid(title: str) -> int:
    """The one process whose title is `title` (vLLM names its processes VLLM::Worker, ...)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    pids = [int(line.split()[0]) for line in out.splitlines() if title in line]
    if len(pids) != 1:
        raise RuntimeError(f"expected one {title} process, found {pids}")
    return pids[0]


def _py_spy(py_spy: str, pid: int, raw: Path) -> subprocess.Popen:
    return subprocess.Popen([py_spy, "record", "--nonblocking", "--idle", "--threads", "--format", "raw", "--rate",
                             "100", "--pid", str(pid), "--output", str(raw)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def profile(pair, name: str, spec: dict | None, prompts: list[str], batch: int, max_tokens: int,
            mode: str, py_spy: str, async_scheduling: bool | None = None) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_gsd.testing.engines import mean_acceptance_length_of

    llm = LLM(model=pair.target, dtype=pair.dtype, max_model_len=pair.max_model_len, seed=0, max_num_seqs=batch,
              speculative_config=spec, disable_log_stats=False, **({"enforce_eager": True} if mode == "eager" else {}),
              **({"per_request_spec_decode_metrics": "summary"} if spec else {}),
              **({} if async_scheduling is None else {"async_scheduling": async_scheduling}))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:batch], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    steps_before = _engine_steps(llm)
    with tempfile.TemporaryDirectory() as tmp:
        raw, core_raw = Path(tmp) / "stacks.txt", Path(tmp) / "core_stacks.txt"
        spies = [_py_spy(py_spy, process_pid("VLLM::Worker"), raw),
                 _py_spy(py_spy, process_pid("VLLM::EngineCore"), core_raw)]
        time.sleep(1.0)  # py-spy attached
        started, outputs = time.perf_counter(), []
        for i in range(0, len(prompts), batch):
            outputs += llm.generate(prompts[i:i + batch], params, use_tqdm=False)
        wall = time.perf_counter() - started
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            spy.wait(timeout=60)
        shares = summarize(raw)
        core_shares = summarize(core_raw, CORE_PHASES, CORE_BUSY)
        if os.environ.get("GSD_KEEP_PY_SPY"):
            shutil.copy(raw, os.environ["GSD_KEEP_PY_SPY"])
            shutil.copy(core_raw, os.environ["GSD_KEEP_PY_SPY"] + ".core")
    steps = _engine_steps(llm) - steps_before
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return {"config": name, "tokens_per_s": tokens / wall, "wall_s": wall, "steps": steps,
            "mean_acceptance_length": mean_acceptance_length_of(outputs) if spec else None, "samples": shares,
            "core_samples": core_shares}


def _engine_steps(llm) -> int:
    """Engine steps so far (vLLM's iteration counter: one per forward of the batch)."""
    for metric in llm.get_metrics():
        if metric.name == "vllm:iteration_tokens_total":
            return int(metric.count)
    raise RuntimeError("vLLM's vllm:iteration_tokens_total histogram is missing")


def render(pair, mode: str, batch: int, results: list[dict], num_prompts: int, max_tokens: int) -> str:
    phases = [p for p, _, _ in PHASES] + [WORKER_OTHER]
    lines = [
        f"# Worker profile: {pair.name} pair, batch {batch}, "
        f"{'enforce_eager' if mode == 'eager' else 'vLLM default (compiled) mode'}", "",
        f"`python -m scripts.profile_worker` ({time.strftime('%Y-%m-%d')}): vLLM's multiprocess engine, {num_prompts} "
        f"prompts {batch} at a time x {max_tokens} new tokens, greedy, {pair.dtype}, draft "
        f"`{Path(pair.draft).name}`; py-spy sampled the "
        "worker's main thread at 100 Hz (without pausing it), idle included. Milliseconds per engine step by phase (the phases "
        "add up to the step's wall time).", "",
        "| config | tok/s | tokens / step | mean acc. len | ms / step | " + " | ".join(phases) + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(phases),
    ]
    for r in results:
        total = max(sum(r["samples"].values()), 1)
        step_ms = 1e3 * r["wall_s"] / max(r["steps"], 1)
        tokens_per_step = r["tokens_per_s"] * r["wall_s"] / max(r["steps"], 1)
        mal = "" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        cells = [f"{step_ms * r['samples'].get(p, 0) / total:.1f}" for p in phases]
        lines.append(f"| {r['config']} | {r['tokens_per_s']:.2f} | {tokens_per_step:.2f} | {mal} | {step_ms:.1f} | "
                     + " | ".join(cells) + " |")
    core_phases = [CORE_BUSY] + [p for p, _, _ in CORE_PHASES]
    lines += ["", "The engine core's main thread over the same generation, milliseconds per engine step:", "",
              "| config | ms / step | " + " | ".join(core_phases) + " |", "|---|---:|" + "---:|" * len(core_phases)]
    for r in results:
        total = max(sum(r["core_samples"].values()), 1)
        step_ms = 1e3 * r["wall_s"] / max(r["steps"], 1)
        cells = [f"{step_ms * r['core_samples'].get(p, 0) / total:.1f}" for p in core_phases]
        lines.append(f"| {r['config']} | {step_ms:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    from scripts.bench import configurations, emit, profiled_pair, profiling_parser

    parser = profiling_parser(__doc__, mode="default", num_prompts=4)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy")
    pair = profiled_pair(args)
    configs = configurations(pair, 4)
    results = []
    for name in args.configs.split(","):
        print(f"[profile_worker] {name}", flush=True)
        config, _, sync = name.partition(":")
        if sync not in ("", "sync"):
            raise SystemExit(f"{name}: a configuration is NAME or NAME:sync (async scheduling off)")
        results.append(profile(pair, name, configs[config], pair.prompts, args.batch, args.max_tokens, args.mode,
                               py_spy, async_scheduling=False if sync else None))
    text = render(pair, args.mode, args.batch, results, len(pair.prompts), args.max_tokens)
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
