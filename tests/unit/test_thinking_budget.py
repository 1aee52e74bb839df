"""A thinking budget on trees (vllm_v0_32/thinking_budget.py) against the target alone.

The reference is vLLM's own ThinkingBudgetStateHolder as an engine without speculation runs it:
one update and one forcing per token. The tree side runs a speculative engine's holder as
GsdSampler does (its root rows, `as_next_token_rows`) and PathThinking for the tree rows, step after step, with
trees whose rows follow the target's trajectory and branch off it. Every row whose path the
target alone could emit must get the token the target alone forces after that path; after each
step the holder continues from the accepted path as the target alone would.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_gsd.vllm_v0_32.thinking_budget import PathThinking, as_next_token_rows

VOCAB = 8
NUM_SPEC_TOKENS = 4  # a gsd engine's holder has speculative tokens configured


def _holder(start, end, num_spec_tokens):
    """vLLM's holder for one request; a speculative engine's (num_spec_tokens > 0) as GsdSampler
    uses it."""
    from vllm.v1.sample.logits_processor.interface import BatchUpdate
    from vllm.v1.sample.thinking_budget_state import ThinkingBudgetStateHolder

    markers = SimpleNamespace(reasoning_start_token_ids=start, reasoning_end_token_ids=end)
    holder = ThinkingBudgetStateHolder(markers, 1, num_spec_tokens, torch.device("cpu"), False)
    if num_spec_tokens:
        as_next_token_rows(holder)
    return holder, BatchUpdate


def _add(holder, batch_update, prompt, budget, output):
    params = SimpleNamespace(thinking_token_budget=budget)
    holder.sync_batch(batch_update(batch_size=1, removed=[], added=[(0, params, prompt, output)], moved=[]))


def _forced(holder, output):
    """The token the holder forces on the request's next row (None: none), as vLLM's Sampler
    applies it to a row of next tokens (GsdSampler's, and an engine's without speculation)."""
    holder.update_state([output], None)
    logits = holder.apply_to_logits(torch.zeros(1, VOCAB), False, None)
    return int(logits[0].argmax()) if logits[0].max() > 0 else None


def target_alone(markers, prompt, budget, wished):
    """(tokens, forced): what an engine without speculation emits where the model would emit
    `wished`, and the token forced at each position (None: none)."""
    holder, batch_update = _holder(*markers, num_spec_tokens=0)
    output: list[int] = []
    _add(holder, batch_update, prompt, budget, output)
    forced = []
    for token in wished:
        forced.append(_forced(holder, output))
        output.append(token if forced[-1] is None else forced[-1])
    return output, forced


MARKERS = st.sampled_from([([1], [2]), ([1], [2, 3]), ([1, 4], [2, 3, 5])])


@st.composite
def requests(draw):
    markers = draw(MARKERS)
    start, end = markers
    marker_tokens = st.sampled_from(start + end)
    token = st.one_of(st.integers(0, VOCAB - 1), marker_tokens)
    prompt = draw(st.lists(token, max_size=6)) + draw(st.sampled_from([[], start]))
    budget = draw(st.integers(0, 6))
    wished = draw(st.lists(token, min_size=8, max_size=30))
    # Per step: the accepted nodes, and a branch off the trajectory at each depth (or none).
    steps = draw(st.lists(st.tuples(st.integers(0, 4), st.lists(st.one_of(st.none(), token), max_size=4)),
                          min_size=1, max_size=12))
    return markers, prompt, budget, wished, steps


@settings(max_examples=150, deadline=None)
@given(requests())
def test_every_row_forces_what_the_target_alone_forces_after_its_path(request_case):
    markers, prompt, budget, wished, steps = request_case
    tokens, forced = target_alone(markers, prompt, budget, wished)

    holder, batch_update = _holder(*markers, num_spec_tokens=NUM_SPEC_TOKENS)
    output: list[int] = []
    _add(holder, batch_update, prompt, budget, output)
    for num_accepted, branches in steps:
        t = len(output)
        if t >= len(tokens):
            break
        paths = PathThinking.of(holder, 0, output)
        # The root's row: vLLM's sampler on the engine's holder, as GsdSampler runs it.
        assert _forced(holder, output) == forced[t]
        trajectory = tokens[t:t + NUM_SPEC_TOKENS]
        for depth in range(1, len(trajectory)):
            path = trajectory[:depth]
            assert paths.forced_token(path) == forced[t + depth], (t, path)
            branch = branches[depth - 1] if depth - 1 < len(branches) else None
            if branch is not None:  # a node off the trajectory: the target alone after its path
                off = [*path[:-1], branch]
                history, off_forced = target_alone(markers, prompt, budget, [*output, *off, 0])
                if history[:-1] == [*output, *off]:  # a path the target alone can emit
                    assert paths.forced_token(off) == off_forced[-1], (t, off)
        accepted = trajectory[:min(num_accepted, len(trajectory) - 1)]
        paths.commit(accepted)
        output.extend(tokens[t:t + len(accepted) + 1])  # the accepted nodes and the bonus token


def test_a_budget_used_inside_a_tree_forces_the_end_marker_on_the_row_after_it():
    """A request thinking from its prompt with a budget of 2: the rows after 2 thinking tokens
    are forced to the end marker, token by token, whichever branch they are on."""
    start, end = [1], [2, 3]
    holder, batch_update = _holder(start, end, NUM_SPEC_TOKENS)
    output: list[int] = []
    _add(holder, batch_update, [0, 5] + start, 2, output)
    paths = PathThinking.of(holder, 0, output)
    assert _forced(holder, output) is None
    assert paths.forced_token([6]) is None
    assert paths.forced_token([6, 7]) == 2 and paths.forced_token([7, 6]) == 2
    assert paths.forced_token([6, 7, 2]) == 3
    assert paths.forced_token([6, 7, 2, 3]) is None
    paths.commit([6, 7, 2])  # the bonus token is the end marker's second
    output.extend([6, 7, 2, 3])
    assert _forced(holder, output) is None


def test_requests_without_a_budget_have_no_forcing():
    holder, batch_update = _holder([1], [2], NUM_SPEC_TOKENS)
    assert PathThinking.of(holder, 0, []) is None  # vLLM tracks no budget for row 0
    assert PathThinking.of(None, 0, []) is None  # no reasoning markers configured


@pytest.mark.parametrize("budget", [1, 3])
def test_process_rows_forces_the_row_after_the_budget(budget):
    """engine/node_processing.process_rows applies the forcing last, over the penalties: the
    first forced row is the one after `budget` thinking tokens."""
    from vllm_gsd.engine.node_processing import options_of, process_rows

    holder, batch_update = _holder([1], [2], NUM_SPEC_TOKENS)
    output: list[int] = []
    _add(holder, batch_update, [0, 1], budget, output)
    params = SimpleNamespace(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.5,
                             bad_words_token_ids=None, allowed_token_ids=None, logit_bias=None, min_tokens=0,
                             all_stop_token_ids=None, min_p=0.0)
    options = options_of(params, [0, 1], output, PathThinking.of(holder, 0, output))
    _forced(holder, output)  # the root's row, as the sampler does first
    paths = [[5] * depth for depth in range(1, 6)]
    logits = process_rows(torch.randn(len(paths), VOCAB), [options] * len(paths), paths)
    forced_rows = [r for r in range(len(paths)) if int(logits[r].argmax()) == 2 and logits[r, 2] >= 1e8]
    assert forced_rows[0] == budget - 1, forced_rows
