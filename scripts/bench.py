#!/usr/bin/env python
"""Benchmark: GSD against no speculation, vLLM's ngram and vLLM's draft_model chain, in one run.

Every configuration runs the same target/draft pair, the same prompts and the same machine; each
gets its own engine, reused across batch sizes. For batch size b the prompts are generated b at a
time (b requests in flight). Greedy outputs of every configuration are checked token-identical to
no speculation.

    .venv/bin/python -m scripts.bench --pair qwen            # the realistic pair (downloads ~1.6 GB once)
    .venv/bin/python -m scripts.bench --quick                # tiny pair, every workload (CI smoke test)
    .venv/bin/python -m scripts.bench --workloads plain,json,penalty   # request options (see WORKLOADS)

(from the repository root, as every script that imports the scripts package).

Writes <out>/results.md (one table, ratios to no speculation), <out>/results.json and, when
matplotlib is present, <out>/tokens_per_s.png and <out>/acceptance_length.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# One worker using both cores (the default binding leaves one idle on a 2-core machine).
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    config: str
    batch: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    tpot_ms: float | None = None  # decode time per output token after each request's first
    mean_acceptance_length: float | None = None
    draft_tokens_per_accepted: float | None = None
    nodes_per_step: float | None = None
    plain_step_share: float | None = None  # share of steps the adaptive budget ran without drafting
    step_ms: dict | None = None  # GSD's per-decode-step time split (target, draft, verify, compaction)
    whole_step_ms: dict | None = None  # GSD's whole decode steps: drafted ms, its tokens, plain ms
    merges: int | None = None
    draft_expansions_saved: int | None = None
    lookup_nodes: str | None = None  # context-lookup nodes (GSD): accepted / tried / verified
    identical_to_no_spec: bool | None = None
    identical_prompts: str | None = None  # "k/n": prompts whose output equals no speculation's, worst round
    ratio_to_no_spec: float | None = None
    tpot_ratio: float | None = None  # no speculation's time per output token over this one's
    group_seconds: list[float] | None = None  # --interleave: seconds of each prompt group, in order
    notes: str = ""
    workload: str = "plain"  # the requests' options (WORKLOADS)


@dataclass
class Pair:
    name: str
    target: str
    draft: str
    dtype: str
    max_model_len: int
    prompts: list[str] = field(default_factory=list)
    json_prompts: list[str] = field(default_factory=list)  # the same questions, answered as JSON


# What a request asks, beside its prompt. "plain": greedy, exactly max_tokens. "penalty": the same
# with repetition_penalty 1.1 (a chat server's common setting). "json": the question asked as
# JSON extraction (JSON_INSTRUCTION) under the JSON schema JSON_SCHEMA (vLLM's structured output),
# stopping where the JSON ends.
WORKLOADS = ("plain", "penalty", "json")
JSON_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["topic", "language", "difficulty", "key_points", "answer"],
    "properties": {
        "topic": {"type": "string"},
        "language": {"type": "string"},
        "difficulty": {"enum": ["easy", "medium", "hard"]},
        "key_points": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "answer": {"type": "string"},
    },
}
JSON_INSTRUCTION = ("\n\nDo not answer in prose. Reply with one JSON object with the fields topic, "
                    "language, difficulty (easy, medium or hard), key_points (at most 3 strings) and "
                    "answer (a short answer).")


def sampling_params(workload: str, max_tokens: int):
    """The SamplingParams of a workload's requests (greedy)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    if workload == "json":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                              structured_outputs=StructuredOutputsParams(json=JSON_SCHEMA))
    penalty = {"repetition_penalty": 1.1} if workload == "penalty" else {}
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **penalty)


