"""The tiny models' text and tokenizer (vllm_gsd/testing/tiny_models.py builds the models):
the Python standard library sources found on this machine as the corpus, a byte-level BPE
tokenizer trained on it (id 0 = EOS, id 1 = BOS, every encoding starts with BOS), saved as an HF
fast tokenizer, and the corpus as one token stream for training. Every name here is importable
from vllm_gsd.testing.tiny_models too.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CORPUS_MAX_BYTES = 2_000_000  # the default recipe's corpus (TinyRecipe.corpus_max_bytes)
MODEL_MAX_LENGTH = 4096  # the default recipe's context (TinyRecipe.max_position_embeddings)


def stdlib_source_files() -> list[Path]:
    """Return the top-level `*.py` files of this interpreter's standard library, sorted by name."""
    return sorted(Path(p) for p in glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))


def local_corpus(max_bytes: int = CORPUS_MAX_BYTES) -> list[str]:
    """Return whole stdlib source files, in sorted order, until `max_bytes` characters are reached."""
    texts: list[str] = []
    total = 0
    for path in stdlib_source_files():
        if total >= max_bytes:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
    return texts


def corpus_digest(texts: Sequence[str]) -> str:
    """Return a sha256 hex digest of the corpus (file boundaries included)."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8", errors="replace"))
        digest.update(b"\0")
    return digest.hexdigest()


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int):
    """Train a byte-level BPE `tokenizers.Tokenizer` whose encodings start with BOS.

    Special tokens: id 0 = EOS_TOKEN, id 1 = BOS_TOKEN. Decoding round-trips any text exactly.
    """
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, BOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return tokenizer


def save_hf_tokenizer(tokenizer, out_dir: Path) -> None:
    """Write `tokenizer` as an HF fast tokenizer (tokenizer.json + tokenizer_config.json)."""
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
    )
    hf_tokenizer.save_pretrained(out_dir)


def copy_tokenizer(src_dir: Path, dst_dir: Path) -> None:
    """Copy the tokenizer files of one model directory into another."""
    for name in TOKENIZER_FILES:
        if (src_dir / name).exists():
            (dst_dir / name).write_bytes((src_dir / name).read_bytes())


def token_stream(tokenizer, texts: Sequence[str]):
    """Return one int64 tensor: every file's tokens (no BOS), each file followed by EOS."""
    import torch

    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(list(texts), add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)
