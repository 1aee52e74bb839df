"""Shared model-path fixtures (session scoped). Nothing else belongs here.

Tiny models are built on first use (about 45 s on two cores, then cached in $VLLM_GSD_CACHE or
~/.cache/vllm-gsd). Real pairs are not used by the tests (scripts/prepare_models.py, demo and bench prepare them).
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