def resolve_pair(name: str, num_prompts: int, prompt_offset: int = 0) -> Pair:
    if name == "tiny":
        from vllm_gsd.testing.prompts import tiny_prompts
        from vllm_gsd.testing.tiny_models import tiny_draft, tiny_target

        texts = tiny_prompts(num_prompts)
        return Pair("tiny", str(tiny_target()), str(tiny_draft("perturbed")), "float32", 1024, texts,
                    [t + JSON_INSTRUCTION for t in texts])
    if name == "qwen":
        from scripts.tools import prompt_sets
        from scripts.tools.real_models import prepare_pair

        pair = prepare_pair("qwen")
        half = (num_prompts + 1) // 2
        questions = (prompt_sets.humaneval_prompts(half, offset=prompt_offset)
                     + prompt_sets.mtbench_prompts(num_prompts - half, offset=prompt_offset))
        texts = prompt_sets.as_chat(pair.target, questions)
        json_texts = prompt_sets.as_chat(pair.target, [q + JSON_INSTRUCTION for q in questions])
        return Pair("qwen", str(pair.target), str(pair.draft), "bfloat16", 2048, texts, json_texts)
    raise SystemExit(f"unknown pair {name!r}: use tiny or qwen")


def configurations(pair: Pair, depth: int) -> dict[str, dict | None]:
    gsd_knobs = {"top_k": 3, "max_depth": depth, "min_child_ratio": 0.1, "leaf_prob": 0.05}
    fixed = {**gsd_knobs, "adaptive": False}
    return {
        "no_spec": None,
        "ngram_k4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
        "draft_model_k2": {"method": "draft_model", "model": pair.draft, "num_speculative_tokens": 2},
        "draft_model_k4": {"method": "draft_model", "model": pair.draft, "num_speculative_tokens": 4},
        "draft_model_k6": {"method": "draft_model", "model": pair.draft, "num_speculative_tokens": 6},
        # What users get: the README's `LLM(...)` example (adaptive budget, default knobs).
        "gsd": {"method": "gsd", "model": pair.draft, "num_speculative_tokens": 24},
        # The default knobs with a smaller node budget (the most nodes verified per request).
        "gsd_n6": {"method": "gsd", "model": pair.draft, "num_speculative_tokens": 6},
        "gsd_n9": {"method": "gsd", "model": pair.draft, "num_speculative_tokens": 9},
        # The default knobs without context-lookup nodes (engine/lookup.py).
        "gsd_no_lookup": {"method": "gsd", "model": pair.draft, "num_speculative_tokens": 24,
                          "gsd": {"lookup_nodes": 0}},
        # The default knobs with the draft's head over the whole vocabulary (engine/draft_head.py).
        "gsd_whole_vocab": {"method": "gsd", "model": pair.draft, "num_speculative_tokens": 24,
                            "gsd": {"draft_vocab": 0}},
        # The same with the draft's LM head as loaded (on CPU the default runs an int8 copy of it).
        "gsd_model_head": {"method": "gsd", "model": pair.draft, "num_speculative_tokens": 24,
                           "gsd": {"int8_draft_head": False}},
        # The adaptive node budget with the benchmark's smaller tree knobs (N = 24).
        "gsd_tree": {"method": "gsd", "model": pair.draft, "num_speculative_tokens": 24,
                     "gsd": {**gsd_knobs, "merge_ngram": -1}},
        "gsd_graph": {"method": "gsd", "model": pair.draft, "num_speculative_tokens": 24,
                      "gsd": {**gsd_knobs, "merge_ngram": 1}},
        # The same graph with a fixed budget of 12 nodes and every level drafted.
        "gsd_graph_fixed": {"method": "gsd", "model": pair.draft, "num_speculative_tokens": 12,
                            "gsd": {**fixed, "merge_ngram": 1}},
    }


DEFAULT_CONFIGS = "no_spec,draft_model_k2,draft_model_k4,draft_model_k6,gsd,gsd_graph_fixed"


