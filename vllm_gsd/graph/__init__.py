"""The pure GSD algorithm: hypothesis graph drafting with merges, unrolling into the verification
tree, ancestor bitmasks, tree acceptance, and keyed Gumbel-max sampling (gumbel.py). No vLLM
import."""

import torch

from .acceptance import AcceptedPaths, walk_tree
from .ancestors import ancestor_words_from_parents, num_ancestor_words
from .builder import Frontier, GraphBuilder
from .hypothesis import HypothesisGraph
from .params import GraphParams
from .unroll import VerificationTree, unroll_graph


def warm_up() -> None:
    """Compile the graph core's kernels (numba) with one tiny step, or load them from numba's
    on-disk cache: about 20 s on a fresh install, under a second after. The engine calls it at
    start, so that no request waits for it."""
    params = GraphParams(node_budget=3, top_k=2, max_depth=2, merge_ngram=1)
    builder = GraphBuilder(params, torch.tensor([1]), torch.tensor([[0]]))
    builder.expand(torch.tensor([[2, 3]]), torch.tensor([[0.6, 0.4]]))
    builder.expand(torch.tensor([[2, 4], [2, 5]]), torch.tensor([[0.7, 0.3], [0.9, 0.1]]))
    tree = builder.build_tree()
    walk_tree(tree.draft_token_ids, tree.parent_row, tree.num_nodes, torch.zeros(1, 4, dtype=torch.int64))


__all__ = [
    "AcceptedPaths",
    "Frontier",
    "GraphBuilder",
    "GraphParams",
    "HypothesisGraph",
    "VerificationTree",
    "ancestor_words_from_parents",
    "num_ancestor_words",
    "unroll_graph",
    "walk_tree",
    "warm_up",
]
