"""Prompts for the tiny models (tests and the --quick benchmark).

TINY_PROMPTS are fixed code snippets in the tiny models' training domain (stdlib sources). The
real prompt sets (HumanEval, MT-Bench) are tooling: scripts/tools/prompt_sets.py.
"""

from __future__ import annotations

# Prompts for the tiny models: the openings of typical stdlib lines. They end without a trailing
# space, because the byte-level BPE glues a space to the following word.
TINY_PROMPTS: tuple[str, ...] = (
    "def __init__(self,",
    "import os\nimport sys\n",
    "class Foo:\n    def",
    "    for i in range(",
    "        if not isinstance(",
    '    """Return the',
    "        self._",
    "    return",
)


def tiny_prompts(n: int | None = None) -> list[str]:
    """Return the first `n` (default: all 8) fixed code prompts for the tiny models."""
    return list(TINY_PROMPTS[:n])
