"""The load-adaptive node budget: how much to draft and verify this step, from measured costs.

A step of speculative decoding is worth what it emits per second. With R requests growing trees,
D other running requests (one token each), a target forward costing T_t(q) for q query tokens
and a draft forward costing T_d(q), a step that verifies k tree nodes in all emits

    tokens(k) = R + D + sum of the k best nodes' acceptance probabilities
    seconds(k) = draft seconds spent + T_t(R + D + k)

and a step without speculation emits R + D tokens in T_t(R + D) seconds (no draft forward at all).
`NodeBudgetPolicy` answers the three questions of a step with that one rate:

* `should_draft`: is speculation expected to beat no speculation at this load? (from the gain
  curve of recent trees and the cost curves; at high load the answer becomes no);
* `continue_drafting`: after a level, is one more draft forward worth its cost? (the next level's
  best children are estimated from the frontier's path probabilities);
* `select`: how many of each request's best nodes (by path probability) to verify, so that the
  batch's rate is the highest. Few nodes per request degenerate to the most likely chain.

Acceptance probabilities come from the draft's path probabilities, calibrated per depth by
`AcceptanceModel` against what the target actually accepted. Everything here is plain numpy and
deterministic given its inputs, so every tensor-parallel rank takes the same decisions (the cost
curves are measured once and shared by the engine).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one forward as a function of its query tokens.

    Piecewise linear through the measured points (made non-decreasing, so measurement noise
    cannot make more work look cheaper), flat below the first point, extended beyond the last
    point with the slope of the last segment.
    """

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) == 0 or len(self.tokens) != len(self.seconds):
            raise ValueError("a cost curve needs as many token counts as times, at least one")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:])) or self.tokens[0] < 1:
            raise ValueError(f"cost curve token counts must be increasing and >= 1, got {self.tokens}")
        if any(not np.isfinite(s) or s <= 0 for s in self.seconds):
            raise ValueError(f"cost curve times must be positive, got {self.seconds}")
        object.__setattr__(self, "seconds", tuple(float(s) for s in np.maximum.accumulate(self.seconds)))

    @classmethod
    def from_points(cls, points) -> CostCurve:
        """From [[tokens, seconds], ...] in any order."""
        ordered = sorted((int(q), float(s)) for q, s in points)
        return cls(tuple(q for q, _ in ordered), tuple(s for _, s in ordered))

    def __call__(self, num_tokens):
        """Seconds for `num_tokens` (int or array); 0 tokens cost nothing."""
        q = np.asarray(num_tokens, dtype=np.float64)
        tokens = np.asarray(self.tokens, dtype=np.float64)
        seconds = np.asarray(self.seconds)
        out = np.interp(q, tokens, seconds)
        if tokens.size > 1:
            slope = (seconds[-1] - seconds[-2]) / (tokens[-1] - tokens[-2])
            out = np.where(q > tokens[-1], seconds[-1] + slope * (q - tokens[-1]), out)
        out = np.where(q <= 0, 0.0, out)
        return out if out.ndim else float(out)


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


def best_rate(base_tokens: float, gains_desc: np.ndarray, fixed_seconds: float,
              target_cost) -> tuple[int, float]:
    """(k, rate) maximizing (base_tokens + sum of the first k gains) / (fixed + T_t(base + k)).

    gains_desc: float [K], in the order nodes would be added (k = 0 allowed: verify nothing);
    target_cost: seconds by query tokens (a CostCurve, or any function of an array).
    """
    k = np.arange(gains_desc.size + 1)
    tokens = base_tokens + np.concatenate([[0.0], np.cumsum(gains_desc)])
    rate = tokens / (fixed_seconds + target_cost(base_tokens + k))
    best = int(np.argmax(rate))  # first maximum: the fewest nodes among equals
    return best, float(rate[best])


@dataclass(frozen=True)
class Decision:
    """`NodeBudgetPolicy.should_draft`'s answer, with the figures it rests on (for the log)."""

    draft: bool
    why: str
    # An exploring step (drafted although it is not expected to pay, to refresh the estimates)
    # drafts for num_requests of the tree requests: the draft must first catch up on every token
    # of the plain streak, at high load the largest cost of the step, and a few trees refresh
    # the estimates as well as many. None: all of them.
    explore: bool = False
    num_requests: int | None = None
    # The model's tokens/s of its best drafted step over its plain rate (None: not estimated).
    predicted_speedup: float | None = None

    def __bool__(self) -> bool:
        return self.draft


