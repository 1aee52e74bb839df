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


class ReferenceGraph:
    """The drafting rule of builder.py, one request and one candidate at a time (plain Python):
    pruning, merges into drafted nodes (same (r+1)-gram, no cycle, the same-level ordering rule,
    best target), same-level duplicates collapsing into their leader, the node budget, rows in
    creation order, the next frontier. Drive it like GraphBuilder with the same top-k."""

    def __init__(self, params, roots, history):
        self.params = params
        self.history = [[int(t) for t in row] for row in history]
        self.nodes = [[dict(token=int(root), parent=-1, depth=0, edge_prob=1.0, path_prob=1.0, rank=-1)]
                      for root in roots]
        self.pseudo = [[] for _ in roots]  # (src, dst, prob, rank) per request
        self.edges = [{} for _ in roots]  # src row -> set of dst rows (primary and pseudo)
        self.saved = [0] * len(roots)
        self.frontier = [(b, 0) for b in range(len(roots))]
        self.level = 0

    def context(self, b, row):
        """The r tokens ending at `row` along its primary path, continuing into the history."""
        r, tokens, node = self.params.merge_ngram, [], row
        while node >= 0 and len(tokens) < r:
            tokens.append(self.nodes[b][node]["token"])
            node = self.nodes[b][node]["parent"]
        history = list(self.history[b])
        while len(tokens) < r:
            tokens.append(history.pop() if history else -1)
        return tuple(tokens[::-1])

    def reaches(self, b, src, dst):
        seen, stack = set(), [src]
        while stack:
            for nxt in self.edges[b].get(stack.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return dst in seen or src == dst

    def expand(self, ids, probs):
        params, self.level = self.params, self.level + 1
        candidates = []  # creation order: frontier row, then rank
        for f, (b, parent) in enumerate(self.frontier):
            row_ids, row_probs = [int(t) for t in ids[f][:params.top_k]], [float(p) for p in probs[f][:params.top_k]]
            for j, (token, prob) in enumerate(zip(row_ids, row_probs)):
                valid = prob > 0 and prob >= params.min_child_ratio * row_probs[0] and token >= 0 and token not in row_ids[:j]
                expandable = self.level < params.max_depth and (params.leaf_prob <= 0 or prob >= params.leaf_prob)
                if valid:
                    candidates.append(dict(b=b, parent=parent, rank=j, token=token, prob=prob, expandable=expandable,
                                           path_prob=self.nodes[b][parent]["path_prob"] * prob,
                                           gram=self.context(b, parent) + (token,)))
        merged = {}
        if params.merge_ngram >= 0:
            merged = self.match_existing(candidates)
        fresh = [c for i, c in enumerate(candidates) if i not in merged]
        groups = {}
        for c in fresh:
            groups.setdefault((c["b"], c["gram"] if params.merge_ngram >= 0 else id(c)), []).append(c)
        leader_of = {}
        for members in groups.values():
            leader = max(members, key=lambda c: c["path_prob"])  # max keeps the first of equals
            for c in members:
                leader_of[id(c)] = leader
        new_frontier, row_of = [], {}
        for b in range(len(self.nodes)):
            leaders = [c for c in fresh if c["b"] == b and leader_of[id(c)] is c]
            room = params.node_budget - (len(self.nodes[b]) - 1)
            best = sorted(range(len(leaders)), key=lambda i: (-leaders[i]["path_prob"], i))[:room]
            for i in sorted(best):
                c = leaders[i]
                row_of[id(c)] = len(self.nodes[b])
                self.nodes[b].append(dict(token=c["token"], parent=c["parent"], depth=self.level,
                                          edge_prob=c["prob"], path_prob=c["path_prob"], rank=c["rank"]))
                self.edges[b].setdefault(c["parent"], set()).add(row_of[id(c)])
        for b in range(len(self.nodes)):
            full = len(self.nodes[b]) - 1 >= params.node_budget
            new_frontier += [(b, row_of[id(c)]) for c in fresh
                             if c["b"] == b and id(c) in row_of and c["expandable"] and not full]
        followers = [(c, row_of[id(leader_of[id(c)])]) for c in fresh
                     if leader_of[id(c)] is not c and id(leader_of[id(c)]) in row_of]
        for c, dst in [(candidates[i], dst) for i, dst in sorted(merged.items())] + followers:
            self.pseudo[c["b"]].append((c["parent"], dst, c["prob"], c["rank"]))
            self.edges[c["b"]].setdefault(c["parent"], set()).add(dst)
            self.saved[c["b"]] += c["expandable"]
        self.frontier = new_frontier

    def match_existing(self, candidates):
        """{candidate index: target row} of the merges into nodes drafted before this level."""
        pairs = []  # (candidate index, target row) with the same gram, target not reaching the parent
        for i, c in enumerate(candidates):
            b = c["b"]
            for m in range(1, len(self.nodes[b])):
                node = self.nodes[b][m]
                if node["token"] == c["token"] and self.context(b, node["parent"]) + (node["token"],) == c["gram"] \
                        and not self.reaches(b, m, c["parent"]):
                    pairs.append((i, m))
        merged = {}
        for i, m in pairs:
            c = candidates[i]
            # Ordering rule: no pair from a lower parent row of the request may be reachable from m.
            if any(candidates[j]["b"] == c["b"] and candidates[j]["parent"] < c["parent"]
                   and self.reaches(c["b"], m, candidates[j]["parent"]) for j, _ in pairs):
                continue
            best = merged.get(i)
            pp = self.nodes[c["b"]][m]["path_prob"]
            if best is None or pp > self.nodes[c["b"]][best]["path_prob"]:
                merged[i] = m  # rows ascend: ties keep the lower row
        return merged
