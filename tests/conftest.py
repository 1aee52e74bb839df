"""Shared model-path fixtures (session scoped). Nothing else belongs here.

Tiny models are built on first use (about 45 s on two cores, then cached in $VLLM_GSD_CACHE or
~/.cache/vllm-gsd). Real pairs are never prepared by the tests: run
`scripts/prepare_models.py --pair all` once; until then the fixtures skip.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_target_path() -> Path:
    """Directory of the trained tiny Llama target."""
    from vllm_gsd.testing.tiny_models import tiny_target

    return tiny_target()


@pytest.fixture(scope="session")
def tiny_draft_paths(tiny_target_path) -> dict[str, Path]:
    """Directories of the tiny drafts, keyed by kind: "same", "perturbed", "shallow"."""
    from vllm_gsd.testing.tiny_models import DRAFT_KINDS, tiny_draft

    return {kind: tiny_draft(kind) for kind in DRAFT_KINDS}


@pytest.fixture(scope="session")
def tiny_other_vocab_path() -> Path:
    """Directory of a tiny model whose tokenizer differs from the target's."""
    from vllm_gsd.testing.tiny_models import tiny_draft_other_vocab

    return tiny_draft_other_vocab()


def _prepared_pair(name: str):
    from vllm_gsd.testing.real_models import prepared_pair_or_none

    pair = prepared_pair_or_none(name)
    if pair is None:
        pytest.skip(f"real pair {name!r} not prepared: run scripts/prepare_models.py --pair {name}")
    return pair


@pytest.fixture(scope="session")
def qwen_pair_paths():
    """ModelPair(target=Qwen2.5-Coder-1.5B-Instruct, draft=0.5B-Instruct) in bf16; skips if not prepared."""
    return _prepared_pair("qwen")


@pytest.fixture(scope="session")
def smollm_pair_paths():
    """ModelPair(target=SmolLM2-135M-Instruct, draft=its 24-layer self-draft) in bf16; skips if not prepared."""
    return _prepared_pair("smollm")