@dataclass
class Selection:
    """What `NodeBudgetPolicy.select` chose for one step."""

    node_budget: np.ndarray  # int64 [B]: nodes to verify per request
    expected_accepted: float  # sum over the batch of the chosen nodes' gains
    rate: float  # expected tokens per second of the step


class NodeBudgetPolicy:
    """Chooses, per step, whether to draft, how deep, and how many nodes to verify.

    target_cost / draft_cost: CostCurve of one target / draft forward by query tokens.
    node_budget: N, the most nodes per request; max_depth: the most draft levels.
    explore_every: after this many steps decided as plain decoding in a row, one is drafted, so
    the estimates behind the decision are refreshed (load falls, the draft may improve); it
    drafts for at most explore_requests requests.

    Measured curves time bare forwards; a real step also builds inputs, runs attention over the
    context (the tree rows under the graph mask) and, for the draft, builds the graph. With
    learn_scales, three scales learned from the steps' measured times (`observe_time`) carry that
    over: plain target steps, target steps that verify trees, and draft steps. Curves a user
    gave are taken as they are (learn_scales=False).
    """

    explore_every = 64
    explore_requests = 4

    def __init__(self, target_cost: CostCurve, draft_cost: CostCurve, node_budget: int,
                 max_depth: int, smoothing: float = 0.1, learn_scales: bool = False) -> None:
        self.target_cost, self.draft_cost = target_cost, draft_cost
        self.node_budget, self.max_depth = node_budget, max_depth
        self.acceptance = AcceptanceModel(max_depth)
        self._smoothing = smoothing
        # Recent history, for predicting a step before drafting it (None until the first tree):
        # [N + 1, D + 1], the path probs of a request's best n nodes (by path prob), by depth.
        self._best_nodes_mass: np.ndarray | None = None
        # Per draft forward l (0 = catch-up, l >= 1 expands depth-l nodes): how often a drafted
        # step runs it, and its rows per request when it runs.
        self._level_runs = np.zeros(max_depth)
        self._level_rows = np.zeros(max_depth)
        self._ran_this_step = np.zeros(max_depth, dtype=bool)
        self._top_child_prob = 0.8  # draft prob of a node's best child (for the next-level estimate)
        self._plain_streak = 0
        self.scale = {"plain": 1.0, "tree": 1.0, "draft": 1.0}
        self.learn_scales = learn_scales

    # ---------------------------------------------------------------- costs of real steps

    def plain_seconds(self, num_tokens):
        """A target step without trees, by the target's curve and the learned scale."""
        return self.scale["plain"] * self.target_cost(num_tokens)

    def tree_seconds(self, num_tokens):
        """A target step that verifies trees, by the target's curve and the learned scale."""
        return self.scale["tree"] * self.target_cost(num_tokens)

    def observe_time(self, kind: str, predicted_seconds: float, measured_seconds: float) -> None:
        """Learn the scale of `kind` ("plain", "tree" or "draft") from one step: an exponential
        average of measured / predicted in log space (one slow step among fast ones moves it
        little), each ratio held to [0.1, 10]."""
        if not self.learn_scales or predicted_seconds <= 0 or measured_seconds <= 0:
            return
        ratio = float(np.clip(measured_seconds / predicted_seconds, 0.1, 10.0))
        a = self._smoothing
        self.scale[kind] = float(np.exp((1 - a) * np.log(self.scale[kind]) + a * np.log(ratio)))

    # ---------------------------------------------------------------- before drafting

    def should_draft(self, num_tree_requests: int, num_other_tokens: int) -> Decision:
        """Whether a drafted step is expected to emit more tokens per second than a plain one."""
        if num_tree_requests == 0:
            return Decision(False, "no request can grow a tree")
        if self._best_nodes_mass is None:
            return Decision(True, "nothing measured yet")
        r, base = num_tree_requests, num_tree_requests + num_other_tokens
        plain_rate = base / self.plain_seconds(base)
        draft_seconds = self.scale["draft"] * self.expected_draft_seconds(r)
        n = np.arange(self.node_budget + 1)
        spec_rate = (base + r * self.gain_curve()) / (draft_seconds + self.tree_seconds(base + r * n))
        best = int(np.argmax(spec_rate[1:])) + 1
        rates = f"{spec_rate[best]:.2f} tokens/s at {best} nodes per tree against {plain_rate:.2f} plain"
        speedup = float(spec_rate[best] / plain_rate)
        if spec_rate[best] > plain_rate:
            self._plain_streak = 0
            return Decision(True, rates, predicted_speedup=speedup)
        # Decisions rest on estimates that only drafted steps refresh: every so often, draft anyway.
        self._plain_streak += 1
        if self._plain_streak >= self.explore_every:
            self._plain_streak = 0
            explorers = min(r, self.explore_requests)
            return Decision(True, f"{rates}; drafting {explorers} trees to refresh the estimates",
                            explore=True, num_requests=explorers, predicted_speedup=speedup)
        return Decision(False, rates, predicted_speedup=speedup)

    def expected_draft_seconds(self, num_tree_requests: int) -> float:
        """Draft forwards of a typical drafted step for this many tree requests, in seconds by
        the draft's cost curve."""
        rows = np.maximum(1.0, num_tree_requests * self._level_rows)
        return float((self._level_runs * self.draft_cost(rows)).sum())

    # ---------------------------------------------------------------- while drafting

    def continue_drafting(self, node_gain_desc: np.ndarray, frontier_gain: np.ndarray,
                          num_tree_requests: int, num_other_tokens: int,
                          draft_seconds: float, level: int) -> bool:
        """After `level` draft levels, whether one more is worth a draft forward over the frontier.

        node_gain_desc: float [K] gains of the nodes drafted so far, descending; frontier_gain:
        float [F] gains of the frontier nodes (the parents of the next level); draft_seconds:
        the draft's cost so far by its cost curve.
        """
        if frontier_gain.size == 0 or level >= self.max_depth:
            return False
        base = num_tree_requests + num_other_tokens
        draft_scale = self.scale["draft"]
        _, rate_now = best_rate(base, node_gain_desc, draft_scale * draft_seconds, self.tree_seconds)
        scale = self.acceptance.scale()
        depth_ratio = scale[min(level + 1, self.max_depth)] / max(scale[level], 1e-9)
        # The next level's best nodes: each frontier node's most likely child.
        next_gain = np.minimum(1.0, frontier_gain * self._top_child_prob * depth_ratio)
        merged = np.sort(np.concatenate([node_gain_desc, next_gain]))[::-1]
        next_seconds = draft_scale * (draft_seconds + self.draft_cost(frontier_gain.size))
        _, rate_next = best_rate(base, merged, next_seconds, self.tree_seconds)
        return rate_next > rate_now

    def observe_forward(self, level: int, num_rows: int, num_tree_requests: int) -> None:
        """Record a draft forward: level 0 is the catch-up, level l >= 1 expands depth-l nodes."""
        if 0 <= level < self.max_depth and num_tree_requests:
            a = self._smoothing
            seen = self._level_runs[level] > 0
            self._level_rows[level] = ((1 - a) * self._level_rows[level] + a * num_rows / num_tree_requests
                                       if seen else num_rows / num_tree_requests)
            self._ran_this_step[level] = True

    def finish_draft(self) -> None:
        """Close a drafted step: which draft forwards it ran."""
        a = self._smoothing
        self._level_runs = (1 - a) * self._level_runs + a * self._ran_this_step
        self._ran_this_step[:] = False

    def observe_children(self, top_child_prob: np.ndarray) -> None:
        """Record the draft probability of the best child of each expanded node."""
        if top_child_prob.size:
            a = self._smoothing
            self._top_child_prob = (1 - a) * self._top_child_prob + a * float(top_child_prob.mean())

    # ---------------------------------------------------------------- after drafting

    def select(self, path_prob: np.ndarray, depth: np.ndarray, num_nodes: np.ndarray,
               num_other_tokens: int, draft_seconds: float, explore: bool = False) -> Selection:
        """Nodes to verify per request, from the candidate trees.

        path_prob float [B, N], depth int [B, N] of each request's candidate tree rows (rows past
        num_nodes[b] are ignored). Request b verifies its node_budget[b] nodes of highest path
        probability (a set closed under ancestors: GraphBuilder.build_tree(node_budget) cuts the
        tree to it); nodes join in one order across the batch, by path probability, until the
        step's expected rate stops improving. draft_seconds: what the draft spent, by its curve.
        explore: the step explores (Decision.explore): every tree keeps at least its max_depth
        best nodes, so that verifying them refreshes the acceptance estimates.
        """
        batch, width = path_prob.shape
        real = np.arange(width)[None, :] < num_nodes[:, None]
        gain = np.where(real, self.acceptance.node_gain(path_prob, depth), 0.0)
        key = np.where(real, path_prob, -1.0)
        order = np.argsort(-key, axis=None, kind="stable")[: int(real.sum())]
        request = order // width
        k, rate = best_rate(batch + num_other_tokens, gain.reshape(-1)[order],
                            self.scale["draft"] * draft_seconds, self.tree_seconds)
        budget = np.bincount(request[:k], minlength=batch).astype(np.int64)
        if explore:
            budget = np.maximum(budget, np.minimum(num_nodes, self.max_depth)).astype(np.int64)
        self._remember_best_nodes(path_prob, depth, key)
        return Selection(budget, float(gain.reshape(-1)[order[:k]].sum()), rate)

    def gain_curve(self) -> np.ndarray:
        """float64 [N + 1]: expected accepted nodes of a typical request's best n nodes, from the
        recent trees' path probs and the current calibration (no node counts for more than 1)."""
        expected = self._best_nodes_mass @ self.acceptance.scale()
        return np.concatenate([[0.0], np.cumsum(np.minimum(1.0, np.diff(expected)))])

    def _remember_best_nodes(self, path_prob: np.ndarray, depth: np.ndarray, key: np.ndarray) -> None:
        """Smoothed mean over requests of their best n nodes' path probs, by depth."""
        batch, width = path_prob.shape
        order = np.argsort(-key, axis=1, kind="stable")
        by_depth = np.zeros((batch, width, self.max_depth + 1))
        sorted_depth = np.clip(np.take_along_axis(depth, order, axis=1), 0, self.max_depth)
        sorted_prob = np.take_along_axis(np.where(key >= 0, path_prob, 0.0), order, axis=1)
        np.put_along_axis(by_depth, sorted_depth[..., None], sorted_prob[..., None], axis=2)
        mass = np.zeros((self.node_budget + 1, self.max_depth + 1))
        cumulative = np.cumsum(by_depth, axis=1).mean(0)[: self.node_budget]
        mass[1: cumulative.shape[0] + 1] = cumulative
        mass[cumulative.shape[0] + 1:] = cumulative[-1] if cumulative.shape[0] else 0.0
        a = self._smoothing
        self._best_nodes_mass = mass if self._best_nodes_mass is None else (1 - a) * self._best_nodes_mass + a * mass



