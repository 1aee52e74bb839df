"""walk_tree / greedy_accept against a brute-force reference on random trees."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_gsd.graph import AcceptedPaths, GraphBuilder, GraphParams, greedy_accept, walk_tree


def random_bfs_trees(generator, batch, budget, vocab):
    """Random breadth-first trees with distinct sibling tokens, padded per contracts.md."""
    tokens = torch.full((batch, budget), -1)
    parents = torch.full((batch, budget), -1)
    num_nodes = torch.randint(0, budget + 1, (batch,), generator=generator)
    for b in range(batch):
        depth = [0]
        used: dict[int, set] = {}
        for i in range(int(num_nodes[b])):
            # parent among rows of the deepest or second deepest level keeps BFS order valid
            candidates = [r for r in range(i + 1) if depth[r] >= depth[-1] - 1 and len(used.get(r, ())) < vocab]
            parent = candidates[int(torch.randint(0, len(candidates), (1,), generator=generator))]
            if depth[parent] + 1 < depth[-1]:
                parent = i  # keep depths non-decreasing
            free = [t for t in range(vocab) if t not in used.get(parent, set())]
            token = free[int(torch.randint(0, len(free), (1,), generator=generator))]
            used.setdefault(parent, set()).add(token)
            tokens[b, i], parents[b, i] = token, parent
            depth.append(depth[parent] + 1)
    return tokens, parents, num_nodes


def brute_force_greedy(tokens, parents, num_nodes, row_target):
    """Enumerate every root path; keep the longest whose tokens all equal their predecessor's target."""
    batch, budget = tokens.shape
    rows_out, tokens_out, accepted = [], [], []
    for b in range(batch):
        best = [0]
        for end in range(1, int(num_nodes[b]) + 1):
            path = [end]
            while path[-1] != 0:
                path.append(int(parents[b, path[-1] - 1]))
            path = path[::-1]
            if all(int(tokens[b, path[j] - 1]) == int(row_target[b, path[j - 1]]) for j in range(1, len(path))):
                if len(path) > len(best):
                    best = path
        emitted = [int(row_target[b, r]) for r in best]
        rows_out.append(best + [-1] * (budget + 1 - len(best)))
        tokens_out.append(emitted + [-1] * (budget + 1 - len(emitted)))
        accepted.append(len(best) - 1)
    return AcceptedPaths(torch.tensor(rows_out), torch.tensor(tokens_out), torch.tensor(accepted))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), budget=st.integers(1, 24), vocab=st.integers(2, 5))
def test_walk_tree_matches_brute_force(seed, batch, budget, vocab):
    generator = torch.Generator().manual_seed(seed)
    tokens, parents, num_nodes = random_bfs_trees(generator, batch, budget, vocab)
    row_target = torch.randint(0, vocab, (batch, budget + 1), generator=generator)
    got = walk_tree(tokens, parents, num_nodes, row_target)
    want = brute_force_greedy(tokens, parents, num_nodes, row_target)
    assert torch.equal(got.accepted_rows, want.accepted_rows)
    assert torch.equal(got.output_token_ids, want.output_token_ids)
    assert torch.equal(got.num_accepted, want.num_accepted)


def test_greedy_accept_on_built_trees_uses_argmax():
    generator = torch.Generator().manual_seed(0)
    batch, vocab, budget = 8, 5, 20
    params = GraphParams(node_budget=budget, top_k=3, max_depth=4, merge_ngram=1)
    builder = GraphBuilder(params, torch.randint(0, vocab, (batch,), generator=generator), torch.full((batch, 2), -1))
    while (frontier := builder.frontier()) is not None:
        probs = torch.softmax(torch.randn(frontier.token_ids.numel(), vocab, generator=generator), -1)
        top_probs, top_ids = probs.topk(3)
        builder.expand(top_ids, top_probs)
    tree = builder.build_tree()
    logits = torch.randn(batch, budget + 1, vocab, generator=generator)
    # Make the target agree with the first child of many rows, so paths are long.
    first_child = torch.full((batch, budget + 1), -1)
    for b in range(batch):
        for i in reversed(range(int(tree.num_nodes[b]))):
            first_child[b, tree.parent_row[b, i]] = tree.draft_token_ids[b, i]
    agree = (first_child >= 0) & (torch.rand(batch, budget + 1, generator=generator) < 0.8)
    logits[agree.nonzero(as_tuple=True) + (first_child[agree],)] += 100.0
    got = greedy_accept(tree.draft_token_ids, tree.parent_row, tree.num_nodes, logits)
    want = brute_force_greedy(tree.draft_token_ids, tree.parent_row, tree.num_nodes, logits.argmax(-1))
    assert torch.equal(got.accepted_rows, want.accepted_rows)
    assert torch.equal(got.output_token_ids, want.output_token_ids)
    assert got.num_accepted.sum() > batch  # the test exercises multi-node paths


def test_walk_tree_empty_trees_emit_one_token():
    tokens = torch.full((2, 4), -1)
    parents = torch.full((2, 4), -1)
    got = walk_tree(tokens, parents, torch.zeros(2, dtype=torch.long), torch.tensor([[3, 0, 0, 0, 0], [1, 0, 0, 0, 0]]))
    assert got.output_token_ids[:, 0].tolist() == [3, 1]
    assert got.num_accepted.tolist() == [0, 0]
    assert got.accepted_rows[:, 1:].eq(-1).all()
