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
from types import SimpleNamespace
from typing import Protocol

import numpy as np
import torch

from vllm_gsd.engine.staging import HostStaging

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
                 paths: Sequence[Sequence[int]], staging: HostStaging | None = None) -> torch.Tensor:
    """float32 [R, V]: `logits` (float32 [R, V], changed in place) with each row r processed for
    `options[r]` (its request's; None: left as it is) after the tokens `paths[r]` (the row's
    path below the root). Temperature and min_p, which only sampled rows take, are not applied
    here (`min_p_of_rows`). The options' token ids and values reach the device in one stage of
    `staging` (engine/staging.py; None: a pageable one): on a GPU the host does not wait."""
    from vllm.v1.sample.ops.bad_words import apply_bad_words
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    rows = [r for r, o in enumerate(options) if o is not None]
    if not rows:
        return logits
    staging = staging or HostStaging(logits.device, pin_memory=False)
    histories = {r: [*options[r].output_token_ids, *paths[r]] for r in rows}
    plan = _RowPlan.of(options, rows, histories, paths, logits.shape[-1])
    staged = plan.staged(staging)
    negative_infinity = float("-inf")

    # vLLM's order (Sampler.apply_logits_processors): allowed ids, bad words, the processors
    # that change the argmax (min_tokens, then logit_bias), penalties, the thinking budget.
    if plan.allowed_rows.size:  # every id but the allowed ones to -inf: keep those, fill, put back
        allowed_logits = logits[staged.allowed_pairs]
        logits[staged.allowed_rows] = negative_infinity
        logits[staged.allowed_pairs] = allowed_logits
    bad_words = {r: [list(word) for word in options[r].bad_words_token_ids]
                 for r in rows if options[r].bad_words_token_ids}
    if bad_words:
        past = [histories.get(r, []) for r in range(logits.shape[0])]
        apply_bad_words(logits, bad_words, past)  # slices: no copy from the host
    if plan.stopped[0].size:
        logits[staged.stopped] = negative_infinity
    if plan.biased[0].size:
        logits[staged.biased] += staged.bias
    if plan.penalized:
        penalized = staged.penalized
        logits[penalized] = apply_all_penalties(
            logits[penalized], staged.prompts, staged.presence, staged.frequency, staged.repetition,
            [histories[r] for r in plan.penalized])
    if plan.forced[0].size:
        logits[staged.forced] = FORCED_LOGIT
    return logits


@dataclass(frozen=True)
class _RowPlan:
    """process_rows' host arrays: the rows and (row, token) pairs each option touches."""

    allowed_rows: np.ndarray  # rows with allowed ids
    allowed: tuple[np.ndarray, np.ndarray]  # (row, token) of each allowed id
    stopped: tuple[np.ndarray, np.ndarray]  # stop tokens min_tokens holds back
    biased: tuple[np.ndarray, np.ndarray]
    bias: np.ndarray  # float, one per biased pair
    forced: tuple[np.ndarray, np.ndarray]  # the thinking budget's end marker
    penalized: list[int]
    prompts: np.ndarray  # [len(penalized), P], padded with the vocabulary size (vLLM's layout)
    penalties: tuple[np.ndarray, np.ndarray, np.ndarray]  # presence, frequency, repetition

    @classmethod
    def of(cls, options, rows, histories, paths, vocab_size: int) -> _RowPlan:
        allowed = [(r, options[r].allowed_token_ids) for r in rows if options[r].allowed_token_ids is not None]
        stopped = [(r, options[r].stop_token_ids) for r in rows
                   if options[r].min_tokens and len(histories[r]) < options[r].min_tokens]
        biased = [(r, options[r].logit_bias) for r in rows if options[r].logit_bias]
        forced = [(r, options[r].thinking.forced_token(paths[r])) for r in rows if options[r].thinking is not None]
        penalized = [r for r in rows if options[r].has_penalties]
        prompts = [options[r].prompt_token_ids for r in penalized]
        padded = np.full((len(prompts), max((len(p) for p in prompts), default=0)), vocab_size, dtype=np.int64)
        for i, prompt in enumerate(prompts):
            padded[i, :len(prompt)] = prompt
        return cls(
            allowed_rows=np.asarray([r for r, _ in allowed], dtype=np.int64),
            allowed=_pairs(allowed),
            stopped=_pairs(stopped),
            biased=_pairs([(r, list(bias)) for r, bias in biased]),
            bias=np.asarray([b for _, bias in biased for b in bias.values()], dtype=np.float64),
            forced=_pairs([(r, [token]) for r, token in forced if token is not None]),
            penalized=penalized,
            prompts=padded,
            penalties=tuple(np.asarray([getattr(options[r], name) for r in penalized], dtype=np.float64)
                            for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")),
        )

    def staged(self, staging: HostStaging) -> SimpleNamespace:
        """The arrays on the device: one stage."""
        (allowed_rows, allowed_row, allowed_token, stopped_row, stopped_token, biased_row, biased_token, bias,
         forced_row, forced_token, penalized, prompts, presence, frequency, repetition) = staging.stage(
            [self.allowed_rows, *self.allowed, *self.stopped, *self.biased, self.bias, *self.forced,
             np.asarray(self.penalized, dtype=np.int64), self.prompts, *self.penalties])
        return SimpleNamespace(
            allowed_rows=allowed_rows, allowed_pairs=(allowed_row, allowed_token),
            stopped=(stopped_row, stopped_token), biased=(biased_row, biased_token), bias=bias.to(torch.float32),
            forced=(forced_row, forced_token), penalized=penalized, prompts=prompts.view(self.prompts.shape),
            presence=presence.to(torch.float32), frequency=frequency.to(torch.float32),
            repetition=repetition.to(torch.float32))


def _pairs(row_tokens) -> tuple[np.ndarray, np.ndarray]:
    """(row, token) index arrays of [(row, tokens), ...]."""
    row = [r for r, tokens in row_tokens for _ in tokens]
    token = [t for _, tokens in row_tokens for t in tokens]
    return np.asarray(row, dtype=np.int64), np.asarray(token, dtype=np.int64)


def row_paths(parent_row: Sequence[int], tokens: Sequence[int]) -> list[list[int]]:
    """Per row of one tree (row 0 the root, row i node i - 1's), the tokens of its path below
    the root: [] for the root, its parent's path plus its own token for a node (parents precede
    children, as in every proposed tree)."""
    paths: list[list[int]] = [[]]
    for parent, token in zip(parent_row, tokens):
        paths.append([*paths[parent], token])
    return paths


def min_p_of_rows(options: Sequence[RequestOptions | None], staging: HostStaging) -> torch.Tensor | None:
    """float32 [R]: each row's min_p (0: none) on `staging`'s device, or None if no row has one."""
    values = np.asarray([o.min_p if o is not None else 0.0 for o in options], dtype=np.float64)
    return staging.stage([values])[0].to(torch.float32) if values.any() else None
