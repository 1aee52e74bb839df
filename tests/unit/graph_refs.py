"""Brute-force references shared by the graph tests."""

import numpy as np
import torch


def ancestor_words_reference(parent_row, num_nodes, budget):
    """Ancestor bitmask words by walking each row up to the root (contracts.md bit layout)."""
    batch = parent_row.shape[0]
    words = (budget + 1 + 31) // 32
    out = np.zeros((batch, budget + 1, words), dtype=np.int64)
    for b in range(batch):
        for row in range(budget + 1):
            node = row
            bits = {row}
            if 1 <= row <= int(num_nodes[b]):
                while node != 0:
                    node = int(parent_row[b, node - 1])
                    bits.add(node)
            for c in bits:
                out[b, row, c // 32] |= 1 << (c % 32)
    out = np.where(out >= 2**31, out - 2**32, out)
    return torch.from_numpy(out.astype(np.int32))


def dag_edges(graph, b):
    """{src row: [(dst row, prob, rank, is_pseudo)]} of request b, primary and pseudo edges."""
    edges: dict[int, list] = {}
    for g in range(1, int(graph.num_nodes[b]) + 1):
        edges.setdefault(int(graph.parent_row[b, g]), []).append(
            (g, float(graph.edge_prob[b, g]), int(graph.child_rank[b, g]), False))
    for i in np.flatnonzero(graph.pseudo_request == b):
        edges.setdefault(int(graph.pseudo_src[i]), []).append(
            (int(graph.pseudo_dst[i]), float(graph.pseudo_prob[i]), int(graph.pseudo_rank[i]), True))
    return edges


def all_dag_paths(graph, b, limit):
    """Every root-to-node path of request b's DAG as dicts (path prob multiplied from the root,
    depth, top-k ranks along the path, graph row, merge flag, parent path index), or None when
    there are more than `limit`."""
    edges = dag_edges(graph, b)
    paths = []
    stack = [(-1, 0, 1.0, (), False)]  # parent index, graph row, prob, ranks, via
    while stack:
        parent, row, prob, ranks, via = stack.pop()
        index = len(paths)
        paths.append({"parent": parent, "row": row, "prob": prob, "ranks": ranks, "via": via, "depth": len(ranks)})
        if len(paths) > limit + 1:
            return None
        for dst, edge_prob, rank, pseudo in edges.get(row, []):
            stack.append((index, dst, prob * edge_prob, ranks + (rank,), via or pseudo))
    return paths[1:] if paths else []  # drop the root


def reference_tree(graph, b, budget, limit=3000):
    """Request b's verification tree as the unroll rule defines it: the `budget` best DAG paths
    by (path prob descending, shallower, creation order = ranks along the path), laid out by
    (depth, path prob descending, ranks). Returns [(token, parent row, depth, prob, via, graph
    row, rank)] per tree row 1..n, or None for DAGs with more than `limit` paths."""
    paths = all_dag_paths(graph, b, limit)
    if paths is None:
        return None
    for index, path in enumerate(paths):
        path["index"] = index
    best = sorted(paths, key=lambda p: (-p["prob"], p["depth"], p["ranks"]))[:budget]
    rows = sorted(best, key=lambda p: (p["depth"], -p["prob"], p["ranks"]))
    row_of = {id(p): r + 1 for r, p in enumerate(rows)}
    by_index = {p["index"]: p for p in paths}
    out = []
    for p in rows:
        parent_row = 0 if p["parent"] <= 0 else row_of[id(by_index[p["parent"] - 1])]
        out.append((int(graph.token_ids[b, p["row"]]), parent_row, p["depth"], p["prob"], p["via"], p["row"],
                    p["ranks"][-1]))
    return out
