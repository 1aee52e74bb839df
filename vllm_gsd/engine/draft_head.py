"""The draft's LM head as GSD's drafter runs it: logits [R, V] of hidden states [R, H].

Contract::

    head = draft_head(model, vllm_config, use_int8)   # once, after the draft is loaded
    logits = head(hidden)                             # [R, H] -> [R, V], the model's dtype

On a CPU, decoding reads every weight once per forward, and a speculative step runs the draft's
LM head once per level: over a 152k vocabulary that is a quarter of the 0.5B draft's bytes.
`Int8DraftHead` keeps an int8 copy of the head's weight (one float32 scale per vocabulary row)
and runs it through vLLM's own oneDNN W8A8 GEMM with the hidden states quantized per row on the
fly, the kernel vLLM's compressed-tensors layers use: half the bytes of the bf16 head. Only the
draft's proposals change (slightly: its children are the top-k of near logits); the target
verifies every token, so the output is the target's either way.

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

    def __init__(self, weight: torch.Tensor, vocab_size: int, scale: float, dtype: torch.dtype):
        from vllm import _custom_ops as ops

        self._ops = ops
        # oneDNN takes the [H, V] operand as a transposed view of the row-major [V, H] weight
        # (dynamic per-row activation scales, symmetric: no zero points). The handler may read
        # the weight and its scales where they lie, so they live as long as it does.
        # One scale per vocabulary row: the draft checkpoint's per-channel int8 (quantize_draft.py).
        self._weight, row_scales = quantize_per_channel(weight[:vocab_size])
        self._row_scales = row_scales.squeeze(1)  # float32 [V]
        self._handler = ops.create_onednn_scaled_mm(self._weight.t(), self._row_scales, dtype, True, False, 32)
        self.vocab_size, self.scale, self.dtype = vocab_size, scale, dtype

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(self.dtype)
        quantized, row_scales, _ = self._ops.onednn_scaled_int8_quant(hidden, None, None, True)
        logits = torch.empty((hidden.shape[0], self.vocab_size), dtype=self.dtype, device=hidden.device)
        self._ops.onednn_scaled_mm(self._handler, quantized, logits, row_scales, None, None, None)
        if self.scale != 1.0:
            logits *= self.scale
        return logits


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


def draft_head(model, vllm_config, use_int8: bool) -> DraftHead:
    """The head GSD's drafter calls for the loaded draft `model` (see the module doc)."""
    if not use_int8:
        return model.compute_logits
    refusal = int8_head_refusal(model, vllm_config)
    if refusal is not None:
        logger.info("GSD: the draft's LM head runs as loaded: %s", refusal)
        return model.compute_logits
    processor = model.logits_processor
    weight = model.lm_head.weight
    head = Int8DraftHead(weight, processor.org_vocab_size, float(processor.scale), weight.dtype)
    # A model whose compute_logits does more than the head and the processor's scale is caught
    # here: its logits would not be the int8 head's up to rounding.
    error = head_error(head, model.compute_logits, weight.shape[1], weight.dtype)
    if error > HEAD_TOLERANCE:
        logger.info("GSD: the draft's LM head runs as loaded: its int8 copy's logits are %.3f of "
                    "their spread off the model's own", error)
        return model.compute_logits
    logger.info("GSD: the draft's LM head runs in int8 (%d x %d, %.0f MB against %.0f MB)",
                head.vocab_size, weight.shape[1], head.vocab_size * weight.shape[1] / 2**20,
                weight.numel() * weight.element_size() / 2**20)
    return head
