"""The draft's int8 LM head (engine/draft_head.py) against the bf16 / fp32 head it replaces:
logits within the int8 rounding of each row, on random heads of odd sizes, through vLLM's own
oneDNN W8A8 GEMM; and the fallback to the model's own head where the int8 copy would differ."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_gsd.engine.draft_head import Int8DraftHead, head_error, logit_columns, read_children, top_children, widen
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


@settings(max_examples=25, deadline=None)
@given(vocab=st.integers(8, 300), kept_share=st.floats(0.05, 0.95), hidden_size=st.sampled_from([8, 24, 64]),
       rows=st.integers(1, 9), num_extra=st.integers(0, 6), scale=st.sampled_from([1.0, 0.5]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2**31 - 1))
def test_reduced_head_scores_its_kept_ids_and_the_extra_ones(vocab, kept_share, hidden_size, rows, num_extra,
                                                             scale, dtype, seed):
    """A reduced head's columns: the first `kept` ids as the whole int8 head scores them, then
    the extra ids from the model's own weight."""
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, hidden_size, generator=generator) * 0.05).to(dtype)
    hidden = torch.randn(rows, hidden_size, generator=generator).to(dtype)
    kept = max(1, int(vocab * kept_share))
    extra_ids = torch.randperm(vocab - kept, generator=generator)[:num_extra] + kept
    head = Int8DraftHead(weight, vocab, scale, dtype, vocab_kept=kept)
    assert head.reduced and head.kept == kept
    logits = head(hidden, extra_ids)
    assert logits.shape == (rows, kept + len(extra_ids)) and logits.dtype == dtype
    whole = Int8DraftHead(weight, vocab, scale, dtype)(hidden)
    tolerance = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(logits[:, :kept].float(), whole[:, :kept].float(), rtol=tolerance, atol=1e-4)
    exact = _reference(weight, hidden, vocab, scale)[:, extra_ids]
    assert torch.allclose(logits[:, kept:].float(), exact, rtol=2 * tolerance, atol=1e-3)
    assert not Int8DraftHead(weight, vocab, scale, dtype, vocab_kept=vocab + 5).reduced


@settings(max_examples=50, deadline=None)
@given(vocab=st.integers(5, 200), kept_share=st.floats(0.1, 0.9), rows=st.integers(1, 6), k=st.integers(1, 4),
       num_extra=st.integers(0, 5), seed=st.integers(0, 2**31 - 1))
def test_children_of_a_reduced_head_are_the_top_tokens_among_the_scored_ids(vocab, kept_share, rows, k,
                                                                           num_extra, seed):
    """top_children over a reduced head's columns names the same tokens, with the same
    probabilities, as the top-k of the whole vocabulary's logits with every unscored id masked."""
    generator = torch.Generator().manual_seed(seed)
    kept = max(k, int(vocab * kept_share))
    extra_ids = torch.randperm(vocab - kept, generator=generator)[:num_extra] + kept
    columns = logit_columns(kept, extra_ids)
    whole = torch.randn(rows, vocab, generator=generator)
    tokens, probs = top_children(whole[:, columns], k, columns)
    masked = widen(whole[:, columns], columns, vocab)
    assert torch.equal(masked[:, columns], whole[:, columns])
    assert bool(torch.isinf(masked).sum(1).eq(vocab - len(columns)).all())
    expected_probs, expected_tokens = torch.softmax(masked, dim=-1).topk(k, dim=-1)
    assert torch.equal(tokens, expected_tokens)
    assert torch.allclose(probs, expected_probs)
    # Without a column map, columns are tokens.
    assert torch.equal(top_children(whole, k)[0], torch.softmax(whole, dim=-1).topk(k, dim=-1)[1])


def test_children_come_back_exact_in_one_read():
    """read_children packs tokens and probs into one float64 read: every int64 id below 2**53 and
    every float32 probability (subnormals, 0, 1 included) comes back bit-identical."""
    tokens = torch.tensor([[0, 1, 2**31 - 1], [2**53 - 1, 151935, 7]], dtype=torch.int64)
    probs = torch.tensor([[1.0, 0.0, 1e-45], [0.333333343, 1.17549435e-38, 0.999999940]], dtype=torch.float32)
    got_tokens, got_probs = read_children(tokens, probs)
    assert got_tokens.dtype == torch.int64 and got_probs.dtype == torch.float32
    assert torch.equal(got_tokens, tokens)
    assert torch.equal(got_probs.view(torch.int32), probs.view(torch.int32))
    empty_tokens, empty_probs = read_children(tokens[:0], probs[:0])
    assert empty_tokens.shape == (0, 3) and empty_probs.shape == (0, 3)
