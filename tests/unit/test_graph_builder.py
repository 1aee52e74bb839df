"""Property tests of GraphBuilder + unrolling on random drafts (small vocab so merges are common)."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_gsd.graph import GraphBuilder, GraphParams, ancestor_words_from_parents
from vllm_gsd.graph import builder as builder_module
from vllm_gsd.graph import unroll as unroll_module
from graph_refs import ReferenceGraph, ancestor_words_reference, reference_tree  # noqa: E402


def random_topk(generator: torch.Generator, num_rows: int, vocab: int, k: int, quantize: bool):
    """Draft top-k (ids, probs descending) from random softmaxes; quantized probs make ties."""
    logits = torch.randn(num_rows, vocab, generator=generator, dtype=torch.float64) * 2.0
    probs = torch.softmax(logits, -1)
    if quantize:
        probs = torch.round(probs * 8) / 8 + 1e-3
        probs = probs / probs.sum(-1, keepdim=True)
    top_probs, top_ids = probs.topk(min(k, vocab), dim=-1)
    return top_ids, top_probs


def primary_words(graph):
    """The reference primary-tree ancestor words of a graph snapshot."""
    return ancestor_words_from_parents(torch.from_numpy(graph.parent_row[:, 1:].copy()),
                                       torch.from_numpy(graph.num_nodes))


def build(params: GraphParams, batch: int, vocab: int, seed: int, quantize: bool = False):
    generator = torch.Generator().manual_seed(seed)
    roots = torch.randint(0, vocab, (batch,), generator=generator)
    history = torch.randint(0, vocab, (batch, 3), generator=generator)
    history[0, :2] = -1  # a short history, left-padded
    builder = GraphBuilder(params, roots, history)
    frontiers = []
    while (frontier := builder.frontier()) is not None:
        frontiers.append(frontier)
        # As the engine does: the draft forward of each level reads the primary-tree words.
        assert torch.equal(builder.draft_ancestor_words, primary_words(builder.graph()))
        check_paths_below_root(builder, frontier)
        ids, probs = random_topk(generator, frontier.request_index.numel(), vocab, params.top_k, quantize)
        builder.expand(ids, probs)
    return builder, frontiers, history


def check_paths_below_root(builder, frontier):
    """Each frontier row's path below its root (what the draft's options are applied after): as
    deep as the row, ending with the row's token, each token its primary parent's child."""
    graph = builder.graph()
    paths = builder.paths_below_root(frontier.request_index.numpy(), frontier.node_row.numpy())
    for b, row, depth, token, path in zip(frontier.request_index.tolist(), frontier.node_row.tolist(),
                                          frontier.depth.tolist(), frontier.token_ids.tolist(), paths):
        assert len(path) == (depth if row else 0)
        node = row
        for expected in reversed(path):
            assert int(graph.token_ids[b, node]) == expected
            node = int(graph.parent_row[b, node])
        assert node == 0 and (not path or path[-1] == token)


def out_edges(graph, b):
    """{src: [(dst, prob, is_pseudo)]} of request b."""
    edges: dict[int, list] = {}
    for g in range(1, int(graph.num_nodes[b]) + 1):
        edges.setdefault(int(graph.parent_row[b, g]), []).append((g, float(graph.edge_prob[b, g]), False))
    for i in np.flatnonzero(graph.pseudo_request == b):
        edges.setdefault(int(graph.pseudo_src[i]), []).append(
            (int(graph.pseudo_dst[i]), float(graph.pseudo_prob[i]), True))
    return edges


def reachable_from(edges, start):
    seen, stack = set(), [start]
    while stack:
        node = stack.pop()
        for dst, _, _ in edges.get(node, []):
            if dst not in seen:
                seen.add(dst)
                stack.append(dst)
    return seen


def primary_context(graph, history, b, g, length):
    """The `length` tokens ending at node g along its primary path, continuing into history."""
    tokens = []
    node = g
    while node >= 0 and len(tokens) < length:
        tokens.append(int(graph.token_ids[b, node]))
        node = int(graph.parent_row[b, node]) if node > 0 else -1
    hist = [int(t) for t in history[b].tolist()]
    while len(tokens) < length:
        tokens.append(hist.pop() if hist else -1)
    return tokens[::-1]


def best_dag_paths(graph, edges, b, limit):
    """Root-to-node DAG paths in descending path prob (best-first search), until `limit` paths and
    every path tied with the last one are out. Returns [(prob, token path, uses_pseudo)]."""
    heap = [(-1.0, 0, (), 0, False)]
    counter = 1
    found = []
    while heap:
        neg_prob, _, tokens, node, pseudo = heapq.heappop(heap)
        if node != 0 or tokens:
            if len(found) >= limit and -neg_prob < found[-1][0]:
                break
            found.append((-neg_prob, tokens, pseudo))
        for dst, prob, is_pseudo in edges.get(node, []):
            heapq.heappush(heap, (neg_prob * prob, counter, tokens + (int(graph.token_ids[b, dst]),), dst,
                                  pseudo or is_pseudo))
            counter += 1
    return found


def check_graph(builder, frontiers, history, params):
    graph = builder.graph()
    batch = graph.num_nodes.shape[0]
    budget = params.node_budget
    assert (graph.num_nodes <= budget).all()
    assert len(frontiers) <= params.max_depth
    # Frontier rows exist, sorted, at the level's depth.
    for level, frontier in enumerate(frontiers):
        assert (frontier.depth == level).all()
        key = frontier.request_index * (budget + 1) + frontier.node_row
        assert (key[1:] > key[:-1]).all()
    merges = np.bincount(graph.pseudo_request, minlength=batch)
    assert (merges == graph.num_merges).all()
    assert (graph.expansions_saved <= graph.num_merges).all()
    if not params.merging:
        assert merges.sum() == 0
    for b in range(batch):
        n = int(graph.num_nodes[b])
        for g in range(1, n + 1):
            parent = graph.parent_row[b, g]
            assert 0 <= parent < g  # parents precede children
            assert graph.depth[b, g] == graph.depth[b, parent] + 1
            assert np.isclose(graph.path_prob[b, g], graph.path_prob[b, parent] * graph.edge_prob[b, g])
        assert (graph.token_ids[b, n + 1:] == -1).all() and (graph.parent_row[b, n + 1:] == -1).all()
        edges = out_edges(graph, b)
        # Acyclic: no node reaches itself.
        for node in range(n + 1):
            assert node not in reachable_from(edges, node)
        # Children tokens distinct per node (pseudo children included).
        for src, outs in edges.items():
            tokens = [int(graph.token_ids[b, dst]) for dst, _, _ in outs]
            assert len(tokens) == len(set(tokens))
        # Merge rule: same token implied by dst; r preceding tokens equal; never into an ancestor.
        for i in np.flatnonzero(graph.pseudo_request == b):
            src, dst = int(graph.pseudo_src[i]), int(graph.pseudo_dst[i])
            assert dst >= 1 and dst != src
            assert src not in reachable_from(edges, dst)
            r = params.merge_ngram
            if r >= 1:
                before_dst = primary_context(graph, history, b, int(graph.parent_row[b, dst]), r)
                assert before_dst == primary_context(graph, history, b, src, r)
            assert 0 < graph.pseudo_prob[i] <= 1  # a real draft prob
    # Primary-tree ancestor words equal the reference from the primary parents.
    assert torch.equal(builder.draft_ancestor_words, primary_words(graph))
    # The out-edge table holds exactly the primary and pseudo edges, by (source node, rank).
    num_rows, width = graph.token_ids.shape[1], params.top_k
    expected_table = {}
    for b in range(batch):
        for src, outs in out_edges(graph, b).items():
            for dst, prob, pseudo in outs:
                rank = int(graph.child_rank[b, dst]) if not pseudo else int(
                    graph.pseudo_rank[(graph.pseudo_request == b) & (graph.pseudo_src == src) & (graph.pseudo_dst == dst)][0])
                expected_table[(b * num_rows + src) * width + rank] = (b * num_rows + dst, prob, pseudo)
    table = {int(slot): (int(graph.out_node[slot]), float(graph.out_prob[slot]), bool(graph.out_pseudo[slot]))
             for slot in np.flatnonzero(graph.out_node >= 0)}
    assert table == expected_table
    sources = {slot // width for slot in expected_table}
    assert set(np.flatnonzero(graph.has_children).tolist()) == sources
    return graph


def check_tree(tree, graph, params):
    budget = params.node_budget
    batch = graph.num_nodes.shape[0]
    assert tree.draft_token_ids.shape == (batch, budget)
    assert tree.ancestor_words.dtype == torch.int32
    assert torch.equal(tree.ancestor_words, ancestor_words_reference(tree.parent_row, tree.num_nodes, budget))
    for b in range(batch):
        n = int(tree.num_nodes[b])
        assert n <= budget
        parents = tree.parent_row[b].tolist()
        depths = [0] + tree.depth[b].tolist()
        for i in range(n):
            assert 0 <= parents[i] < i + 1
            assert depths[i + 1] == depths[parents[i]] + 1
            assert i == 0 or depths[i + 1] >= depths[i]  # breadth-first: every prefix is a tree
        assert tree.draft_token_ids[b, n:].eq(-1).all() and tree.parent_row[b, n:].eq(-1).all()
        assert tree.depth[b, n:].eq(0).all() and tree.graph_row[b, n:].eq(-1).all()
        # Root-to-node token paths of the tree.
        paths = {0: ((), 1.0, False)}
        for i in range(n):
            ptokens, pprob, pvia = paths[parents[i]]
            graph_row = int(tree.graph_row[b, i])
            token = int(tree.draft_token_ids[b, i])
            assert token == graph.token_ids[b, graph_row]
            paths[i + 1] = (ptokens + (token,), float(tree.path_prob[b, i]), bool(tree.via_merge[b, i]))
        tree_paths = {tokens: (prob, via) for tokens, prob, via in list(paths.values())[1:]}
        assert len(tree_paths) == n  # distinct paths
        dag = {tokens: (prob, via) for prob, tokens, via in best_dag_paths(graph, out_edges(graph, b), b, budget)}
        # Every tree node is a DAG path with the same probability and merge flag.
        for tokens, (prob, via) in tree_paths.items():
            assert tokens in dag
            assert np.isclose(prob, dag[tokens][0], rtol=1e-12)
            assert via == dag[tokens][1]
        # The tree keeps the top-N paths: as many as possible, none better left out.
        assert n == min(budget, len(dag)) or len(dag) > budget
        if n:
            worst_kept = min(prob for prob, _ in tree_paths.values())
            for tokens, (prob, _) in dag.items():
                if prob > worst_kept * (1 + 1e-12):
                    assert tokens in tree_paths
            probs_sorted = sorted((p for p, _ in dag.values()), reverse=True)[:n]
            assert np.allclose(sorted((p for p, _ in tree_paths.values()), reverse=True), probs_sorted, rtol=1e-12)
        if len(set(p for p, _ in dag.values())) == len(dag):  # no ties: the exact same set
            top = sorted(dag.items(), key=lambda item: -item[1][0])[:budget]
            assert set(tree_paths) == {tokens for tokens, _ in top}
        # Row by row, ties included, the tree of the rule's brute-force reference.
        expected = reference_tree(graph, b, budget)
        if expected is not None:
            got = [(int(tree.draft_token_ids[b, i]), parents[i], depths[i + 1], float(tree.path_prob[b, i]),
                    bool(tree.via_merge[b, i]), int(tree.graph_row[b, i]), int(tree.child_rank[b, i]))
                   for i in range(n)]
            assert got == expected




params_strategy = st.builds(
    GraphParams,
    node_budget=st.integers(1, 40),
    top_k=st.integers(1, 4),
    max_depth=st.integers(1, 6),
    merge_ngram=st.integers(-1, 3),
    min_child_ratio=st.sampled_from([0.0, 0.1, 0.3]),
    leaf_prob=st.sampled_from([0.0, 0.05, 0.2]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=params_strategy, batch=st.integers(1, 4), vocab=st.integers(2, 6),
       seed=st.integers(0, 2**31 - 1), quantize=st.booleans())
def test_graph_and_tree_properties(params, batch, vocab, seed, quantize):
    builder, frontiers, history = build(params, batch, vocab, seed, quantize)
    graph = check_graph(builder, frontiers, history, params)
    check_tree(builder.build_tree(), graph, params)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=params_strategy, batch=st.integers(1, 4), vocab=st.integers(2, 6),
       seed=st.integers(0, 2**31 - 1), quantize=st.booleans())
def test_graph_is_the_reference_rule(params, batch, vocab, seed, quantize):
    """Node by node and edge by edge, the graph the plain-Python rule (graph_refs) drafts from
    the same top-k: every frontier, row, parent, probability and pseudo edge, in order."""
    generator = torch.Generator().manual_seed(seed)
    roots = torch.randint(0, vocab, (batch,), generator=generator)
    history = torch.randint(0, vocab, (batch, 3), generator=generator)
    history[0, :2] = -1
    builder, reference = GraphBuilder(params, roots, history), ReferenceGraph(params, roots.tolist(), history.tolist())
    while (frontier := builder.frontier()) is not None:
        assert list(zip(frontier.request_index.tolist(), frontier.node_row.tolist())) == reference.frontier
        ids, probs = random_topk(generator, frontier.request_index.numel(), vocab, params.top_k, quantize)
        builder.expand(ids, probs)
        reference.expand(ids.tolist(), probs.tolist())
    assert reference.frontier == [] or reference.level == params.max_depth
    graph = builder.graph()
    for b, nodes in enumerate(reference.nodes):
        n = len(nodes)
        assert graph.num_nodes[b] == n - 1
        for name, field in (("token_ids", "token"), ("parent_row", "parent"), ("depth", "depth"),
                            ("edge_prob", "edge_prob"), ("path_prob", "path_prob"), ("child_rank", "rank")):
            assert getattr(graph, name)[b, :n].tolist() == [node[field] for node in nodes], name
        mine = graph.pseudo_request == b
        got = list(zip(graph.pseudo_src[mine].tolist(), graph.pseudo_dst[mine].tolist(),
                       graph.pseudo_prob[mine].tolist(), graph.pseudo_rank[mine].tolist()))
        assert got == reference.pseudo[b]
        assert graph.num_merges[b] == len(reference.pseudo[b]) and graph.expansions_saved[b] == reference.saved[b]


def test_merges_happen_and_save_expansions():
    params = GraphParams(node_budget=40, top_k=3, max_depth=5, merge_ngram=0)
    builder, _, _ = build(params, batch=4, vocab=4, seed=1)
    tree = builder.build_tree()
    assert tree.num_merges.sum() > 0 and tree.expansions_saved.sum() > 0
    assert tree.via_merge.any()


def test_no_merge_builds_plain_topk_tree():
    params = GraphParams(node_budget=1 + 3 + 9, top_k=3, max_depth=2, merge_ngram=-1)
    builder, frontiers, _ = build(params, batch=2, vocab=8, seed=3)
    tree = builder.build_tree()
    assert len(frontiers) == 2
    assert tree.num_nodes.tolist() == [12, 12]
    assert not tree.via_merge.any()
    assert tree.depth[:, :3].eq(1).all() and tree.depth[:, 3:12].eq(2).all()


def test_merge_into_same_level_sibling_branch():
    # Root 7 -> children a=1, b=2; both propose token 5; with r = 0 the second 5 merges.
    params = GraphParams(node_budget=8, top_k=2, max_depth=2, merge_ngram=0)
    builder = GraphBuilder(params, torch.tensor([7]), torch.full((1, 2), -1))
    builder.expand(torch.tensor([[1, 2]]), torch.tensor([[0.6, 0.4]]))
    frontier = builder.frontier()
    assert frontier.node_row.tolist() == [1, 2]
    builder.expand(torch.tensor([[5, 3], [5, 4]]), torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    graph = builder.graph()
    # The leader is the 5 with the larger path prob (0.4 * 0.9 = 0.36 > 0.3), created under row 2.
    assert graph.num_nodes.tolist() == [5]
    assert graph.pseudo_src.tolist() == [1] and graph.token_ids[0, graph.pseudo_dst[0]] == 5
    assert graph.parent_row[0, graph.pseudo_dst[0]] == 2
    assert graph.num_merges.tolist() == [1]
    tree = builder.build_tree()
    assert tree.num_nodes.tolist() == [6]  # 5 graph nodes + 1 copy of the merged 5
    assert tree.via_merge.sum().item() == 1


def test_merge_never_closes_a_cycle():
    # Chain 9 -> 1 -> 2; then node 2 proposes token 1: with r = 0 the existing 1 is an ancestor
    # of 2, so a new node is made instead of a pseudo edge.
    params = GraphParams(node_budget=8, top_k=1, max_depth=3, merge_ngram=0)
    builder = GraphBuilder(params, torch.tensor([9]), torch.full((1, 1), -1))
    builder.expand(torch.tensor([[1]]), torch.tensor([[0.9]]))
    builder.expand(torch.tensor([[2]]), torch.tensor([[0.9]]))
    builder.expand(torch.tensor([[1]]), torch.tensor([[0.9]]))
    graph = builder.graph()
    assert graph.num_merges.tolist() == [0]
    assert graph.num_nodes.tolist() == [3]


def test_merge_ngram_uses_history_for_shallow_nodes():
    # r = 2: the depth-1 node 4 has preceding tokens (h=3, root=8). A deeper node whose last two
    # tokens are (3, 8) proposing 4 merges into it.
    params = GraphParams(node_budget=10, top_k=2, max_depth=3, merge_ngram=2)
    builder = GraphBuilder(params, torch.tensor([8]), torch.tensor([[-1, 3]]))
    builder.expand(torch.tensor([[4, 3]]), torch.tensor([[0.6, 0.4]]))  # rows 1 (4), 2 (3)
    builder.expand(torch.tensor([[5, 6], [8, 6]]), torch.tensor([[0.5, 0.5], [0.5, 0.5]]))  # row 5 = 8 under 3
    frontier = builder.frontier()
    rows = frontier.node_row.tolist()
    ids = torch.tensor([[7, 1]] * len(rows))
    ids[rows.index(5)] = torch.tensor([4, 1])
    builder.expand(ids, torch.full((len(rows), 2), 0.5))
    graph = builder.graph()
    assert graph.pseudo_src.tolist() == [5] and graph.pseudo_dst.tolist() == [1]


def test_params_validation():
    with pytest.raises(ValueError, match="top_k"):
        GraphParams(node_budget=4, top_k=0, max_depth=2, merge_ngram=1)
    with pytest.raises(ValueError, match="merge_ngram"):
        GraphParams(node_budget=4, top_k=2, max_depth=2, merge_ngram=-2)
    with pytest.raises(ValueError, match="node_budget"):
        GraphParams(node_budget=0, top_k=2, max_depth=2, merge_ngram=1)


def best_first_rows(tree, b):
    """Tree rows of request b best first: path prob descending, then shallower, then row (rows
    of one depth with one path prob are in creation order)."""
    n = int(tree.num_nodes[b])
    return sorted(range(1, n + 1), key=lambda r: (-float(tree.path_prob[b, r - 1]), int(tree.depth[b, r - 1]), r))


def check_budget_cut(small, full, budget):
    """`small` is the first budget[b]-best subset of `full`, rows in the same relative order,
    parents renumbered, padding as contracts.md says."""
    width = full.draft_token_ids.shape[1]
    for b in range(full.num_nodes.shape[0]):
        kept = sorted(best_first_rows(full, b)[: int(budget[b])])
        n = len(kept)
        assert int(small.num_nodes[b]) == n
        new_row = {0: 0, **{old: new + 1 for new, old in enumerate(kept)}}
        index = torch.tensor(kept, dtype=torch.long) - 1
        for name in ("draft_token_ids", "depth", "path_prob", "via_merge", "graph_row", "child_rank"):
            assert torch.equal(getattr(small, name)[b, :n], getattr(full, name)[b, index]), name
        assert small.parent_row[b, :n].tolist() == [new_row[int(p)] for p in full.parent_row[b, index]]
        assert small.draft_token_ids[b, n:].eq(-1).all() and small.parent_row[b, n:].eq(-1).all()
        assert small.depth[b, n:].eq(0).all() and small.graph_row[b, n:].eq(-1).all()
        assert small.child_rank[b, n:].eq(-1).all() and small.path_prob[b, n:].eq(0).all()
    assert small.draft_token_ids.shape == (full.num_nodes.shape[0], width)
    assert torch.equal(small.ancestor_words, ancestor_words_reference(small.parent_row, small.num_nodes, width))
    for name in ("num_graph_nodes", "num_merges", "expansions_saved"):
        assert torch.equal(getattr(small, name), getattr(full, name))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=params_strategy, batch=st.integers(1, 4), vocab=st.integers(2, 6),
       seed=st.integers(0, 2**31 - 1), quantize=st.booleans(), data=st.data())
def test_node_budget_keeps_the_best_subset(params, batch, vocab, seed, quantize, data):
    builder, _, _ = build(params, batch, vocab, seed, quantize)
    full = builder.build_tree()
    budget = data.draw(st.lists(st.integers(0, params.node_budget), min_size=batch, max_size=batch))
    check_budget_cut(builder.build_tree(torch.tensor(budget)), full, budget)
    check_budget_cut(builder.build_tree(np.array(budget)), full, budget)
    one = data.draw(st.integers(0, params.node_budget))
    check_budget_cut(builder.build_tree(one), full, [one] * batch)
    assert torch.equal(builder.build_tree(params.node_budget).parent_row, full.parent_row)


def test_node_budget_zero_gives_empty_trees():
    params = GraphParams(node_budget=12, top_k=3, max_depth=3, merge_ngram=1)
    builder, _, _ = build(params, batch=3, vocab=4, seed=5)
    tree = builder.build_tree(torch.zeros(3, dtype=torch.int64))
    assert tree.num_nodes.tolist() == [0, 0, 0]
    assert tree.draft_token_ids.eq(-1).all() and tree.parent_row.eq(-1).all()
    assert torch.equal(tree.ancestor_words, ancestor_words_reference(tree.parent_row, tree.num_nodes, 12))


@pytest.mark.parametrize("budget", [13, -1, [1, 2], [1.0, 2.0, 3.0], [[1, 2, 3]]])
def test_node_budget_rejects_bad_values(budget):
    params = GraphParams(node_budget=12, top_k=3, max_depth=3, merge_ngram=1)
    builder, _, _ = build(params, batch=3, vocab=4, seed=5)
    with pytest.raises(ValueError, match="node_budget"):
        builder.build_tree(np.array(budget) if isinstance(budget, list) else budget)


@pytest.mark.parametrize("merge_ngram", [0, 1, 2])
def test_degenerate_hashes_give_the_same_graph(monkeypatch, merge_ngram):
    """Every n-gram hashing to one slot (of the drafted n-grams' tables and of each level's new
    n-grams) must only cost time: n-grams are confirmed exactly."""
    params = GraphParams(node_budget=30, top_k=3, max_depth=5, merge_ngram=merge_ngram)
    expected, _, _ = build(params, batch=4, vocab=3, seed=11)
    monkeypatch.setattr(builder_module, "_GOLDEN", np.uint64(0))  # every hash is 0
    got, _, _ = build(params, batch=4, vocab=3, seed=11)
    graph, reference = got.graph(), expected.graph()
    assert reference.num_merges.sum() > 0
    for name in ("token_ids", "parent_row", "path_prob", "pseudo_src", "pseudo_dst", "pseudo_request", "num_merges"):
        assert np.array_equal(getattr(graph, name), getattr(reference, name)), name
    assert torch.equal(got.build_tree().parent_row, expected.build_tree().parent_row)


def test_many_copies_are_pruned_by_the_best_so_far():
    """With two tokens and r = 0 nearly every child merges, so the DAG has far more paths than
    N: past 2N generated paths per request the N-th best so far prunes too, and the tree is
    still the exact top N."""
    params = GraphParams(node_budget=16, top_k=2, max_depth=6, merge_ngram=0)
    builder, frontiers, history = build(params, batch=3, vocab=2, seed=2)
    graph = check_graph(builder, frontiers, history, params)
    check_tree(builder.build_tree(), graph, params)
    width = params.node_budget
    raised = unroll_module._unroll_requests(graph.token_ids, graph.path_prob, graph.num_nodes, graph.has_children,
                                            graph.out_node, graph.out_prob, graph.out_pseudo, np.full(3, width),
                                            np.empty((5, 3, width), np.int64), np.empty((3, width)),
                                            np.empty((3, width), bool), np.empty(3, np.int64))
    assert raised > 0
