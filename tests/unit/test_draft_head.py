"""The draft's int8 LM head (engine/draft_head.py) against the bf16 / fp32 head it replaces:
logits within the int8 rounding of each row, on random heads of odd sizes, through vLLM's own
oneDNN W8A8 GEMM; and the fallback to the model's own head where the int8 copy would differ."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_gsd.engine.draft_head import Int8DraftHead, head_error
from vllm_gsd.quantize_draft import quantize_per_channel


def _reference(weight: torch.Tensor, hidden: torch.Tensor, vocab: int, scale: float) -> torch.Tensor:
    return torch.nn.functional.linear(hidden.float(), weight[:vocab].float()) * scale


@settings(max_examples=25, deadline=None)
@given(vocab=st.integers(1, 300), padding=st.integers(0, 7), hidden_size=st.sampled_from([8, 24, 64, 72]),
       rows=st.integers(1, 9), scale=st.sampled_from([1.0, 0.5]), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       seed=st.integers(0, 2**31 - 1))
def test_int8_head_matches_the_head_within_rounding(vocab, padding, hidden_size, rows, scale, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab + padding, hidden_size, generator=generator) * 0.05).to(dtype)
    hidden = torch.randn(rows, hidden_size, generator=generator).to(dtype)
    logits = Int8DraftHead(weight, vocab, scale, dtype)(hidden)
    assert logits.shape == (rows, vocab) and logits.dtype == dtype
    expected = _reference(weight, hidden, vocab, scale)
    # Weight rounding (half a step per entry) and the hidden rows' own int8 rounding, summed over
    # the hidden size; bf16 output adds its own rounding.
    row_scales = quantize_per_channel(weight[:vocab])[1].squeeze(1)
    hidden_step = hidden.float().abs().amax(dim=1, keepdim=True) / 127
    bound = (0.5 * row_scales[None, :] * hidden.float().abs().sum(dim=1, keepdim=True)
             + 0.5 * hidden_step * weight[:vocab].float().abs().sum(dim=1)[None, :]) * scale
    bound = bound + expected.abs() * (2 ** -7 if dtype == torch.bfloat16 else 1e-5) + 1e-4
    assert bool(((logits.float() - expected).abs() <= bound).all())


def test_int8_head_keeps_a_clear_top_token():
    """A peaked row (one logit far above the rest, as a confident draft's) keeps its argmax."""
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(1000, 64, generator=generator) * 0.05).to(torch.bfloat16)
    hidden = (weight[[3, 500, 999]].float() * 40).to(torch.bfloat16)  # aligned with rows 3, 500, 999
    logits = Int8DraftHead(weight, 1000, 1.0, torch.bfloat16)(hidden)
    assert logits.argmax(dim=1).tolist() == [3, 500, 999]


def test_head_error_tells_rounding_from_another_function():
    weight = torch.randn(257, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    head = Int8DraftHead(weight, 257, 1.0, torch.bfloat16)
    same = lambda h: torch.nn.functional.linear(h, weight)  # noqa: E731
    assert head_error(head, same, 32, torch.bfloat16) < 0.05
    scaled = lambda h: torch.nn.functional.linear(h, weight) * 0.3  # noqa: E731 (a logit scale we missed)
    assert head_error(head, scaled, 32, torch.bfloat16) > 0.5
    padded = lambda h: torch.nn.functional.linear(h, torch.cat([weight, weight[:3]]))  # noqa: E731
    assert head_error(head, padded, 32, torch.bfloat16) == float("inf")