def prompt_token_ids(pair: Pair, max_tokens: int, workload: str = "plain") -> list[list[int]]:
    """The pair's prompts for a workload as the target's token ids, each cut to leave room for
    max_tokens (a JSON prompt is cut before its instruction, which it keeps)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair.target)
    limit = pair.max_model_len - max_tokens - 64
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"]
           for p in (pair.json_prompts if workload == "json" else pair.prompts)]
    return [p if len(p) <= limit else p[:limit // 2] + p[len(p) - (limit - limit // 2):] for p in ids]


def start_engine(pair: Pair, spec: dict | None, max_batch: int, mode: str = "default", **engine_args):
    """An engine for one configuration, warmed up on a short request (engine_args: more of
    LLM's arguments)."""
    from vllm import LLM, SamplingParams

    # Request stats on: their token timestamps give the decode time per token (tpot_of).
    llm = LLM(model=pair.target, dtype=pair.dtype, max_model_len=pair.max_model_len, seed=0,
              max_num_seqs=max_batch, speculative_config=spec, disable_log_stats=False,
              **({"enforce_eager": True} if mode == "eager" else {}),
              **({"per_request_spec_decode_metrics": "summary"} if spec else {}), **engine_args)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    return llm


def stop_engine(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def generate_timed(llm, prompts: list, max_tokens: int, workload: str = "plain") -> tuple[list, float]:
    """(RequestOutputs, seconds) of one generate call (greedy; exactly max_tokens each but for
    the json workload, which stops where its JSON ends)."""
    params = sampling_params(workload, max_tokens)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, time.perf_counter() - start


def tpot_of(outs: list) -> float | None:
    """Milliseconds per output token after the first, over all requests (vLLM's TPOT): the
    decode phase alone, where the prompt's prefill (the same work with or without speculation)
    is left out. None where the engine kept no request stats."""
    spans = [(o.metrics.last_token_ts - o.metrics.first_token_ts, len(o.outputs[0].token_ids) - 1)
             for o in outs if getattr(o, "metrics", None) is not None]
    tokens = sum(n for _, n in spans)
    return round(1e3 * sum(s for s, _ in spans) / tokens, 1) if spans and tokens else None


def describe_run(name: str, spec: dict | None, batch: int, outs: list, seconds: float,
                 stats_before, stats_after) -> Row:
    """A Row from the outputs and time of a configuration at one batch size; stats_before/after:
    the engine's GSD figures around the run (None unless gsd)."""
    from vllm_gsd.testing.engines import acceptance_of

    tokens = [list(o.outputs[0].token_ids) for o in outs]
    total = sum(len(t) for t in tokens)
    row = Row(name, batch, total, round(seconds, 2), round(total / seconds, 2), tpot_of(outs))
    if not spec:
        return row
    drafts, accepted_drafts = acceptance_of(outs)
    row.mean_acceptance_length = round(1.0 + accepted_drafts / max(drafts, 1), 2)
    if stats_before is None:
        draft_tokens = sum(c.spec_decode_metrics.num_draft_tokens for o in outs for c in o.outputs
                           if c.spec_decode_metrics is not None)
        row.nodes_per_step = round(draft_tokens / max(drafts, 1), 1)
        return row
    delta = {k: getattr(stats_after, k) - getattr(stats_before, k) for k in vars(stats_after)}
    row.draft_tokens_per_accepted = round(delta["draft_tokens_computed"] / max(total, 1), 2)
    row.nodes_per_step = round(delta["nodes_verified"] / max(delta["trees_verified"], 1), 1)
    decided = delta["steps_speculated"] + delta["steps_not_speculated"]
    row.plain_step_share = round(delta["steps_not_speculated"] / max(decided, 1), 2)
    row.step_ms = {phase: round(delta[f"{phase}_us"] / 1e3 / max(delta["decode_steps"], 1), 1)
                   for phase in ("target_forward", "draft_step", "draft_model", "draft_logits",
                                 "verify", "kv_compaction")}
    drafted, plain = max(delta["speculative_steps_timed"], 1), max(delta["plain_steps_timed"], 1)
    row.whole_step_ms = {"drafted": round(delta["speculative_step_us"] / 1e3 / drafted, 1),
                         "drafted_tokens": round(delta["speculative_step_tokens"] / drafted, 2),
                         "plain": round(delta["plain_step_us"] / 1e3 / plain, 1) if delta["plain_steps_timed"] else None}
    row.merges = delta["merges"]
    row.draft_expansions_saved = delta["draft_expansions_saved"]
    row.lookup_nodes = (f"{delta['lookup_nodes_accepted']} / {delta['lookup_nodes_tried']} / "
                        f"{delta['lookup_nodes_proposed']}")
    return row


def _gsd_stats_of(llm, spec):
    from vllm_gsd.engine.metrics import gsd_stats

    return gsd_stats(llm) if spec and spec["method"] == "gsd" else None


def run_config(pair: Pair, name: str, spec: dict | None, batches: list[int], max_tokens: int,
               prompt_token_ids: dict[str, list[list[int]]], batch1_prompts: int, mode: str = "default"
               ) -> tuple[list[Row], dict[tuple[str, int], list[list[int]]]]:
    """One configuration on its own engine, every workload (prompt_token_ids: the prompts of
    each) and batch size in turn. Outputs keyed by (workload, batch)."""
    llm = start_engine(pair, spec, max(batches), mode)
    rows, outputs = [], {}
    for workload, workload_ids in prompt_token_ids.items():
        prompts = [{"prompt_token_ids": ids} for ids in workload_ids]
        for batch in batches:
            stats_before = _gsd_stats_of(llm, spec)
            # Batch 1 is the slowest to measure: it runs on the first prompts only.
            run_prompts = prompts[:batch1_prompts] if batch == 1 else prompts
            outs, seconds = [], 0.0
            for i in range(0, len(run_prompts), batch):
                chunk_outs, chunk_seconds = generate_timed(llm, run_prompts[i:i + batch], max_tokens, workload)
                outs, seconds = outs + chunk_outs, seconds + chunk_seconds
            outputs[workload, batch] = [list(o.outputs[0].token_ids) for o in outs]
            row = describe_run(name, spec, batch, outs, seconds, stats_before, _gsd_stats_of(llm, spec))
            row.workload = workload
            rows.append(row)
            print(f"  {name:16s} {workload:8s} batch {batch:3d}: {row.tokens_per_s:8.2f} tok/s"
                  + (f", mean acceptance length {row.mean_acceptance_length}" if spec else ""), flush=True)
    stop_engine(llm)
    return rows, outputs


def run_interleaved(pair: Pair, configs: dict[str, dict | None], batches: list[int], max_tokens: int,
                    prompt_token_ids: dict[str, list[list[int]]], batch1_prompts: int, mode: str, round_index: int
                    ) -> list[tuple[Row, list[list[int]]]]:
    """Every configuration on its own engine, all alive at once; each group of `batch` prompts is
    generated by every engine in turn, the order rotating from group to group, so that the
    machine's drift (this VM's speed swings by up to 2x within minutes) falls on every
    configuration alike. Returns (row, outputs) per configuration, workload and batch size."""
    engines = {name: start_engine(pair, spec, max(batches), mode) for name, spec in configs.items()}
    names = list(configs)
    results = []
    try:
        for workload, workload_ids in prompt_token_ids.items():
            prompts = [{"prompt_token_ids": ids} for ids in workload_ids]
            for batch in batches:
                run_prompts = prompts[:batch1_prompts] if batch == 1 else prompts
                before = {name: _gsd_stats_of(engines[name], configs[name]) for name in names}
                outs = {name: [] for name in names}
                group_seconds = {name: [] for name in names}
                for k, i in enumerate(range(0, len(run_prompts), batch)):
                    shift = (k + round_index) % len(names)
                    for name in names[shift:] + names[:shift]:
                        chunk_outs, chunk_seconds = generate_timed(engines[name], run_prompts[i:i + batch],
                                                                   max_tokens, workload)
                        outs[name] += chunk_outs
                        group_seconds[name].append(chunk_seconds)
                for name in names:
                    row = describe_run(name, configs[name], batch, outs[name], sum(group_seconds[name]),
                                       before[name], _gsd_stats_of(engines[name], configs[name]))
                    row.workload = workload
                    row.group_seconds = [round(t, 3) for t in group_seconds[name]]
                    results.append((row, [list(o.outputs[0].token_ids) for o in outs[name]]))
                    print(f"  {name:16s} {workload:8s} batch {batch:3d}: {row.tokens_per_s:8.2f} tok/s"
                          + (f", mean acceptance length {row.mean_acceptance_length}" if configs[name] else ""),
                          flush=True)
    finally:
        for llm in engines.values():
            stop_engine(llm)
    return results


def _median_over_rounds(measured, reference, config: str, workload: str, batch: int, rounds: int) -> Row:
    """The round with the median tokens/s of (config, workload, batch), its ratio to no
    speculation the median of the per-round ratios; every round's figures in its notes."""
    measured = [(r, row, out) for r, row, out in measured if row.workload == workload]
    reference = reference[workload]
    mine = [(r, row, out) for r, row, out in measured if row.config == config and row.batch == batch]
    base = {r: row.tokens_per_s for r, row, _ in measured if row.config == "no_spec" and row.batch == batch}
    ratios = [round(row.tokens_per_s / base[r], 2) for r, row, _ in mine]
    by_speed = sorted(mine, key=lambda m: m[1].tokens_per_s)
    row = by_speed[(len(by_speed) - 1) // 2][1]
    row.ratio_to_no_spec = round(statistics.median(ratios), 2)
    base_tpot = {r: other.tpot_ms for r, other, _ in measured if other.config == "no_spec" and other.batch == batch}
    tpot_ratios = [round(base_tpot[r] / mine_row.tpot_ms, 2) for r, mine_row, _ in mine
                   if mine_row.tpot_ms and base_tpot.get(r)]
    row.tpot_ratio = round(statistics.median(tpot_ratios), 2) if tpot_ratios else None
    if config != "no_spec":
        row.identical_to_no_spec = all(out == reference[batch] for _, _, out in mine)
        same = min(sum(a == b for a, b in zip(out, reference[batch])) for _, _, out in mine)
        row.identical_prompts = f"{same}/{len(reference[batch])}"
    if len(mine) > 1:
        row.notes = (f"runs: {', '.join(str(m[1].tokens_per_s) for m in mine)} tok/s; "
                     f"x no-spec {', '.join(map(str, ratios))}"
                     + (f"; TPOT x no-spec {', '.join(map(str, tpot_ratios))}" if tpot_ratios else ""))
    group_ratios = _group_ratios(measured, mine, batch)
    if config != "no_spec" and len(group_ratios) > 1:
        row.notes += ("; " if row.notes else "") + (
            f"per prompt group (run back to back with no speculation's, the same prompts): median x no-spec "
            f"{statistics.median(group_ratios):.2f} over {len(group_ratios)} groups "
            f"({min(group_ratios):.2f} to {max(group_ratios):.2f})")
    return row


def _group_ratios(measured, mine, batch: int) -> list[float]:
    """No speculation's seconds over the configuration's, per prompt group of every run (the same
    tokens: a tokens/s ratio). A group's two runs follow each other within seconds, so this VM's
    drift, which swings whole rounds by 0.2 or more, cancels better than in a round's sums."""
    base = {r: row.group_seconds for r, row, _ in measured
            if row.config == "no_spec" and row.batch == batch and row.group_seconds}
    return [b / t for r, row, _ in mine if row.group_seconds and r in base
            for b, t in zip(base[r], row.group_seconds)]


def write_results(out_dir: Path, pair: Pair, rows: list[Row], meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(
        {"meta": meta, "pair": asdict(pair), "rows": [asdict(r) for r in rows]}, indent=2))
    lines = [
        f"# Benchmark: {pair.name} pair ({Path(pair.target).name} / {Path(pair.draft).name}, {pair.dtype})",
        "",
        f"{meta['machine']}; vLLM {meta['vllm']}; {meta['num_prompts']} prompts (batch 1: the first "
        f"{meta['batch1_prompts']}) x {meta['max_tokens']} new tokens, greedy, {meta.get('mode_text', 'enforce_eager')}; "
        f"generated {meta['date']} by `python -m scripts.bench {meta['argv']}`. Ratios are to no "
        "speculation at the same batch size" + (
            ", measured beside it: both engines alive, each prompt group generated by one then the "
            "other, the order alternating (this VM's speed drifts by up to 2x within minutes); a "
            "ratio is the median over runs, the figures shown are the median run's"
            if meta.get("interleave") else "") + ".",
        "",
        "TPOT: milliseconds per output token after each request's first (the decode phase; the "
        "prompt's prefill, the same work in every configuration, left out); x no-spec (TPOT): no "
        "speculation's TPOT over the configuration's. "
        "Draft tokens / accepted token: tokens the draft model computed per output token (GSD: "
        "catch-up plus every expanded graph row; counted by GSD only). "
        "Nodes / step: draft tokens the target verified per request per step (GSD: per tree). "
        "Plain steps: share of steps the adaptive budget decoded without drafting. Step split (GSD): "
        "milliseconds per decode step (steps with prompt tokens left out) of the target forward "
        "(the runner's execute_model) / draft step (catch-up, levels, graph) / of "
        "which the draft model's layers / of which its LM head / tree verification / KV compaction, "
        "host wall time. Whole steps (GSD): wall milliseconds of a drafted decode step (tokens it "
        "emitted) / of a plain one, as the adaptive budget's referee timed them. Lookup nodes (GSD): "
        "context-lookup nodes past the draft's leaves (engine/lookup.py) the target accepted / "
        "tried (their parent accepted) / verified. Workloads: plain (greedy, exactly the new tokens "
        "given), penalty (the same with repetition_penalty 1.1), json (each question asked for a JSON "
        "object under a JSON schema, vLLM's structured output, ending where the JSON ends). "
        "`= no-spec`: greedy "
        "output identical to no speculation" + (" (bf16: vLLM's own output depends on the batch "
        "shape at near-ties; exactness is tested in float32)" if pair.dtype != "float32" else "") + ".",
        "",
        "| workload | config | batch | tok/s | x no-spec | TPOT ms | x no-spec (TPOT) | mean acc. len "
        "| draft tok / accepted tok | nodes / step | plain steps | step split ms | whole steps ms | merges "
        "| draft exp. saved | lookup nodes | = no-spec |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    fmt = lambda v: "" if v is None else str(v)  # noqa: E731
    for r in rows:
        same = "" if r.identical_to_no_spec is None else (
            "yes" if r.identical_to_no_spec else f"**NO** ({r.identical_prompts or '?'} same)")
        split = "" if not r.step_ms else " / ".join(str(v) for v in r.step_ms.values())
        whole = "" if not r.whole_step_ms else (
            f"{r.whole_step_ms['drafted']} ({r.whole_step_ms['drafted_tokens']}) / {fmt(r.whole_step_ms['plain'])}")
        lines.append(f"| {r.workload} | {r.config} | {r.batch} | {r.tokens_per_s} | {fmt(r.ratio_to_no_spec)} | "
                     f"{fmt(r.tpot_ms)} | {fmt(r.tpot_ratio)} | {fmt(r.mean_acceptance_length)} | {fmt(r.draft_tokens_per_accepted)} | "
                     f"{fmt(r.nodes_per_step)} | {fmt(r.plain_step_share)} | {split} | {whole} | {fmt(r.merges)} | "
                     f"{fmt(r.draft_expansions_saved)} | {fmt(r.lookup_nodes)} | {same} |")
    noted = [r for r in rows if r.notes]
    if noted:
        lines += ["", "Per run (median shown above):", ""]
        lines += [f"* {r.workload}, {r.config}, batch {r.batch}: {r.notes}" for r in noted]
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    for metric, label, fname in (("tokens_per_s", "output tokens/s", "tokens_per_s.png"),
                                 ("mean_acceptance_length", "mean acceptance length", "acceptance_length.png")):
        fig, ax = plt.subplots(figsize=(7, 4))
        for workload, config in dict.fromkeys((r.workload, r.config) for r in rows):
            pts = [(r.batch, getattr(r, metric)) for r in rows
                   if (r.workload, r.config) == (workload, config) and getattr(r, metric)]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=config if workload == "plain" else f"{config} ({workload})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (requests in flight)")
        ax.set_ylabel(label)
        ax.set_title(f"{label}, {pair.name} pair")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=100)
        plt.close(fig)


def machine_text() -> str:
    """This machine for a result's header: CPU model, cores, and whether it has AMX tiles (which
    decide whether an int8 draft is fast on a CPU)."""
    model, amx = platform.machine(), False
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                      if line.startswith("model name")), model)
        amx = "amx_int8" in cpuinfo
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {'with' if amx else 'no'} AMX tiles"


