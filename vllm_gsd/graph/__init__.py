"""The pure GSD algorithm: hypothesis graph drafting with merges, unrolling into the verification
tree, ancestor bitmasks, and tree acceptance (greedy and lossless sampling). No vLLM import."""

from .acceptance import (
    AcceptedPaths,
    greedy_accept,
    recursive_rejection_accept,
    sample_accept,
    sample_rows,
    walk_tree,
)
from .ancestors import ancestor_words_from_parents, num_ancestor_words
from .builder import Frontier, GraphBuilder, HypothesisGraph
from .params import GraphParams
from .unroll import VerificationTree, unroll_graph

__all__ = [
    "AcceptedPaths",
    "Frontier",
    "GraphBuilder",
    "GraphParams",
    "HypothesisGraph",
    "VerificationTree",
    "ancestor_words_from_parents",
    "greedy_accept",
    "num_ancestor_words",
    "recursive_rejection_accept",
    "sample_accept",
    "sample_rows",
    "unroll_graph",
    "walk_tree",
]
