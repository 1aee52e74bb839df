"""Tiny Llama models for tests, built offline in seconds and cached.

The target is a 4-layer Llama (hidden 128, 4 query heads / 2 KV heads of size 32, GQA) with a
byte-level BPE tokenizer, both trained briefly on the Python standard library sources found on
this machine, so its greedy output is code-like. Drafts derive from the trained target:

  "same"       identical weights            -> every greedy draft token agrees
  "perturbed"  Gaussian noise on the weights -> partial agreement (default noise: about 65-70 %)
  "shallow"    first layer(s) + last layer  -> a self-draft with fewer layers

`tiny_draft_other_vocab()` is a model whose tokenizer differs from the target's (error tests).
Every directory is a `save_pretrained` HF directory (float32 safetensors + tokenizer.json +
tokenizer_config.json) that both transformers and vLLM load. Directory names carry a hash of
the recipe (and of the corpus), so a recipe change builds into a new directory.

The corpus and the tokenizer's training are in vllm_gsd/testing/tiny_tokenizer.py (its names are
importable from here too); this module builds and measures the models.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from pathlib import Path

from vllm_gsd.testing.cache import build_once, cache_root, recipe_key
from vllm_gsd.testing.tiny_tokenizer import (  # noqa: F401  (public here too)
    BOS_TOKEN,
    CORPUS_MAX_BYTES,
    EOS_TOKEN,
    MODEL_MAX_LENGTH,
    TOKENIZER_FILES,
    copy_tokenizer,
    corpus_digest,
    local_corpus,
    save_hf_tokenizer,
    stdlib_source_files,
    token_stream,
    train_bpe_tokenizer,
)

RECIPE_FORMAT = 1  # bump when the build code changes in a way the recipe fields do not show
DRAFT_KINDS = ("same", "perturbed", "shallow", "short")
# The "short" draft's context (max_position_embeddings): shorter than the target's.
SHORT_DRAFT_CONTEXT = 256
DEFAULT_NOISE_SCALE = 0.18
DEFAULT_SHALLOW_LAYERS = 2


@dataclasses.dataclass(frozen=True)
class TinyRecipe:
    """Everything that determines the tiny target's tokenizer and weights."""

    corpus_max_bytes: int = CORPUS_MAX_BYTES
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = MODEL_MAX_LENGTH
    train_steps: int = 900
    batch_size: int = 4
    seq_len: int = 128
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    seed: int = 0
    num_threads: int = 1  # see torch_threads()


DEFAULT_RECIPE = TinyRecipe()


@contextlib.contextmanager
def torch_threads(num_threads: int):
    """Run the body with `torch.set_num_threads(num_threads)`, restoring the old count after.

    Tiny models run best on one thread: two threads are only ~1.5x faster on an idle 2-core
    machine but 5-8x slower when another process competes for the cores (OpenMP barriers).
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# --------------------------------------------------------------------------- target model


def llama_config(recipe: TinyRecipe, vocab_size: int, num_hidden_layers: int | None = None):
    """Return the LlamaConfig of the recipe (float32, tied embeddings, BOS id 1, EOS id 0)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=num_hidden_layers or recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=0,
        pad_token_id=0,
        torch_dtype="float32",
    )


def train_next_token(model, stream, recipe: TinyRecipe, bos_id: int) -> list[float]:
    """Train `model` in place on random windows of `stream`; return the loss of every step.

    Each training row is BOS followed by `seq_len - 1` consecutive stream tokens (the prompt
    shape used at inference). AdamW, linear warm-up then linear decay to 10 %, grad clip 1.0.
    Deterministic for a fixed recipe on a fixed machine (seeded generator, fixed thread count).
    """
    import torch

    generator = torch.Generator().manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.learning_rate, betas=(0.9, 0.98), weight_decay=0.0
    )

    def lr_factor(step: int) -> float:
        warm = min(1.0, (step + 1) / recipe.warmup_steps)
        return warm * max(0.1, 1.0 - step / recipe.train_steps)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    window = recipe.seq_len - 1
    bos_column = torch.full((recipe.batch_size, 1), bos_id, dtype=torch.long)
    losses = []
    model.train()
    for _ in range(recipe.train_steps):
        starts = torch.randint(0, len(stream) - window, (recipe.batch_size,), generator=generator)
        rows = torch.stack([stream[s : s + window] for s in starts.tolist()])
        batch = torch.cat([bos_column, rows], dim=1)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
    model.eval()
    return losses


def _build_target(out_dir: Path, recipe: TinyRecipe, texts: Sequence[str]) -> None:
    """Train tokenizer and model from `recipe` and save both into `out_dir`."""
    import torch
    from transformers import LlamaForCausalLM

    with torch_threads(recipe.num_threads):
        tokenizer = train_bpe_tokenizer(texts, recipe.vocab_size)
        torch.manual_seed(recipe.seed)
        model = LlamaForCausalLM(llama_config(recipe, tokenizer.get_vocab_size()))
        losses = train_next_token(
            model, token_stream(tokenizer, texts), recipe, tokenizer.token_to_id(BOS_TOKEN)
        )
        model.save_pretrained(out_dir)
        save_hf_tokenizer(tokenizer, out_dir)
        tail = losses[-50:]
        (out_dir / "train_loss.txt").write_text(f"{sum(tail) / len(tail):.4f}\n")


