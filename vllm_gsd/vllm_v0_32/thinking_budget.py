"""A thinking budget along every path of a tree, with vLLM 0.32's own state machine.

vLLM keeps one thinking-budget state per request (`ThinkingBudgetStateHolder`,
vllm/v1/sample/thinking_budget_state.py): each time the sampler samples a request's next token,
the state is updated with the request's output so far (`update_state`) and, once the thinking
section has used its budget, the row is forced to the next token of the end marker
(`apply_to_logits`). The target alone does this once per token.

A tree's row predicts the token after its own path, so its state is the state the target alone
would hold after emitting that path: the request's state before this step, updated with the
committed output (the root's row), then with each token of the path in turn. `PathThinking`
computes those states on demand, one update per path token with vLLM's own `update_state` and
`apply_to_logits` on a one-request scratch holder, and memoises them by path (a tree's rows
share their prefixes). After the walk, `commit` leaves the request's real state as the target
alone would hold it after the accepted path, so the next step's root row continues from there.

Every row a gsd engine's Sampler sees is one request's next token (a plain step's rows, or the
roots of a tree step), as in an engine without speculation: `as_next_token_rows` makes the
engine's holder lay its rows out and count its tokens as such an engine's does (it would
otherwise expect per-draft-token rows, force the end of thinking on the wrong row, and, told
these are bonus rows, skip the forcing of a second thinking section). The scratch holders are
made the same way.

The scratch forcing holder lists the end marker's positions (0, 1, ...) as its tokens, so
`apply_to_logits` marks a row of width len(end marker): the marked column is the position of
the forced token in the marker. What the forcing does to the state is vLLM's code too.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.v1.sample.thinking_budget_state import ThinkingBudgetStateHolder


def as_next_token_rows(holder: ThinkingBudgetStateHolder) -> None:
    """The holder's rows are one per request, each its next token (see the module's docstring)."""
    holder.in_spec_mode = False


def _scratch_holder(start_ids, end_ids) -> ThinkingBudgetStateHolder:
    markers = SimpleNamespace(reasoning_start_token_ids=list(start_ids), reasoning_end_token_ids=list(end_ids))
    return ThinkingBudgetStateHolder(markers, max_num_seqs=1, num_spec_tokens=0, device=torch.device("cpu"),
                                     is_pin_memory=False)


class PathThinking:
    """One request's thinking-budget state after each path of its tree, for one step.

    holder: the engine's ThinkingBudgetStateHolder; batch_index: the request's row in it;
    output_token_ids: the request's committed output (read on first use, within the step).
    Made before the step's sampler runs: the state then is the one before the root's row.
    """

    def __init__(self, holder: ThinkingBudgetStateHolder, batch_index: int, output_token_ids: list[int]):
        self._holder, self._index, self._output = holder, batch_index, output_token_ids
        self._before_root = dict(holder._state[batch_index])
        self._end_ids = list(holder.think_end_token_ids)
        self._updater = _scratch_holder(holder.think_start_token_ids, self._end_ids)
        self._forcer = _scratch_holder(holder.think_start_token_ids, range(len(self._end_ids)))
        self._history: list[int] | None = None
        self._after: dict[tuple[int, ...], tuple[dict, int | None]] = {}

    @classmethod
    def of(cls, holder: ThinkingBudgetStateHolder | None, batch_index: int,
           output_token_ids: list[int]) -> PathThinking | None:
        """The request's PathThinking, or None when vLLM tracks no budget for it."""
        if holder is None or batch_index not in holder._state or not holder.think_end_token_ids:
            return None
        return cls(holder, batch_index, output_token_ids)

    def forced_token(self, path) -> int | None:
        """The token vLLM forces at the row after `path` (the tokens below the root), or None."""
        return self._state_after(tuple(path))[1]

    def commit(self, accepted_path) -> None:
        """Leave the request's state in vLLM's holder as after the row that emitted the step's
        last token (the end of the accepted path): as the target alone would leave it."""
        self._holder._state[self._index] = self._state_after(tuple(accepted_path))[0]

    def _state_after(self, path: tuple[int, ...]) -> tuple[dict, int | None]:
        if path not in self._after:
            if self._history is None:
                self._history = list(self._output)
            before = self._before_root if not path else self._state_after(path[:-1])[0]
            self._after[path] = self._sample_row(before, self._history + list(path))
        return self._after[path]

    def _sample_row(self, before: dict, history: list[int]) -> tuple[dict, int | None]:
        """What vLLM's sampler does to the state at a row whose output so far is `history`, and
        the token it forces there (None: none)."""
        state = dict(before)  # vLLM replaces the state's lists, never changes them in place
        self._updater._state = {0: state}
        self._updater.update_state([history], None)
        self._forcer._state = {0: state}
        marks = self._forcer.apply_to_logits(torch.zeros(1, len(self._end_ids)), predict_bonus_token=False,
                                             spec_token_ids=None)
        forced = torch.nonzero(marks[0]).flatten().tolist()
        return state, (self._end_ids[forced[0]] if forced else None)
