"""The draft's LM head as GSD's drafter runs it: logits [R, V] of hidden states [R, H].

Contract::

    head = draft_head(model, vllm_config, use_int8, vocab_kept)  # once, after the draft is loaded
    logits = head(hidden)                 # [R, H] -> [R, V], the model's dtype (V: head.kept if reduced)
    logits = head(hidden, extra_ids)      # Int8DraftHead: [R, kept + E], columns kept ids then extra_ids

On a CPU, decoding reads every weight once per forward, and a speculative step runs the draft's
LM head once per level: over a 152k vocabulary that is a quarter of the 0.5B draft's bytes.
`Int8DraftHead` keeps an int8 copy of the head's weight (one float32 scale per vocabulary row)
and runs it through vLLM's own oneDNN W8A8 GEMM with the hidden states quantized per row on the
fly, the kernel vLLM's compressed-tensors layers use: half the bytes of the bf16 head. Only the
draft's proposals change (slightly: its children are the top-k of near logits); the target
verifies every token, so the output is the target's either way.

Reduced vocabulary (FR-Spec, Zhao et al. 2025): the int8 head may keep only the vocabulary's
first `vocab_kept` rows. BPE tokenizers number tokens in merge order, which roughly follows
their frequency in the tokenizer's corpus; on Qwen2.5 the first 100000 ids hold 99.9% of
MT-Bench's question tokens (the ids past them are mostly CJK). A caller adds, per step, the few
ids past them the draft may need (`extra_ids`: the requests' own context tokens, their stop
tokens), scored from the model's weight as it is. The head then reads 66% of the bytes; a token
it leaves out cannot be proposed, which costs acceptance, never exactness.

Where that path does not apply (not a CPU, no oneDNN, tensor parallelism, a quantized or biased
head, logit soft-capping, a head dtype other than the model's) or `use_int8` is false, the head
is the model's own `compute_logits`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from vllm_gsd.engine import LOGGER_NAME
from vllm_gsd.quantize_draft import quantize_per_channel

logger = logging.getLogger(LOGGER_NAME)

DraftHead = Callable[[torch.Tensor], torch.Tensor]


class Int8DraftHead:
    """hidden [R, H] -> logits [R, V] through an int8 copy of the head (see the module doc)."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, scale: float, dtype: torch.dtype,
                 vocab_kept: int | None = None):
        from vllm import _custom_ops as ops

        self._ops = ops
        # oneDNN takes the [H, V] operand as a transposed view of the row-major [V, H] weight
        # (dynamic per-row activation scales, symmetric: no zero points). The handler may read
        # the weight and its scales where they lie, so they live as long as it does.
        # One scale per vocabulary row: the draft checkpoint's per-channel int8 (quantize_draft.py).
        # The kept rows are the vocabulary's first (see the module doc); the model's own weight
        # scores the extra ids a caller asks for.
        self.kept = vocab_size if vocab_kept is None else min(vocab_kept, vocab_size)
        self._weight, row_scales = quantize_per_channel(weight[:self.kept])
        self._row_scales = row_scales.squeeze(1)  # float32 [kept]
        self._handler = ops.create_onednn_scaled_mm(self._weight.t(), self._row_scales, dtype, True, False, 32)
        self._model_weight = weight
        self.vocab_size, self.scale, self.dtype = vocab_size, scale, dtype

    @property
    def reduced(self) -> bool:
        """Whether the head leaves part of the vocabulary out."""
        return self.kept < self.vocab_size

    def __call__(self, hidden: torch.Tensor, extra_ids: torch.Tensor | None = None) -> torch.Tensor:
        """logits [R, kept + E]: the kept ids' (int8), then extra_ids' (int64 [E], ids >= kept;
        the model's weight)."""
        hidden = hidden.to(self.dtype)
        quantized, row_scales, _ = self._ops.onednn_scaled_int8_quant(hidden, None, None, True)
        logits = torch.empty((hidden.shape[0], self.kept), dtype=self.dtype, device=hidden.device)
        self._ops.onednn_scaled_mm(self._handler, quantized, logits, row_scales, None, None, None)
        if extra_ids is not None and extra_ids.numel():
            logits = torch.cat([logits, torch.nn.functional.linear(hidden, self._model_weight[extra_ids])], dim=1)
        if self.scale != 1.0:
            logits *= self.scale
        return logits


def logit_columns(kept: int, extra_ids: torch.Tensor | None) -> torch.Tensor:
    """int64 [kept + E]: the token id of each logit column of a reduced head called with extra_ids."""
    kept_ids = torch.arange(kept)
    return kept_ids if extra_ids is None else torch.cat([kept_ids, extra_ids])


