"""A request's grammar over a verification tree: which nodes it allows, and each row's bitmask.

vLLM checks a chain of drafts against a grammar by feeding the chain to the request's matcher
and rolling it back (vllm/v1/structured_output/__init__.py). A tree has many paths: each node is
checked, and each tree row's bitmask filled, with the matcher advanced along that node's own
path from the root and rolled back after. Row j of a tree is the root (j = 0) or node j - 1, in
the breadth-first order the target verifies them; `parents[i]` is node i's parent row.

* `allowed_nodes`: whether the grammar allows each node's path. A node it refuses can never be
  accepted: its parent's row, masked with the grammar's state, excludes its token, so the walk
  never reaches it or any node below it. Such nodes may stay in the tree (their siblings stay
  useful, unlike a chain's drafts after a refused one); nodes past the last allowed one are cut.
* `fill_tree_bitmask`: each allowed row's next tokens, the state after its path; a refused
  node's row is left open (never read).
* `fill_path_bitmasks`: the same for any paths (the draft's rows, which choose their children
  among the tokens the grammar allows after their path: `PathGrammar`).

`grammar` is vLLM's StructuredOutputGrammar (any backend): `validate_tokens`, `accept_tokens`,
`rollback`, `is_terminated`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from vllm_gsd.engine.node_processing import row_paths
from vllm_gsd.engine.staging import HostStaging


class PathGrammar(Protocol):
    """A request's grammar as the draft sees it (the vLLM adapter's: vllm_v0_32/draft_grammar.py)."""

    def mask(self, scores: torch.Tensor, paths: Sequence[Sequence[int]], staging: HostStaging) -> None:
        """Set to -inf, in each row r of scores (float32 [R, V]), the tokens the grammar refuses
        after the committed output and then paths[r]; a row whose path it refuses is left. Host
        arrays reach the scores' device through `staging` (engine/staging.py)."""


def allowed_nodes(grammar, tokens: Sequence[int], parents: Sequence[int]) -> list[bool]:
    """Per node (breadth-first), whether the grammar allows its whole path."""
    allowed = [True]  # the root row's state is the grammar's own
    for parent, path in zip(parents, row_paths(parents, tokens)[1:]):
        allowed.append(allowed[parent] and len(grammar.validate_tokens(path)) == len(path))
    return allowed[1:]


def kept_node_count(allowed: Sequence[bool]) -> int:
    """How many leading nodes to verify: through the last allowed one (a prefix of a
    breadth-first order is a tree)."""
    return max((i + 1 for i, ok in enumerate(allowed) if ok), default=0)


def fill_tree_bitmask(grammar, request_id: str, tokens: Sequence[int], parents: Sequence[int],
                      allowed: Sequence[bool], fill_row: Callable[[int, bool], None], first_row: int) -> int:
    """Fill rows first_row .. first_row + len(tokens) (the root's, then each node's) through
    `fill_row(index, constrained)`, which reads the grammar's state where `constrained` (else
    leaves the row open); return the next free row. The matcher is left as it was."""
    for j, path in enumerate(row_paths(parents, tokens)):
        if j and not allowed[j - 1]:
            fill_row(first_row + j, False)
            continue
        advanced = _advance(grammar, request_id, path)
        fill_row(first_row + j, True)
        if advanced:
            grammar.rollback(advanced)
    return first_row + len(tokens) + 1


def fill_path_bitmasks(grammar, request_id: str, paths: Sequence[Sequence[int]],
                       fill_row: Callable[[int, bool], None]) -> None:
    """Fill row r (through `fill_row(r, constrained)`, as `fill_tree_bitmask`) with the grammar's
    state after paths[r]; open (constrained False) where the grammar refuses the path or ends
    with it. The matcher is left as it was."""
    for r, path in enumerate(paths):
        path = list(path)
        # Validated first: vLLM's backends log an error for every token accept_tokens refuses.
        if grammar.is_terminated() or len(grammar.validate_tokens(path)) != len(path):
            fill_row(r, False)
            continue
        advanced = _advance(grammar, request_id, path)
        fill_row(r, not grammar.is_terminated())
        if advanced:
            grammar.rollback(advanced)


def _advance(grammar, request_id: str, path: Sequence[int]) -> int:
    """Feed `path` to the matcher one token at a time; the number of tokens it took (none past
    its termination, as vLLM's backends ignore them)."""
    advanced = 0
    for token in path:
        if grammar.is_terminated() or not grammar.accept_tokens(request_id, [token]):
            break
        advanced += 1
    return advanced