def emit(text: str, out: str | None) -> None:
    """Print a rendered table, and write it to `out` (a file path) when given."""
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)


def profiling_parser(description: str, mode: str, num_prompts: int) -> argparse.ArgumentParser:
    """The arguments scripts.profile_step and scripts.profile_worker share."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="qwen", choices=["tiny", "qwen"])
    parser.add_argument("--configs", default="no_spec,draft_model_k4,gsd_graph_fixed,gsd_graph")
    parser.add_argument("--mode", default=mode, choices=["default", "eager"])
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompt-offset", type=int, default=0, help="skip this many prompts of each set")
    parser.add_argument("--int8-draft", action="store_true", help="draft with the int8 (W8A8) copy of the draft")
    parser.add_argument("--out", default=None)
    return parser


def profiled_pair(args) -> Pair:
    """The pair and prompts a profiling script's arguments name (see profiling_parser)."""
    pair = resolve_pair(args.pair, args.num_prompts, args.prompt_offset)
    if args.int8_draft:
        from scripts.tools.real_models import int8_draft

        pair.draft = str(int8_draft(Path(pair.draft)))
    if getattr(args, "dtype", None):
        pair.dtype = args.dtype
    return pair


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="qwen", choices=["tiny", "qwen"])
    parser.add_argument("--quick", action="store_true", help="tiny pair, few prompts (CI smoke test)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch1-prompts", type=int, default=8, help="prompts measured at batch 1")
    parser.add_argument("--depth", type=int, default=4, help="draft depth of gsd (draft_model K=depth compares)")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma list (default {DEFAULT_CONFIGS})")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the configurations this many times in turn; report medians of paired ratios")
    parser.add_argument("--mode", default="default", choices=["default", "eager"],
                        help="vLLM's default (compiled) mode, or enforce_eager")
    parser.add_argument("--prompt-offset", type=int, default=0,
                        help="skip this many prompts of each set (qwen): a check on prompts not tuned on")
    parser.add_argument("--interleave", action="store_true",
                        help="run each configuration's engine beside one of no speculation and generate "
                             "each prompt group with both in turn (this VM's speed drifts within minutes)")
    parser.add_argument("--int8-draft", action="store_true",
                        help="every configuration drafts with the int8 (W8A8) copy of the pair's draft "
                             "(vllm_gsd/quantize_draft.py)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="the engines' dtype (default: the pair's; float32 makes a GSD output "
                             "that differs from no speculation's a failure)")
    parser.add_argument("--workloads", default="plain",
                        help=f"comma list of {', '.join(WORKLOADS)}: the requests' options (see WORKLOADS)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--rerender", action="store_true", help="rewrite table/plots from results.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.pair, args.batches, args.num_prompts, args.max_tokens = "tiny", "1,4", 4, 16
        args.batch1_prompts = 2
        args.configs = "no_spec,draft_model_k4,gsd,gsd_graph_fixed"
        args.workloads = ",".join(WORKLOADS)
    out_dir = Path(args.out or REPO / "docs" / "bench" / args.pair)
    if args.rerender:
        saved = json.loads((out_dir / "results.json").read_text())
        rows = [Row(**r) for r in saved["rows"]]
        write_results(out_dir, Pair(**saved["pair"]), rows, saved["meta"])
        return 0
    # GiB of KV cache per engine: interleaved engines share the machine's memory.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1" if args.interleave else "4")
    batches = [int(b) for b in args.batches.split(",")]
    pair = profiled_pair(args)
    workloads = args.workloads.split(",")
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"unknown workloads {sorted(unknown)}: use {', '.join(WORKLOADS)}")
    prompt_ids = {w: prompt_token_ids(pair, args.max_tokens, w) for w in workloads}
    configs = configurations(pair, args.depth)
    if args.configs:
        configs = {k: configs[k] for k in args.configs.split(",")}
    if "no_spec" not in configs:
        configs = {"no_spec": None, **configs}

    # With --rounds R the configurations run R times in turn and each figure is the median over
    # the rounds of a ratio to the same round's no speculation: this VM's speed drifts over
    # minutes, and pairing by round cancels most of it.
    measured, reference = [], None  # (round, row, outputs)
    for round_index in range(args.rounds):
        if args.interleave:
            # Two engines at a time fit in memory (a Qwen pair engine holds 6-8 GiB): each
            # configuration runs beside no speculation, and its ratio is to that run's.
            others = [name for name in configs if name != "no_spec"]
            for k, name in enumerate(others):
                run = round_index * len(others) + k  # pairs ratios with the no_spec of the same run
                print(f"[bench] no_spec and {name}, interleaved (round {round_index + 1})", flush=True)
                for row, outputs in run_interleaved(pair, {"no_spec": None, name: configs[name]}, batches,
                                                    args.max_tokens, prompt_ids, args.batch1_prompts,
                                                    args.mode, run):
                    measured.append((run, row, outputs))
            continue
        for name, spec in configs.items():
            print(f"[bench] {name}" + (f" (round {round_index + 1})" if args.rounds > 1 else ""), flush=True)
            config_rows, outputs = run_config(pair, name, spec, batches, args.max_tokens, prompt_ids,
                                              args.batch1_prompts, args.mode)
            measured += [(round_index, row, outputs[row.workload, row.batch]) for row in config_rows]
    reference = {}
    for _, row, out in measured:
        if row.config == "no_spec":
            reference.setdefault(row.workload, {})[row.batch] = out
    rows = [_median_over_rounds(measured, reference, config, workload, batch, args.rounds)
            for workload in workloads for config in configs for batch in batches]

    import vllm

    meta = {"machine": machine_text(), "vllm": vllm.__version__,
            "num_prompts": len(prompt_ids[workloads[0]]), "max_tokens": args.max_tokens,
            "workloads": workloads,
            "batch1_prompts": args.batch1_prompts, "prompt_offset": args.prompt_offset,
            "interleave": args.interleave,
            "mode_text": "vLLM's default (compiled) mode" if args.mode == "default" else "enforce_eager",
            "date": time.strftime("%Y-%m-%d"), "argv": " ".join(sys.argv[1:] if argv is None else argv)}
    write_results(out_dir, pair, rows, meta)
    print((out_dir / "results.md").read_text())
    # In float32 GSD's greedy output must equal the target's; in bf16 vLLM's own output already
    # depends on the batch shape at near-ties (shared/reference/cpu-environment.md).
    mismatches = [r for r in rows if r.identical_to_no_spec is False and r.config.startswith("gsd")]
    return 1 if mismatches and pair.dtype == "float32" else 0


if __name__ == "__main__":
    sys.exit(main())