def target_key(recipe: TinyRecipe = DEFAULT_RECIPE, texts: Sequence[str] | None = None) -> str:
    """Return the cache key of the target built from `recipe` on this machine's corpus.

    The key covers the recipe, RECIPE_FORMAT and a digest of the corpus text (`texts`, read
    from the stdlib when not given), so any change there names a new directory.
    """
    if texts is None:
        texts = local_corpus(recipe.corpus_max_bytes)
    return recipe_key(
        {
            "format": RECIPE_FORMAT,
            "recipe": dataclasses.asdict(recipe),
            "corpus": corpus_digest(texts),
        }
    )


def tiny_dir(name: str, key: str, cache_dir: Path | None = None) -> Path:
    """Return the cache path `<cache>/tiny/<name>-<key>` (not necessarily built)."""
    return Path(cache_dir or cache_root()) / "tiny" / f"{name}-{key}"


def tiny_target(recipe: TinyRecipe = DEFAULT_RECIPE, cache_dir: Path | None = None) -> Path:
    """Return the directory of the trained tiny target, building it on first use (~60 s, one core)."""
    texts = local_corpus(recipe.corpus_max_bytes)
    key = target_key(recipe, texts)
    return build_once(
        tiny_dir("target", key, cache_dir), lambda out: _build_target(out, recipe, texts)
    )


# --------------------------------------------------------------------------- drafts


def load_float32(model_dir: Path):
    """Load a causal LM from `model_dir` in float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def perturb_weights_(model, noise_scale: float, seed: int) -> None:
    """Add N(0, (noise_scale * std(W))^2) noise to every matrix W of `model`, in place.

    Vectors (norm weights) are left alone; tied embeddings are perturbed once.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if param.dim() < 2:
                continue
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            param.add_(noise * (noise_scale * param.std()))


def shallow_layer_indices(num_layers: int, keep: int) -> list[int]:
    """Return the layers a shallow draft keeps: the first `keep - 1` layers and the last one."""
    if not 1 <= keep < num_layers:
        raise ValueError(f"keep must be in [1, {num_layers - 1}], got {keep}")
    return list(range(keep - 1)) + [num_layers - 1]


def keep_layers(model, layer_indices: Sequence[int]):
    """Return a new float32 model of the same architecture with only `layer_indices` layers."""
    from transformers import AutoModelForCausalLM

    config = model.config.__class__.from_dict(model.config.to_dict())
    config.num_hidden_layers = len(layer_indices)
    if getattr(config, "layer_types", None):
        config.layer_types = [model.config.layer_types[i] for i in layer_indices]
    shallow = AutoModelForCausalLM.from_config(config)
    renamed = {}
    for name, tensor in model.state_dict().items():
        prefix = "model.layers."
        if name.startswith(prefix):
            old_index, rest = name[len(prefix) :].split(".", 1)
            if int(old_index) not in layer_indices:
                continue
            name = f"{prefix}{list(layer_indices).index(int(old_index))}.{rest}"
        renamed[name] = tensor
    shallow.load_state_dict(renamed, strict=True)
    return shallow.eval()


def _build_draft(
    out_dir: Path, target_dir: Path, kind: str, noise_scale: float, shallow_layers: int, seed: int
) -> None:
    """Derive a draft of `kind` from the target in `target_dir` and save it into `out_dir`."""
    model = load_float32(target_dir)
    if kind in ("perturbed", "short"):
        perturb_weights_(model, noise_scale, seed)
    if kind == "short":
        model.config.max_position_embeddings = SHORT_DRAFT_CONTEXT
    elif kind == "shallow":
        model = keep_layers(
            model, shallow_layer_indices(model.config.num_hidden_layers, shallow_layers)
        )
    model.save_pretrained(out_dir)
    copy_tokenizer(target_dir, out_dir)