def top_children(logits: torch.Tensor, k: int, columns: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [R, k], probs float32 [R, k]), CPU, descending: the k most likely tokens of
    each row of logits [R, C] under their softmax; column c is token columns[c] (None: token c)."""
    found_columns, found_probs = read_children(*top_columns(logits, k))
    return (found_columns if columns is None else columns[found_columns]), found_probs


def top_columns(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(columns int64 [R, k], probs float32 [R, k]) on logits' device, descending: the k most
    likely columns of each row of logits [R, C] under their softmax."""
    top_probs, top_cols = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return top_cols, top_probs


def read_children(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [R, k], probs float32 [R, k]) on the host, in one device-to-host read: both
    packed into one float64 tensor (token ids below 2**53 and float32 values are exact in float64)."""
    packed = torch.stack([tokens.to(torch.float64), probs.to(torch.float64)]).cpu()
    return packed[0].to(torch.int64), packed[1].to(torch.float32)


def widen(logits: torch.Tensor, columns: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """logits [R, vocab_size]: a reduced head's logits [R, C] at their tokens' columns, -inf at
    the ids it left out (for paths that index the whole vocabulary)."""
    wide = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    return wide.index_copy_(1, columns.to(logits.device), logits)


def int8_head_refusal(model, vllm_config) -> str | None:
    """Why the draft `model`'s head cannot run as `Int8DraftHead` here, or None if it can."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    lm_head, processor = getattr(model, "lm_head", None), getattr(model, "logits_processor", None)
    if not current_platform.is_cpu():
        return "not a CPU (the int8 head is vLLM's oneDNN GEMM, a CPU kernel)"
    if not ops._supports_onednn:
        return "vLLM's CPU build has no oneDNN GEMM"
    if lm_head is None or processor is None or not hasattr(lm_head, "weight"):
        return "the draft has no lm_head / logits_processor"
    if vllm_config.parallel_config.tensor_parallel_size > 1:
        return "tensor parallelism (the head is split across ranks)"
    if not isinstance(getattr(lm_head, "quant_method", None), UnquantizedEmbeddingMethod):
        return "the draft's head is quantized"
    if getattr(lm_head, "bias", None) is not None or getattr(processor, "soft_cap", None) is not None:
        return "the draft's head has a bias or logit soft-capping"
    if getattr(processor, "logits_as_input", False):
        return "the draft's logits processor takes logits as input"
    head_dtype = getattr(processor, "head_dtype", None)
    if head_dtype is not None and head_dtype != lm_head.weight.dtype:
        return f"the draft's head runs in {head_dtype}"
    return None


# Largest mean |int8 - model| logit error, relative to the logits' standard deviation, on
# random hidden states: rounding gives about 0.01; a different function gives about 1.
HEAD_TOLERANCE = 0.1


@torch.inference_mode()
def head_error(head: DraftHead, reference: DraftHead, hidden_size: int, dtype: torch.dtype,
               rows: int = 4) -> float:
    """Mean |head - reference| of the logits of `rows` random hidden states, over the
    reference logits' standard deviation (inf where their shapes differ)."""
    hidden = torch.randn(rows, hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    ours, theirs = head(hidden).float(), reference(hidden).float()
    if ours.shape != theirs.shape:
        return float("inf")
    return float((ours - theirs).abs().mean() / theirs.std().clamp(min=1e-12))


def draft_head(model, vllm_config, use_int8: bool, vocab_kept: int = 0) -> DraftHead:
    """The head GSD's drafter calls for the loaded draft `model` (see the module doc);
    vocab_kept: the int8 head's first ids kept (0: the whole vocabulary)."""
    if not use_int8:
        if vocab_kept:
            logger.info("GSD: the draft's LM head scores the whole vocabulary (draft_vocab needs the int8 head)")
        return model.compute_logits
    refusal = int8_head_refusal(model, vllm_config)
    if refusal is not None:
        logger.info("GSD: the draft's LM head runs as loaded, over the whole vocabulary: %s", refusal)
        return model.compute_logits
    processor = model.logits_processor
    weight = model.lm_head.weight
    head = Int8DraftHead(weight, processor.org_vocab_size, float(processor.scale), weight.dtype,
                         vocab_kept or None)
    # A model whose compute_logits does more than the head and the processor's scale is caught
    # here: its logits would not be the int8 head's up to rounding.
    error = head_error(head, lambda h: model.compute_logits(h)[:, :head.kept], weight.shape[1], weight.dtype)
    if error > HEAD_TOLERANCE:
        logger.info("GSD: the draft's LM head runs as loaded: its int8 copy's logits are %.3f of "
                    "their spread off the model's own", error)
        return model.compute_logits
    logger.info("GSD: the draft's LM head runs in int8 over %d of %d token ids (%d x %d, %.0f MB against %.0f MB)",
                head.kept, head.vocab_size, head.kept, weight.shape[1], head.kept * weight.shape[1] / 2**20,
                weight.numel() * weight.element_size() / 2**20)
    return head
