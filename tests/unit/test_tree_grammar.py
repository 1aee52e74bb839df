"""A grammar over a verification tree (engine/tree_grammar.py): the nodes it allows along their
own paths, and each tree row's bitmask, with a choice grammar whose matcher behaves as vLLM's
backends do (accept, roll back, validate without advancing, stop at termination)."""

from __future__ import annotations

import torch

from vllm_gsd.engine.tree_grammar import allowed_nodes, fill_tree_bitmask, kept_node_count

EOS = 0
VOCAB = 8


class ChoiceGrammar:
    """Allows exactly one of `choices` (token sequences), then EOS; terminated after EOS."""

    def __init__(self, choices):
        self.choices = [list(c) + [EOS] for c in choices]
        self.tokens: list[int] = []

    def _allowed(self, prefix) -> set[int]:
        return {c[len(prefix)] for c in self.choices if len(c) > len(prefix) and c[:len(prefix)] == prefix}

    def is_terminated(self) -> bool:
        return bool(self.tokens) and self.tokens[-1] == EOS

    def accept_tokens(self, request_id, tokens) -> bool:
        for token in tokens:
            if self.is_terminated():
                return True
            if token not in self._allowed(self.tokens):
                return False
            self.tokens.append(token)
        return True

    def validate_tokens(self, tokens) -> list[int]:
        accepted = []
        for token in tokens:
            if self.is_terminated() or not self.accept_tokens("r", [token]):
                break
            accepted.append(token)
        self.rollback(len(accepted))
        return accepted

    def rollback(self, num_tokens: int) -> None:
        del self.tokens[len(self.tokens) - num_tokens:]

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index] = False
        if self.is_terminated():
            bitmask[index] = True
        else:
            bitmask[index, list(self._allowed(self.tokens))] = True


CHOICES = [[1, 2, 3], [1, 4], [5, 6]]


def test_a_node_is_allowed_only_if_its_whole_path_is():
    grammar = ChoiceGrammar(CHOICES)
    # Breadth-first: root children 1, 5, 7 (refused); then 2 and 4 under 1, 6 under 5, 3 under 7.
    parents = [0, 0, 0, 1, 1, 2, 3]
    tokens = [1, 5, 7, 2, 4, 6, 3]
    allowed = allowed_nodes(grammar, tokens, parents)
    assert allowed == [True, True, False, True, True, True, False]
    assert kept_node_count(allowed) == 6  # through the last allowed node: 6 under 5
    # The same tokens in another tree: 2 under 5 is refused (it is allowed only after 1).
    assert allowed_nodes(grammar, [1, 5, 2, 6], [0, 0, 2, 2]) == [True, True, False, True]
    assert kept_node_count([False, False]) == 0
    assert grammar.tokens == []  # the matcher is left as it was


def _rows(grammar, tokens, parents, allowed, size, first_row=0):
    bitmask = torch.zeros(size, VOCAB, dtype=torch.bool)

    def fill(index, constrained):
        if constrained:
            grammar.fill(bitmask, index)
        else:
            bitmask[index] = True

    end = fill_tree_bitmask(grammar, "r", tokens, parents, allowed, fill, first_row)
    assert end == first_row + len(tokens) + 1
    return [set(torch.nonzero(bitmask[i]).flatten().tolist()) for i in range(first_row, end)]


def test_every_row_gets_the_state_after_its_own_path():
    grammar = ChoiceGrammar(CHOICES)
    tokens, parents = [1, 5, 2, 4, 6, 3], [0, 0, 1, 1, 2, 3]
    rows = _rows(grammar, tokens, parents, allowed_nodes(grammar, tokens, parents), 10, first_row=2)
    # root: {1, 5}; after 1: {2, 4}; after 5: {6}; after 1 2: {3}; after 1 4: {EOS};
    # after 5 6: {EOS}; after 1 2 3: {EOS}
    assert rows == [{1, 5}, {2, 4}, {6}, {3}, {EOS}, {EOS}, {EOS}]
    assert grammar.tokens == []


def test_a_refused_node_is_never_accepted_and_its_row_is_never_read():
    """The walk reaches a node only if its parent's row picked its token: a refused node's
    parent row excludes it, so its own row (left open) and its subtree are never read."""
    grammar = ChoiceGrammar(CHOICES)
    tokens, parents = [1, 7, 4, 2], [0, 0, 1, 2]  # 7 refused, 2 below it
    allowed = allowed_nodes(grammar, tokens, parents)
    assert allowed == [True, False, True, False]
    rows = _rows(grammar, tokens, parents, allowed, 5)
    assert 7 not in rows[0] and rows[2] == set(range(VOCAB)) and rows[4] == set(range(VOCAB))
    assert rows[1] == {2, 4} and rows[3] == {EOS}


def test_a_path_past_the_end_of_the_grammar_is_refused():
    grammar = ChoiceGrammar(CHOICES)
    tokens, parents = [1, 4, EOS, 3], [0, 1, 2, 3]  # 1 4 EOS, then a token past the end
    assert allowed_nodes(grammar, tokens, parents) == [True, True, True, False]
    rows = _rows(grammar, tokens[:3], parents[:3], [True] * 3, 5)
    assert rows[3] == set(range(VOCAB))  # after EOS the grammar is terminated: vLLM leaves the row open
    assert grammar.tokens == []


def test_the_drafts_rows_get_the_state_after_their_path():
    """fill_path_bitmasks, as the draft's rows use it: each row the grammar's next tokens after
    its path; a path it refuses, or one that ends the grammar, leaves its row open; the matcher
    is left as it was."""
    from vllm_gsd.engine.tree_grammar import fill_path_bitmasks

    grammar = ChoiceGrammar(CHOICES)
    grammar.accept_tokens("r", [1])  # the committed output
    paths = [[], [2], [2, 3], [4, EOS], [7], [2, 7, 3]]
    bitmask = torch.zeros(len(paths), VOCAB, dtype=torch.bool)

    def fill(row, constrained):
        if constrained:
            grammar.fill(bitmask, row)
        else:
            bitmask[row] = True

    fill_path_bitmasks(grammar, "r", paths, fill)
    rows = [set(torch.nonzero(bitmask[r]).flatten().tolist()) for r in range(len(paths))]
    everything = set(range(VOCAB))
    assert rows == [{2, 4}, {3}, {EOS}, everything, everything, everything]
    assert grammar.tokens == [1]