def tiny_draft(
    kind: str = "perturbed",
    *,
    noise_scale: float = DEFAULT_NOISE_SCALE,
    shallow_layers: int = DEFAULT_SHALLOW_LAYERS,
    seed: int = 1,
    recipe: TinyRecipe = DEFAULT_RECIPE,
    cache_dir: Path | None = None,
) -> Path:
    """Return the directory of a draft derived from `tiny_target(recipe)`, building it if needed.

    kind: "same" (identical weights), "perturbed" (weights + noise of `noise_scale` times each
    matrix's std, seeded by `seed`), "shallow" (`shallow_layers` layers: the first
    `shallow_layers - 1` and the last), "short" (perturbed, with a context of
    SHORT_DRAFT_CONTEXT positions). The draft shares the target's tokenizer files.
    """
    if kind not in DRAFT_KINDS:
        raise ValueError(f"kind must be one of {DRAFT_KINDS}, got {kind!r}")
    target_dir = tiny_target(recipe, cache_dir)
    params = {
        "same": {},
        "perturbed": {"noise_scale": noise_scale, "seed": seed},
        "shallow": {"shallow_layers": shallow_layers},
        "short": {"noise_scale": noise_scale, "seed": seed, "context": SHORT_DRAFT_CONTEXT},
    }[kind]
    key = recipe_key({"format": RECIPE_FORMAT, "target": target_dir.name, "kind": kind, **params})
    return build_once(
        tiny_dir(f"draft-{kind}", key, cache_dir),
        lambda out: _build_draft(out, target_dir, kind, noise_scale, shallow_layers, seed),
    )


OTHER_VOCAB_SIZE = 1536


def _build_other_vocab(out_dir: Path, recipe: TinyRecipe) -> None:
    """Save an untrained 2-layer Llama with its own 1536-token tokenizer into `out_dir`."""
    import torch
    from transformers import LlamaForCausalLM

    tokenizer = train_bpe_tokenizer(local_corpus(recipe.corpus_max_bytes // 4), OTHER_VOCAB_SIZE)
    torch.manual_seed(recipe.seed + 7)
    model = LlamaForCausalLM(llama_config(recipe, tokenizer.get_vocab_size(), num_hidden_layers=2))
    model.save_pretrained(out_dir)
    save_hf_tokenizer(tokenizer, out_dir)


def tiny_draft_other_vocab(
    recipe: TinyRecipe = DEFAULT_RECIPE, cache_dir: Path | None = None
) -> Path:
    """Return a small random model whose tokenizer and vocab size differ from the target's."""
    key = recipe_key(
        {
            "format": RECIPE_FORMAT,
            "recipe": dataclasses.asdict(recipe),
            "other_vocab": OTHER_VOCAB_SIZE,
        }
    )
    return build_once(
        tiny_dir("draft-other-vocab", key, cache_dir), lambda out: _build_other_vocab(out, recipe)
    )


def build_all(cache_dir: Path | None = None) -> dict[str, Path]:
    """Build (or find) the target, every draft kind and the other-vocab draft; return name -> dir."""
    paths = {"target": tiny_target(cache_dir=cache_dir)}
    for kind in DRAFT_KINDS:
        paths[f"draft-{kind}"] = tiny_draft(kind, cache_dir=cache_dir)
    paths["draft-other-vocab"] = tiny_draft_other_vocab(cache_dir=cache_dir)
    return paths


# --------------------------------------------------------------------------- measurements


def hf_greedy_generate(
    model, tokenizer, prompt: str, max_new_tokens: int, num_threads: int | None = None
) -> list[int]:
    """Return exactly `max_new_tokens` greedy token ids from HF `generate` (EOS does not stop it).

    num_threads: torch threads for the call (default: one for models under 50M parameters, see
    torch_threads(), else unchanged).
    """
    import torch

    if num_threads is None and model.num_parameters() < 50_000_000:
        num_threads = 1
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    threads = torch_threads(num_threads) if num_threads else contextlib.nullcontext()
    with torch.no_grad(), threads:
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=[],
            pad_token_id=tokenizer.pad_token_id,
        )
    return output[0, input_ids.shape[1] :].tolist()


def greedy_agreement(
    target_dir: Path, draft_dir: Path, prompts: Sequence[str], max_new_tokens: int = 48
) -> float:
    """Return the fraction of positions where the draft's argmax equals the target's greedy token.

    For each prompt the target generates greedily; the draft then reads prompt + that continuation
    (teacher forcing) and its argmax at each generated position is compared with the target's
    token. This is the per-token acceptance rate of a chain draft under greedy verification.
    """
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target, draft = load_float32(target_dir), load_float32(draft_dir)
    agree = total = 0
    for prompt in prompts:
        prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids
        generated = hf_greedy_generate(target, tokenizer, prompt, max_new_tokens)
        full = torch.cat([prompt_ids, torch.tensor([generated])], dim=1)
        threads = (
            torch_threads(1) if draft.num_parameters() < 50_000_000 else contextlib.nullcontext()
        )
        with torch.no_grad(), threads:
            logits = draft(input_ids=full).logits[0]
        start = prompt_ids.shape[1] - 1
        draft_choice = logits[start : start + len(generated)].argmax(-1).tolist()
        agree += sum(int(a == b) for a, b in zip(draft_choice, generated))
        total += len(generated)
    return agree / total


def config_only_model(out_dir: Path, vocab_size: int) -> str:
    """Write only the config.json of a small Llama (no weights, no tokenizer) into `out_dir`:
    enough for vLLM to build an engine config (EngineArgs(..., skip_tokenizer_init=True))."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
    ).save_pretrained(out_dir)
    return str(out_dir)