class WallClockReferee:
    """Measured throughput of whole steps, speculative against plain, by load: the judge of the
    cost model's decisions, so that speculation never loses for long and is not left unused
    where it measures faster.

    Every step is measured as it ran, end to end (from one drafter call to the next: drafting,
    scheduling, the target's forward, verification, bookkeeping, IPC), its tokens and seconds
    exponentially averaged per load bucket (batch sizes 1, 2-3, 4-7, ...), the rate their ratio
    (a per-step rate would swing with the tokens a tree happens to accept). Where speculative
    steps measure slower than plain ones by more than `margin`, speculation is vetoed. It is
    tried again once the plain steps since the last try have taken long enough that one more
    losing step costs at most `explore_share` of that time, so a machine on which speculation
    cannot pay loses at most that share to finding it out. One speculative step suffices to veto
    speculation that measures at most half as fast as plain decoding. Where speculation wins, a
    plain step every `plain_every` steps keeps the plain figure fresh (both slow down as
    contexts grow).

    The other way round (`insists`): the cost model's predicted speed-up of the steps that
    drafted is averaged too; where speculation measures faster than plain, the model's
    prediction for a step it would run plainly is corrected by measured / predicted speed-up of
    the drafted steps, and the step drafts if the corrected figure says it pays. A model whose
    start-up cost curves were timed in a slow moment thus cannot keep a machine on plain steps
    while every drafted step measures faster.
    """

    def __init__(self, margin: float = 0.02, min_steps: int = 3, explore_share: float = 0.02,
                 plain_every: int = 64, smoothing: float = 0.25) -> None:
        self.margin, self.min_steps, self.explore_share = margin, min_steps, explore_share
        self.plain_every = plain_every
        self._smoothing = smoothing
        # Per (bucket, speculative): tokens and seconds per step, exponentially averaged.
        self._tokens: dict[tuple[int, bool], float] = {}
        self._step_seconds: dict[tuple[int, bool], float] = {}
        self._count: dict[tuple[int, bool], int] = {}
        self._predicted: dict[int, float] = {}  # the model's predicted speed-up of drafted steps
        self._plain_since_try: dict[int, float] = {}  # plain seconds since the last speculative try
        self._since_plain: dict[int, int] = {}

    @staticmethod
    def bucket(num_requests: int) -> int:
        return max(int(num_requests), 1).bit_length()

    def observe(self, speculative: bool, num_requests: int, tokens: int, seconds: float,
                predicted_speedup: float | None = None) -> None:
        """One finished step: whether it verified trees, the requests in it, the tokens it
        emitted, its wall time and, for a drafted step, the speed-up the cost model predicted
        for it (Decision.predicted_speedup)."""
        if seconds <= 0 or tokens <= 0:
            return
        b = self.bucket(num_requests)
        key, a = (b, speculative), self._smoothing
        for table, value in ((self._tokens, tokens), (self._step_seconds, seconds)):
            table[key] = value if key not in table else (1 - a) * table[key] + a * value
        self._count[key] = self._count.get(key, 0) + 1
        if speculative and predicted_speedup is not None and predicted_speedup > 0:
            before = self._predicted.get(b)
            self._predicted[b] = predicted_speedup if before is None else (1 - a) * before + a * predicted_speedup
        if speculative:
            self._plain_since_try[b] = 0.0
        else:
            self._plain_since_try[b] = self._plain_since_try.get(b, 0.0) + seconds

    def rates(self, num_requests: int) -> tuple[float | None, float | None]:
        """(plain, speculative) tokens/s measured at this load, None where not measured yet."""
        b = self.bucket(num_requests)
        return tuple(self._tokens[key] / self._step_seconds[key] if key in self._tokens else None
                     for key in ((b, False), (b, True)))

    def allows(self, num_requests: int) -> tuple[bool, str]:
        """Whether this step may speculate, and why (for the log)."""
        b = self.bucket(num_requests)
        plain, spec = self.rates(num_requests)
        if plain is None or self._count[(b, False)] < self.min_steps:
            return False, "measuring plain steps first"
        clearly_slower = spec is not None and spec < 0.5 * plain
        if spec is None or (self._count[(b, True)] < self.min_steps and not clearly_slower):
            return True, "measuring speculative steps"
        figures = f"measured {spec:.2f} tokens/s speculating against {plain:.2f} plain"
        if spec >= plain * (1 - self.margin):
            since = self._since_plain.get(b, 0) + 1
            if since >= self.plain_every:  # refresh the plain figure now and then
                self._since_plain[b] = 0
                return False, f"{figures}: refreshing plain"
            self._since_plain[b] = since
            return True, figures
        # A losing try costs its step time minus what plain steps emit in it.
        spec_seconds = self._step_seconds[(b, True)]
        excess = spec_seconds * (1.0 - spec / plain)
        if self._plain_since_try.get(b, 0.0) * self.explore_share < excess:
            return False, f"{figures}: vetoed"
        return True, f"{figures}: trying again"

    def insists(self, num_requests: int, predicted_speedup: float) -> tuple[bool, str]:
        """Whether a step the cost model would run plainly (predicting `predicted_speedup` < 1
        for its best tree) should draft after all, the model corrected by what drafted steps
        measured (see the class docstring); and why. Then `allows` still has its say."""
        b = self.bucket(num_requests)
        plain, spec = self.rates(num_requests)
        predicted = self._predicted.get(b)
        if (plain is None or spec is None or predicted is None
                or min(self._count[(b, False)], self._count[(b, True)]) < self.min_steps):
            return False, "not measured"
        measured = spec / plain
        corrected = predicted_speedup * measured / predicted
        figures = (f"drafted steps measured {measured:.2f}x plain where the model predicted "
                   f"{predicted:.2f}x; this one corrected to {corrected:.2f}x")
        return measured > 1 + self.margin and corrected > 1 + self.margin, figures
