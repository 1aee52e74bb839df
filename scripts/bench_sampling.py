#!/usr/bin/env python
"""Sampling benchmark: mean acceptance length and tokens/s at temperatures 0, 0.7 and 1.0.

GSD (the code on the import path) and vLLM's draft_model chain on the same pair and prompts,
HumanEval and MT-Bench reported separately, one request at a time. Rows accumulate in
<out>/results.json under a label, so that another version of GSD (e.g. an older commit's vllm_gsd
put first on PYTHONPATH) can be measured into the same table:

    .venv/bin/python -m scripts.bench_sampling --pair qwen --label "gsd (coupled Gumbel)"
    mkdir /tmp/old && git archive OLD_COMMIT vllm_gsd | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old:. .venv/bin/python -P -m scripts.bench_sampling --configs gsd --label "gsd (before)"

(-P: the checkout's own vllm_gsd, which `python -m` would put first, does not hide the old one.)

GSD runs with trees on every step (adaptive off, the benchmark's fixed budget) so that the
acceptance of the drafting scheme is what is measured. Writes <out>/results.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
TEMPERATURES = (0.0, 0.7, 1.0)


def configurations(draft: str) -> dict[str, dict]:
    knobs = {"top_k": 3, "max_depth": 4, "merge_ngram": 1, "min_child_ratio": 0.1, "leaf_prob": 0.05,
             "adaptive": False}
    return {
        "gsd": {"method": "gsd", "model": draft, "num_speculative_tokens": 12, "gsd": knobs},
        "draft_model_k4": {"method": "draft_model", "model": draft, "num_speculative_tokens": 4},
    }


def prompt_sets(pair_name: str, target: str, num_prompts: int) -> dict[str, list[str]]:
    if pair_name == "tiny":
        from vllm_gsd.testing.prompts import tiny_prompts

        return {"tiny": tiny_prompts(num_prompts)}
    from scripts.tools import prompt_sets as prompts

    return {"HumanEval": prompts.as_chat(target, prompts.humaneval_prompts(num_prompts)),
            "MT-Bench": prompts.as_chat(target, prompts.mtbench_prompts(num_prompts))}


def run(target: str, dtype: str, spec: dict, sets: dict[str, list[str]], max_tokens: int, eager: bool) -> list[dict]:
    from vllm import LLM, SamplingParams

    from vllm_gsd.testing.engines import mean_acceptance_length_of

    llm = LLM(model=target, dtype=dtype, max_model_len=2048, seed=0, speculative_config=spec,
              per_request_spec_decode_metrics="summary", **({"enforce_eager": True} if eager else {}))
    llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
    rows = []
    for set_name, texts in sets.items():
        for temperature in TEMPERATURES:
            outputs, started = [], time.perf_counter()
            for i, text in enumerate(texts):
                params = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0, seed=i,
                                        max_tokens=max_tokens, ignore_eos=True)
                outputs += llm.generate([text], params, use_tqdm=False)
            seconds = time.perf_counter() - started
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            rows.append({"prompts": set_name, "temperature": temperature, "tokens_per_s": round(tokens / seconds, 2),
                         "mean_acceptance_length": round(mean_acceptance_length_of(outputs), 2)})
            print(f"  {set_name:10s} T={temperature}: {rows[-1]}", flush=True)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return rows


def render(out_dir: Path, saved: dict) -> None:
    meta = saved["meta"]
    lines = [f"# Sampling: mean acceptance length and tokens/s by temperature ({meta['pair']} pair)", "",
             f"`python -m scripts.bench_sampling` runs, one request at a time, {meta['num_prompts']} prompts per set x "
             f"{meta['max_tokens']} new tokens, top-p 0.95 when sampling, {meta['dtype']}, "
             f"{meta['mode']}; GSD with a fixed budget (12 nodes, top-k 3, depth 4, trees on every step), "
             "vLLM's draft_model chain with K = 4. Each label is a version of the code, measured on the date "
             "shown.", "",
             "| label | config | prompts | T | mean acc. len | tok/s | date |", "|---|---|---|---:|---:|---:|---|"]
    for entry in saved["runs"]:
        for row in entry["rows"]:
            lines.append(f"| {entry['label']} | {entry['config']} | {row['prompts']} | {row['temperature']} | "
                         f"{row['mean_acceptance_length']} | {row['tokens_per_s']} | {entry['date']} |")
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="qwen", choices=["tiny", "qwen"])
    parser.add_argument("--configs", default="gsd,draft_model_k4")
    parser.add_argument("--label", required=True)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--eager", action="store_true", help="enforce_eager (default: vLLM's compiled mode)")
    parser.add_argument("--out", default=str(REPO / "docs" / "bench" / "sampling"))
    args = parser.parse_args()
    from scripts.bench import resolve_pair

    pair = resolve_pair(args.pair, args.num_prompts)
    sets = prompt_sets(args.pair, pair.target, args.num_prompts)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    saved = json.loads(path.read_text()) if path.exists() else {"runs": []}
    saved["meta"] = {"pair": pair.name, "dtype": pair.dtype, "num_prompts": args.num_prompts,
                     "max_tokens": args.max_tokens, "mode": "enforce_eager" if args.eager else "vLLM's default mode"}
    configs = configurations(pair.draft)
    for name in args.configs.split(","):
        print(f"[bench_sampling] {args.label}: {name}", flush=True)
        rows = run(pair.target, pair.dtype, configs[name], sets, args.max_tokens, args.eager)
        saved["runs"] = [r for r in saved["runs"] if (r["label"], r["config"]) != (args.label, name)]
        saved["runs"].append({"label": args.label, "config": name, "date": time.strftime("%Y-%m-%d"), "rows": rows})
        path.write_text(json.dumps(saved, indent=2))
        render(out_dir, saved)
    print((out_dir / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
