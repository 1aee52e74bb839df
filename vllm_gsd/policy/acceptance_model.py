"""How likely the target is to accept a drafted node, calibrated on the trees it verified.

`AcceptanceModel` turns the draft's path probability of a node into the expected number of
tokens it adds to a step, per depth, from what the target actually accepted. Plain numpy,
deterministic given what it observed.
"""

from __future__ import annotations

import numpy as np


class AcceptanceModel:
    """P(a verified node at depth d is accepted) ~= min(1, scale[d] * path_prob).

    The draft's path probability (the product of its probabilities along the path) is what it
    believes; scale[d] corrects it with what the target accepted: over recent trees,
    (trees whose accepted path reached depth d) / (sum of path probs of verified depth-d nodes),
    an exponentially weighted ratio. Each depth's ratio is held, with the weight of
    `prior_trees` average trees, to the scale of the depth above it (depth 1 to `prior`, 1 =
    trust the draft): an unseen depth inherits its parent's scale, and a few trees already
    correct a draft whose probabilities are far off (a small draft is often right with little
    confidence, and its under-confidence compounds with depth).
    """

    def __init__(self, max_depth: int, prior: float = 1.0, prior_trees: float = 1.0,
                 window_trees: float = 512.0) -> None:
        self.max_depth = max_depth
        self._prior, self._prior_trees = prior, prior_trees
        self._keep = 1.0 - 1.0 / window_trees
        # Exponentially weighted sums per depth (index = depth): trees that reached it, the path
        # probs of its verified nodes, trees that verified nodes there.
        self._accepted = np.zeros(max_depth + 1)
        self._predicted = np.zeros(max_depth + 1)
        self._trees = np.zeros(max_depth + 1)

    def scale(self) -> np.ndarray:
        """float64 [max_depth + 1]: scale per depth (index 0 unused, = 1)."""
        scale = np.ones(self.max_depth + 1)
        above = self._prior
        for depth in range(1, self.max_depth + 1):
            if self._trees[depth] > 0:
                prior_mass = self._prior_trees * self._predicted[depth] / self._trees[depth]
                above = (self._accepted[depth] + prior_mass * above) / (self._predicted[depth] + prior_mass)
            scale[depth] = above
        return scale

    def observe(self, predicted_by_depth: np.ndarray, accepted_depth: np.ndarray) -> None:
        """predicted_by_depth: float [T, max_depth + 1], per verified tree the sum of its
        verified nodes' path probs at each depth; accepted_depth: int [T], accepted nodes."""
        predicted_by_depth = np.asarray(predicted_by_depth, dtype=np.float64)
        accepted_depth = np.asarray(accepted_depth)
        num_trees = accepted_depth.shape[0]
        if num_trees == 0:
            return
        depths = np.arange(self.max_depth + 1)
        reached = (accepted_depth[:, None] >= depths[None, :]) & (predicted_by_depth > 0)
        decay = self._keep ** num_trees
        self._accepted = decay * self._accepted + reached.sum(0)
        self._predicted = decay * self._predicted + predicted_by_depth.sum(0)
        self._trees = decay * self._trees + (predicted_by_depth > 0).sum(0)

    def node_gain(self, path_prob: np.ndarray, depth: np.ndarray) -> np.ndarray:
        """Expected accepted tokens contributed by each node (same shape as path_prob)."""
        return np.minimum(1.0, self.scale()[np.clip(depth, 0, self.max_depth)] * path_prob)
