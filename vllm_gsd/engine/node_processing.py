"""The target's logits at tree rows, processed as vLLM processes a request's next token, each
row with the history of its own path.

vLLM's sampler processes a request's row with the request's output so far: allowed token ids,
bad words, min_tokens and logit_bias, then presence / frequency / repetition penalties, then the
thinking budget's forcing of the end marker (and, for a sampled row, min_p after the
temperature). A tree row predicts the token after its path, so
its history is the request's output tokens followed by the tokens of the row's ancestors and
its own (row 0, the root: none). `process_rows` applies exactly that, in vLLM's order, with
vLLM's own ops where they take a history (penalties, bad words), so every row's argmax or
noisy argmax is the token the target alone would emit after that path: the tree walk stays
exact for requests with these options.

`RequestOptions` holds what a request asks beyond temperature, top-k and top-p; requests
without any get None and their rows are left as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

# vLLM's value for a forced token's logit (ThinkingBudgetStateHolder).
FORCED_LOGIT = 1e9


class PathForcing(Protocol):
    """A request's forced tokens along its tree's paths (the thinking budget's, in the vLLM
    adapter: vllm_v0_32/thinking_budget.py)."""

    def forced_token(self, path: Sequence[int]) -> int | None:
        """The token forced at the row after `path` (the tokens below the root), or None."""


@dataclass(frozen=True)
class RequestOptions:
    """One request's options that change its target rows (vLLM's SamplingParams names)."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # committed before this step
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    min_p: float = 0.0
    thinking: PathForcing | None = None  # the thinking budget's end-marker forcing

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def options_of(params, prompt_token_ids: Sequence[int] | None, output_token_ids: Sequence[int],
               thinking: PathForcing | None = None) -> RequestOptions | None:
    """The options of a request with vLLM SamplingParams `params` (and the forcing of its
    thinking budget, if vLLM tracks one for it); None if it has none."""
    options = RequestOptions(
        prompt_token_ids=() if prompt_token_ids is None else prompt_token_ids,
        output_token_ids=output_token_ids,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        bad_words_token_ids=tuple(tuple(word) for word in params.bad_words_token_ids or ()),
        allowed_token_ids=tuple(params.allowed_token_ids) if params.allowed_token_ids else None,
        logit_bias={int(token): float(bias) for token, bias in params.logit_bias.items()} if params.logit_bias else None,
        min_tokens=params.min_tokens if params.min_tokens > len(output_token_ids) else 0,
        stop_token_ids=tuple(params.all_stop_token_ids or ()) if params.min_tokens > len(output_token_ids) else (),
        min_p=params.min_p,
        thinking=thinking,
    )
    acts = (options.has_penalties or options.bad_words_token_ids or options.allowed_token_ids is not None
            or options.logit_bias or options.min_tokens or options.min_p > 0.0 or thinking is not None)
    return options if acts else None


def process_rows(logits: torch.Tensor, options: Sequence[RequestOptions | None],
                 paths: Sequence[Sequence[int]]) -> torch.Tensor:
    """float32 [R, V]: `logits` (float32 [R, V], changed in place) with each row r processed for
    `options[r]` (its request's; None: left as it is) after the tokens `paths[r]` (the row's
    path below the root). Temperature and min_p, which only sampled rows take, are not applied
    here (`min_p_of_rows`)."""
    from vllm.v1.sample.ops.bad_words import apply_bad_words
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    rows = [r for r, o in enumerate(options) if o is not None]
    if not rows:
        return logits
    histories = {r: [*options[r].output_token_ids, *paths[r]] for r in rows}
    vocab_size = logits.shape[-1]
    negative_infinity = float("-inf")

    # vLLM's order (Sampler.apply_logits_processors): allowed ids, bad words, the processors
    # that change the argmax (min_tokens, then logit_bias), penalties, the thinking budget.
    for r in rows:
        allowed = options[r].allowed_token_ids
        if allowed is not None:
            refused = torch.ones(vocab_size, dtype=torch.bool, device=logits.device)
            refused[list(allowed)] = False
            logits[r].masked_fill_(refused, negative_infinity)
    bad_words = {r: [list(word) for word in options[r].bad_words_token_ids]
                 for r in rows if options[r].bad_words_token_ids}
    if bad_words:
        past = [histories.get(r, []) for r in range(logits.shape[0])]
        apply_bad_words(logits, bad_words, past)
    for r in rows:
        o = options[r]
        if o.min_tokens and len(histories[r]) < o.min_tokens and o.stop_token_ids:
            logits[r, list(o.stop_token_ids)] = negative_infinity
        if o.logit_bias:
            tokens = torch.tensor(list(o.logit_bias), dtype=torch.int64, device=logits.device)
            logits[r, tokens] += torch.tensor(list(o.logit_bias.values()), dtype=torch.float32, device=logits.device)
    penalized = [r for r in rows if options[r].has_penalties]
    if penalized:
        logits[penalized] = apply_all_penalties(
            logits[penalized],
            _padded_prompts([options[r].prompt_token_ids for r in penalized], vocab_size, logits.device),
            _per_row([options[r].presence_penalty for r in penalized], logits.device),
            _per_row([options[r].frequency_penalty for r in penalized], logits.device),
            _per_row([options[r].repetition_penalty for r in penalized], logits.device),
            [histories[r] for r in penalized],
        )
    forced = [(r, options[r].thinking.forced_token(paths[r])) for r in rows if options[r].thinking is not None]
    forced = [(r, token) for r, token in forced if token is not None]
    if forced:
        logits[[r for r, _ in forced], [token for _, token in forced]] = FORCED_LOGIT
    return logits


def row_paths(parent_row: Sequence[int], tokens: Sequence[int]) -> list[list[int]]:
    """Per row of one tree (row 0 the root, row i node i - 1's), the tokens of its path below
    the root: [] for the root, its parent's path plus its own token for a node (parents precede
    children, as in every proposed tree)."""
    paths: list[list[int]] = [[]]
    for parent, token in zip(parent_row, tokens):
        paths.append([*paths[parent], token])
    return paths


def min_p_of_rows(options: Sequence[RequestOptions | None], device) -> torch.Tensor | None:
    """float32 [R]: each row's min_p (0: none), or None if no row has one."""
    values = [o.min_p if o is not None else 0.0 for o in options]
    return torch.tensor(values, dtype=torch.float32, device=device) if any(values) else None


def _padded_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, device) -> torch.Tensor:
    """int64 [R, P]: prompts padded with vocab_size, as vLLM's input batch lays them out."""
    width = max((len(p) for p in prompts), default=0)
    padded = torch.full((len(prompts), width), vocab_size, dtype=torch.int64)
    for i, prompt in enumerate(prompts):
        padded[i, :len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.int64)
    return padded.to(device)


def _per_row(values: list[float], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)
