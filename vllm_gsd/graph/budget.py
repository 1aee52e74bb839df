"""The load-adaptive node budget: how much to draft and verify this step, from measured costs.

A step of speculative decoding is worth what it emits per second. With R requests growing trees,
D other running requests (one token each), a target forward costing T_t(q) for q query tokens
and a draft forward costing T_d(q), a step that verifies k tree nodes in all emits

    tokens(k) = R + D + sum of the k best nodes' acceptance probabilities
    seconds(k) = draft seconds spent + T_t(R + D + k)

and a step without speculation emits R + D tokens in T_t(R + D) seconds (no draft forward at all).
`NodeBudgetPolicy` answers the questions of a step with that one rate:

* `should_draft`: is speculation expected to beat no speculation at this load, and how many
  levels should the step draft at most? (from the gain curves of recent trees by depth and the
  cost curves; at high load the answer becomes no);
* `next_level_pays`, while drafting: is one more level worth its forward, given how sure the
  draft is of this step's frontier? (a step stops early where its draft is unsure);
* `select`: how many of each request's best nodes (by path probability) to verify, so that the
  batch's rate is the highest. Few nodes per request degenerate to the most likely chain.

`WallClockReferee` judges the model by what whole steps measure: per load, it runs the depth
(or plain decoding) that measures fastest, and tries its neighbours at a bounded cost.

Acceptance probabilities come from the draft's path probabilities, calibrated per depth by
`AcceptanceModel` against what the target actually accepted. Everything here is plain numpy and
deterministic given its inputs, so every tensor-parallel rank takes the same decisions (the cost
curves are measured once and shared by the engine).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one forward as a function of its query tokens.

    Piecewise linear through the measured points, flat below the first point, extended beyond
    the last point with the slope of the last segment. More work never costs less: a point
    slower than a larger forward is lowered to that forward's time. A timer's noise is upward
    (an interrupt, another process), so a spike is what a point slower than a larger forward is,
    and raising every later point to it instead would make one spike at 2 tokens price every
    tree as if it cost twice a plain step.
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
        suffix_min = np.minimum.accumulate(np.asarray(self.seconds, dtype=np.float64)[::-1])[::-1]
        object.__setattr__(self, "seconds", tuple(float(s) for s in suffix_min))

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


def best_step(base_tokens: float, gains_desc: np.ndarray, fixed_seconds: float,
              target_cost) -> tuple[int, float, float]:
    """(k, tokens, seconds) of the step whose rate (base_tokens + sum of the first k gains) /
    (fixed + T_t(base + k)) is the highest.

    gains_desc: float [K], in the order nodes would be added (k = 0 allowed: verify nothing);
    target_cost: seconds by query tokens (a CostCurve, or any function of an array).
    """
    k = np.arange(gains_desc.size + 1)
    tokens = base_tokens + np.concatenate([[0.0], np.cumsum(gains_desc)])
    seconds = fixed_seconds + target_cost(base_tokens + k)
    best = int(np.argmax(tokens / seconds))  # first maximum: the fewest nodes among equals
    return best, float(tokens[best]), float(seconds[best])


def best_rate(base_tokens: float, gains_desc: np.ndarray, fixed_seconds: float,
              target_cost) -> tuple[int, float]:
    """(k, rate) of `best_step`."""
    k, tokens, seconds = best_step(base_tokens, gains_desc, fixed_seconds, target_cost)
    return k, tokens / seconds


@dataclass(frozen=True)
class Decision:
    """`NodeBudgetPolicy.should_draft`'s answer, with the figures it rests on (for the log)."""

    draft: bool
    why: str
    # The draft depth (levels of the graph) the model expects to pay best: the step drafts at
    # most this many levels. Also set when drafting is not expected to pay (then the depth an
    # exploring step, or the referee's try, would use).
    depth: int = 0
    # An exploring step (drafted although it is not expected to pay, to refresh the estimates)
    # drafts for num_requests of the tree requests: the draft must first catch up on every token
    # of the plain streak, at high load the largest cost of the step, and a few trees refresh
    # the estimates as well as many. None: all of them.
    explore: bool = False
    num_requests: int | None = None
    # The model's step by depth (index 0: plain), for the referee: tokens and seconds (NaN where
    # it cannot predict), at the load of the decision.
    tokens: np.ndarray | None = None
    seconds: np.ndarray | None = None

    def __bool__(self) -> bool:
        return self.draft


@dataclass
class Selection:
    """What `NodeBudgetPolicy.select` chose for one step."""

    node_budget: np.ndarray  # int64 [B]: nodes to verify per request
    expected_accepted: float  # sum over the batch of the chosen nodes' gains
    rate: float  # expected tokens per second of the step
    tokens: float  # expected tokens of the step (every request's one, plus expected_accepted)
    seconds: float  # the model's seconds of the step (draft spent, verification)


class NodeBudgetPolicy:
    """Chooses, per step, whether to draft, how deep, and how many nodes to verify.

    target_cost / draft_cost: CostCurve of one target / draft forward by query tokens.
    node_budget: N, the most nodes per request; max_depth: the most draft levels.
    explore_every: after this many steps decided as plain decoding in a row, one is drafted, so
    the estimates behind the decision are refreshed (load falls, the draft may improve); it
    drafts for at most explore_requests requests. min_child_ratio: the graph's sibling pruning
    (GraphParams), so that the children a level is expected to add are pruned as the graph would.

    Depth is a decision of its own: each draft level costs a forward, and the levels a step runs
    are paid whatever the tree accepts. So the recent trees are remembered per depth cap c (the
    expected accepted nodes of a request's best n nodes no deeper than c: `gain_curve(c)`), and a
    step is predicted for every c up to max_depth with the draft forwards of c levels; only caps
    that recent steps drafted to are predicted (a deeper one is tried by the wall-clock
    referee's exploration, and predicted from then on). That depth is a cap: within a step each
    further level is drafted only while `next_level_pays` on the step's own frontier, so the
    caps' gain curves and expected draft seconds are those of steps that stop early where the
    draft is unsure (`observe_levels` counts the levels they left out).

    Measured curves time bare forwards; a real step also builds inputs, runs attention over the
    context (the tree rows under the graph mask) and, for the draft, builds the graph. With
    learn_scales, three scales learned from the steps' measured times (`observe_time`) carry that
    over: plain target steps, target steps that verify trees, and draft steps. Curves a user
    gave are taken as they are (learn_scales=False).
    """

    explore_every = 64
    explore_requests = 4

    def __init__(self, target_cost: CostCurve, draft_cost: CostCurve, node_budget: int,
                 max_depth: int, smoothing: float = 0.1, learn_scales: bool = False,
                 min_child_ratio: float = 0.0) -> None:
        self.target_cost, self.draft_cost = target_cost, draft_cost
        self.node_budget, self.max_depth = node_budget, max_depth
        self.acceptance = AcceptanceModel(max_depth)
        self._smoothing = smoothing
        # Recent trees, for predicting a step before drafting it: [cap c, n, depth d], the mean
        # over requests of the path probs at depth d of a request's best n nodes no deeper than
        # c (the acceptance model turns them into expected accepted nodes when a step is
        # predicted, so that its latest calibration counts). Cap c is known once a step drafted
        # c levels or more.
        self._mass_by_cap = np.zeros((max_depth + 1, node_budget + 1, max_depth + 1))
        self._cap_known = np.zeros(max_depth + 1, dtype=bool)
        # Per draft forward l (0 = catch-up, l >= 1 expands depth-l nodes): its rows per request.
        self._level_rows = np.zeros(max_depth)
        self._level_seen = np.zeros(max_depth, dtype=bool)
        # Per draft forward l: the share of the steps allowed to draft it that did (the others
        # stopped earlier: `next_level_pays`), and its rows' children's probabilities by top-k
        # rank, siblings below min_child_ratio x the best one pruned as the graph prunes them.
        self._level_share = np.ones(max_depth)
        self._child_probs: np.ndarray | None = None  # float64 [max_depth, k] once observed
        self._min_child_ratio = min_child_ratio
        self._cap_age = np.zeros(max_depth + 1, dtype=np.int64)  # drafted steps since a cap was taught
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
        """Whether a drafted step is expected to emit more tokens per second than a plain one,
        and at which depth it pays best."""
        if num_tree_requests == 0:
            return Decision(False, "no request can grow a tree")
        if not self._cap_known.any():
            # The first trees teach the model; one request's do, and the others' would each cost
            # the draft a catch-up on the whole prompt (at a heavy load, many plain steps).
            return Decision(True, "nothing measured yet: the first tree", depth=self.max_depth,
                            explore=True, num_requests=1)
        r = num_tree_requests
        tokens, seconds = self.predict(num_tree_requests, num_other_tokens)
        rates = tokens / seconds
        depth = int(np.nanargmax(rates[1:])) + 1
        figures = (f"{rates[depth]:.2f} tokens/s at depth {depth} against {rates[0]:.2f} plain "
                   f"({rates[depth] / rates[0]:.2f}x)")
        decision = functools.partial(Decision, tokens=tokens, seconds=seconds)
        if rates[depth] > rates[0]:
            self._plain_streak = 0
            if depth < self.max_depth and self._cap_age[depth + 1] >= self.explore_every:
                # Caps deeper than the steps draft are not taught: now and then one level more.
                return decision(True, f"{figures}; one level deeper to refresh the estimates", depth=depth + 1)
            return decision(True, figures, depth=depth)
        # Decisions rest on estimates that only drafted steps refresh: every so often, draft anyway.
        self._plain_streak += 1
        if self._plain_streak >= self.explore_every:
            self._plain_streak = 0
            explorers = min(r, self.explore_requests)
            return decision(True, f"{figures}; drafting {explorers} trees to refresh the estimates",
                            depth=depth, explore=True, num_requests=explorers)
        return decision(False, figures, depth=depth)

    def predict(self, num_tree_requests: int, num_other_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, seconds), float64 [max_depth + 1] each: the model's step by depth at this load
        (index 0: plain decoding; depth d: d draft forwards and the best node count of the cap's
        gain curve), NaN at caps no recent step drafted to."""
        r, base = num_tree_requests, num_tree_requests + num_other_tokens
        tokens, seconds = np.full(self.max_depth + 1, np.nan), np.full(self.max_depth + 1, np.nan)
        tokens[0], seconds[0] = base, self.plain_seconds(base)
        n = np.arange(self.node_budget + 1)
        verify_seconds = self.tree_seconds(base + r * n)
        for depth in np.flatnonzero(self._cap_known):
            draft_seconds = self.scale["draft"] * self.expected_draft_seconds(r, depth)
            step_tokens = base + r * self.gain_curve(depth)
            best = int(np.argmax(step_tokens / (draft_seconds + verify_seconds)))
            tokens[depth], seconds[depth] = step_tokens[best], draft_seconds + verify_seconds[best]
        return tokens, seconds

    def expected_draft_seconds(self, num_tree_requests: int, depth: int) -> float:
        """Draft forwards of a step of `depth` levels for this many tree requests (the catch-up
        and depth - 1 expansions), in seconds by the draft's cost curve, with each level's rows
        as recent steps had them (a level not drafted lately: as the deepest one that was), and
        each expansion weighed by the share of recent steps that went on to draft it."""
        rows = self._level_rows.copy()
        for level in range(1, self.max_depth):
            if not self._level_seen[level]:
                rows[level] = rows[level - 1]
        rows = np.maximum(1.0, num_tree_requests * rows[:depth])
        return float(np.sum(self._level_share[:depth] * self.draft_cost(rows)))

    # ---------------------------------------------------------------- while drafting

    def observe_forward(self, level: int, num_rows: int, num_tree_requests: int) -> None:
        """Record a draft forward: level 0 is the catch-up, level l >= 1 expands depth-l nodes."""
        if 0 <= level < self.max_depth and num_tree_requests:
            a = self._smoothing
            per_request = num_rows / num_tree_requests
            seen = self._level_seen[level]
            self._level_rows[level] = (1 - a) * self._level_rows[level] + a * per_request if seen else per_request
            self._level_seen[level] = True

    def observe_children(self, level: int, top_probs: np.ndarray) -> None:
        """The children the draft proposed at forward `level` (0: the roots'): top_probs float
        [R, k], each row descending (the draft's top-k probabilities of one expanded node)."""
        top_probs = np.asarray(top_probs, dtype=np.float64)
        if not 0 <= level < self.max_depth or top_probs.size == 0:
            return
        if self._child_probs is None:
            self._child_probs = np.full((self.max_depth, top_probs.shape[1]), np.nan)
        kept = np.where(top_probs >= self._min_child_ratio * top_probs[:, :1], top_probs, 0.0).mean(0)
        known = self._child_probs[level]
        a = self._smoothing
        self._child_probs[level] = kept if np.isnan(known).any() else (1 - a) * known + a * kept

    def observe_levels(self, allowed_depth: int, drafted_depth: int) -> None:
        """A drafted step was allowed `allowed_depth` draft forwards and ran `drafted_depth`
        (the catch-up included): the expansions it stopped short of count as not drafted."""
        a = self._smoothing
        levels = np.arange(1, min(allowed_depth, self.max_depth))
        ran = (levels < drafted_depth).astype(np.float64)
        self._level_share[levels] = (1 - a) * self._level_share[levels] + a * ran

    def next_level_pays(self, level: int, path_prob: np.ndarray, depth: np.ndarray, num_nodes: np.ndarray,
                        frontier_request: np.ndarray, frontier_path_prob: np.ndarray, num_other_tokens: int,
                        draft_seconds: float, rate_to_beat: float | None = None) -> bool:
        """Whether one more draft forward, expanding the frontier (its nodes at depth `level`),
        is expected to pay: the tokens its children add, over the seconds it and their
        verification add, against `rate_to_beat` (the step's expected tokens per second, as
        decided; None: the rate of the step as drafted so far).

        path_prob, depth float/int [B, W]: each request's drafted nodes (rows past num_nodes[b]
        are ignored); frontier_request, frontier_path_prob [F]: the nodes the forward would
        expand; draft_seconds: what the draft spent so far, by its curve. The children are
        expected as recent ones were at this level (mean probability by top-k rank), within
        each request's remaining node budget. On a memory-bound machine a level costs the same
        for one row or many, so a step whose draft is unsure stops early and a confident one
        goes deep: a fixed depth pays for levels that unsure steps never accept.
        """
        if self._child_probs is None or np.isnan(self._child_probs[level]).any():
            return True  # children of this level not seen yet: draft them (and learn them)
        batch, width = path_prob.shape
        real = np.arange(width)[None, :] < num_nodes[:, None]
        drafted = self.acceptance.node_gain(path_prob[real], depth[real])
        expected = self.acceptance.node_gain(np.outer(frontier_path_prob, self._child_probs[level]),
                                             np.full((frontier_path_prob.size, 1), level + 1))
        request = np.repeat(frontier_request, expected.shape[1])
        gain = expected.reshape(-1)
        order = np.lexsort((-gain, request))
        request, gain = request[order], gain[order]
        rank = np.arange(gain.size) - np.searchsorted(request, request)
        room = self.node_budget - num_nodes
        children = gain[rank < room[request]]
        base = batch + num_other_tokens
        spent = self.scale["draft"] * draft_seconds
        more = self.scale["draft"] * float(self.draft_cost(frontier_path_prob.size))
        _, tokens_now, seconds_now = best_step(base, np.sort(drafted)[::-1], spent, self.tree_seconds)
        _, tokens_after, seconds_after = best_step(base, np.sort(np.concatenate([drafted, children]))[::-1],
                                                   spent + more, self.tree_seconds)
        if rate_to_beat is None:
            rate_to_beat = tokens_now / seconds_now
        # The level pays if what it adds comes at a better rate than the step's (a sunk cost,
        # such as a long catch-up, does not make a further level worth more).
        return tokens_after - tokens_now > rate_to_beat * (seconds_after - seconds_now)

    # ---------------------------------------------------------------- after drafting

    def select(self, path_prob: np.ndarray, depth: np.ndarray, num_nodes: np.ndarray,
               num_other_tokens: int, draft_seconds: float, explore: bool = False,
               drafted_depth: int | None = None) -> Selection:
        """Nodes to verify per request, from the candidate trees.

        path_prob float [B, N], depth int [B, N] of each request's candidate tree rows (rows past
        num_nodes[b] are ignored). Request b verifies its node_budget[b] nodes of highest path
        probability (a set closed under ancestors: GraphBuilder.build_tree(node_budget) cuts the
        tree to it); nodes join in one order across the batch, by path probability, until the
        step's expected rate stops improving. draft_seconds: what the draft spent, by its curve.
        explore: the step explores (Decision.explore): every tree keeps at least its max_depth
        best nodes, so that verifying them refreshes the acceptance estimates. drafted_depth:
        the depth the step was allowed to draft (default max_depth): the trees teach the gain
        curves of the caps up to it.
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
        self._remember_mass(path_prob, depth, key, self.max_depth if drafted_depth is None else drafted_depth)
        expected = float(gain.reshape(-1)[order[:k]].sum())
        tokens = batch + num_other_tokens + expected
        return Selection(budget, expected, rate, tokens, tokens / rate)

    def gain_curve(self, depth: int | None = None) -> np.ndarray:
        """float64 [N + 1]: expected accepted nodes of a typical request's best n nodes no deeper
        than `depth` (default: the deepest cap known), from the recent trees' path probs and the
        current calibration (no node counts for more than 1)."""
        if depth is None:
            known = np.flatnonzero(self._cap_known)
            depth = int(known[-1]) if known.size else self.max_depth
        expected = self._mass_by_cap[depth] @ self.acceptance.scale()
        return np.concatenate([[0.0], np.cumsum(np.minimum(1.0, np.diff(expected)))])

    def _remember_mass(self, path_prob: np.ndarray, depth: np.ndarray, key: np.ndarray, drafted_depth: int) -> None:
        """Fold this step's trees into the path-prob mass of the caps 1..drafted_depth (smoothed
        means over requests of their best n nodes no deeper than the cap, by depth)."""
        batch, width = path_prob.shape
        order = np.argsort(-key, axis=1, kind="stable")
        sorted_depth = np.clip(np.take_along_axis(depth, order, axis=1), 0, self.max_depth)
        sorted_prob = np.take_along_axis(path_prob, order, axis=1)
        real = np.take_along_axis(key, order, axis=1) >= 0
        rows = min(width, self.node_budget)
        a = self._smoothing
        self._cap_age += 1
        self._cap_age[: drafted_depth + 1] = 0
        for cap in range(1, min(drafted_depth, self.max_depth) + 1):
            kept = real & (sorted_depth <= cap)
            rank = np.cumsum(kept, axis=1)  # 1-based place of each kept node among the kept
            by_rank = np.zeros((width + 1, self.max_depth + 1))
            np.add.at(by_rank, (rank[kept], sorted_depth[kept]), sorted_prob[kept])
            mass = np.cumsum(by_rank, axis=0)[: rows + 1] / batch
            padded = np.repeat(mass[-1:], self.node_budget + 1, axis=0)
            padded[: rows + 1] = mass
            known = self._cap_known[cap]
            self._mass_by_cap[cap] = (1 - a) * self._mass_by_cap[cap] + a * padded if known else padded
            self._cap_known[cap] = True


class WallClockReferee:
    """Whole steps as they ran, against the cost model's prediction of them: the model, so
    corrected, chooses each step's depth (or plain decoding), so that speculation never loses for
    long and the depth that runs fastest on this machine is the one used.

    Every step is measured end to end (from one drafter call to the next: drafting, scheduling,
    the target's forward, verification, bookkeeping, IPC) and set against what the model
    predicted for that very step (its tokens and seconds, for the nodes it verified). Per load
    bucket (batch sizes 1, 2-3, 4-7, ...) and per arm (the depth the step was allowed to draft, 0
    for a plain step) measured over predicted seconds is learned, an average in log space over
    the bucket's recent steps (an arm last run long ago counts its latest step most: figures age
    as contexts grow and the machine drifts; an arm never run takes the nearest depth's, and in
    a bucket that has drafted no step yet, the nearest lighter bucket's: speculation pays less
    as the load grows, so a depth that lost at a lighter load is not tried blindly at a heavier
    one, while a lighter load is judged afresh); and
    for all drafted arms together, tokens emitted over tokens expected, sums over about
    `yield_window` drafted steps (leaning on 1, `prior_steps` steps' worth). Tokens are not
    corrected per arm: a tree's yield swings from step to step, the model calibrates them per
    depth already, and an arm's own history would be set against predictions the model has
    since corrected (an arm run early, while the model underrated trees, would keep looking
    better than it is). The next step's arm is the one whose corrected
    prediction, made at this step's load and from the latest trees, is the fastest: what a tree
    happens to accept swings from step to step far more than what a step costs, so arms are
    compared on the same prediction, never on their own noisy histories.

    Plain steps are measured first. Then the best drafted depth and the depths next to it are
    measured `min_steps` times each, at once (so drafting is judged on steps of its own, not on
    the model's first trees, and a depth the model misjudges is left within a few steps, level by
    level, even in a short run), unless drafting runs below `walk_share` of the plain rate (a
    draft that cannot pay is not walked: at 8 requests on 2 cores the model rated drafting at
    0.37-0.45x plain, and a walk there, under a bar of a quarter, cost nine steps of 1.2 s
    against 0.19 s plain ones and the draft's catch-up on eight prompts; the bar is not raised
    further, since at one request a walk is what keeps the estimates fresh when a few poor trees
    make drafting look slower than it is), the load has drafted no step yet and starts from
    a lighter load's measurement, or the draft's catch-up on the tokens it missed would cost more
    than the walk's steps. Then the arms next to the best
    (one level shallower and deeper, and plain) are tried again once the steps since their last
    try have taken long enough that one more step of theirs costs at most `explore_share` of
    that time (about one step in `1 / explore_share` for each; a drafted try also pays the
    draft's catch-up on the tokens decoded plainly since, which at a heavy load can cost more
    than the step itself, so that is counted in): a machine on which speculation
    cannot pay loses about that share to finding it out, and a depth that becomes better (the
    draft agrees more, the machine gets quieter) is found again.
    """

    def __init__(self, max_depth: int, min_steps: int = 3, explore_share: float = 0.01,
                 smoothing: float = 0.1, prior_steps: float = 2.0, yield_window: float = 30.0,
                 walk_share: float = 0.5) -> None:
        self.max_depth, self.min_steps, self.explore_share = max_depth, min_steps, explore_share
        self.walk_share = walk_share
        self._smoothing, self._prior_steps = smoothing, prior_steps
        self._yield_keep = 1.0 - 1.0 / yield_window
        self._buckets: dict[int, _ArmStats] = {}

    @staticmethod
    def bucket(num_requests: int) -> int:
        return max(int(num_requests), 1).bit_length()

    def _arms(self, num_requests: int) -> _ArmStats:
        b = self.bucket(num_requests)
        if b not in self._buckets:
            self._buckets[b] = _ArmStats(self.max_depth + 1)
        return self._buckets[b]

    def observe(self, depth: int, num_requests: int, tokens: float, seconds: float,
                predicted_tokens: float, predicted_seconds: float) -> None:
        """One finished step: the depth it was allowed to draft (0: a plain step), the requests
        in it, the tokens it emitted, its wall time, and what the model predicted for it."""
        if min(seconds, tokens, predicted_tokens, predicted_seconds) <= 0:
            return
        arms = self._arms(num_requests)
        arms.steps += 1
        # The old figure weighs as if every bucket step since had been averaged in, and an arm's
        # first steps are averaged evenly (a first step, often an outlier, would otherwise
        # outweigh the next ones for as long as the arm runs).
        count = arms.count[depth]
        keep = min((1 - self._smoothing) ** (arms.steps - arms.last_step[depth]), count / (count + 1))
        log_ratio = math.log(seconds / predicted_seconds)
        arms.log_cost[depth] = keep * arms.log_cost[depth] + (1 - keep) * log_ratio  # keep = 0 at first
        arms.count[depth] += 1
        arms.last_step[depth] = arms.steps
        if depth > 0:
            arms.emitted = self._yield_keep * arms.emitted + tokens
            arms.expected = self._yield_keep * arms.expected + predicted_tokens
            arms.drafted_steps += 1
        arms.since_try += seconds
        arms.since_try[depth] = 0.0

    def corrected(self, num_requests: int, tokens: np.ndarray, seconds: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, seconds) [max_depth + 1]: the model's prediction by arm, corrected."""
        arms = self._arms(num_requests)
        log_cost = arms.log_cost.copy()
        lender = self._borrows(num_requests)
        log_cost[1:] = self._drafted_log_cost(arms if lender is None else self._buckets[lender])
        # One yield for every depth: the model's tokens by depth are calibrated per depth
        # already (AcceptanceModel); what is left is its recent bias, and an arm's own history
        # would be measured against predictions the model has since corrected.
        typical = arms.expected / arms.drafted_steps if arms.drafted_steps else 1.0
        prior_tokens = self._prior_steps * typical
        yield_ratio = np.full(tokens.shape, (arms.emitted + prior_tokens) / (arms.expected + prior_tokens))
        yield_ratio[0] = 1.0  # a plain step emits one token per request, as predicted
        return tokens * yield_ratio, seconds * np.exp(log_cost)

    def _borrows(self, num_requests: int) -> int | None:
        """The bucket whose drafted steps this load's drafted arms start from: the nearest lighter
        one that drafted, while this one has drafted no step (None: its own)."""
        if self._arms(num_requests).drafted_steps > 0:
            return None
        lighter = [b for b, arms in self._buckets.items()
                   if b < self.bucket(num_requests) and arms.drafted_steps > 0]
        return max(lighter) if lighter else None

    @staticmethod
    def _drafted_log_cost(arms: _ArmStats) -> np.ndarray:
        """float64 [max_depth]: a bucket's log measured/predicted seconds of depths 1.., a depth
        never run there taking the nearest measured depth's (0 where none was)."""
        log_cost = arms.log_cost[1:].copy()
        measured = np.flatnonzero(arms.count[1:] > 0)
        for depth in np.flatnonzero(arms.count[1:] == 0):
            log_cost[depth] = log_cost[measured[np.argmin(np.abs(measured - depth))]] if measured.size else 0.0
        return log_cost

    def plain_measured(self, num_requests: int) -> bool:
        return bool(self._arms(num_requests).count[0] >= self.min_steps)

    def choose(self, num_requests: int, tokens: np.ndarray, seconds: np.ndarray,
               catch_up_seconds: float = 0.0, tokens_left: float | None = None) -> tuple[int, str]:
        """The arm of the next step (0: plain; d: draft at most d levels) and why (for the log),
        from the model's prediction by arm at this step's load (Decision.tokens / .seconds).
        catch_up_seconds: what the draft would spend now catching up on tokens decoded plainly
        or on new prompts (left out of `seconds`, it is no depth's cost, but a drafted step pays
        it); tokens_left: how many tokens the requests may still generate, on average (None:
        unbounded). Drafting starts only where the catch-up pays back within them."""
        arms = self._arms(num_requests)
        if arms.count[0] < self.min_steps:
            return 0, "measuring plain steps first"
        tokens, seconds = self.corrected(num_requests, tokens, seconds)
        rates = tokens / seconds
        best = int(np.nanargmax(rates))
        figures = "corrected " + ", ".join(
            f"{'plain' if d == 0 else f'depth {d}'} {rates[d]:.2f}" for d in np.flatnonzero(~np.isnan(rates))
        ) + " tokens/s"
        if best and not pays_back(rates[0], rates[best], catch_up_seconds, num_requests, tokens_left):
            # A short request's prompt costs the draft about what it costs the target: at 8
            # requests x 48 tokens the draft's prefill took longer than its trees then saved.
            figures += (f"; the draft's catch-up ({catch_up_seconds:.2f} s) would not pay back within "
                        f"{tokens_left:.0f} tokens a request")
            best = 0
        # The best drafted depth and the depths next to it are measured at once, min_steps steps
        # each: a depth is judged on steps of its own, not on the model's first trees or on one
        # step, and a depth the model misjudges is left within a few steps (a walk from depth to
        # depth), not a few hundred. Unless drafting is far behind plain steps, this load has
        # drafted no step and starts from a lighter load's measurement, or the draft would first
        # catch up on more than the walk's steps cost (every request's plain streak or prompt, at
        # a heavy load): then drafting is only tried at the bounded cost below, which counts it.
        drafted = 1 + int(np.nanargmax(rates[1:])) if not np.isnan(rates[1:]).all() else 0
        if (drafted and self._borrows(num_requests) is None and rates[drafted] >= self.walk_share * rates[0]
                and catch_up_seconds <= self.min_steps * seconds[drafted]
                and pays_back(rates[0], rates[drafted], catch_up_seconds, num_requests, tokens_left)):
            for depth in (drafted, drafted - 1, drafted + 1):
                if 1 <= depth <= self.max_depth and not np.isnan(rates[depth]) and arms.count[depth] < self.min_steps:
                    return depth, f"{figures}: measuring depth {depth}"
        for depth in dict.fromkeys((0, best - 1, best + 1)):
            if depth == best or not 0 <= depth <= self.max_depth or np.isnan(rates[depth]):
                continue
            name = "plain" if depth == 0 else f"depth {depth}"
            # One more step of this arm costs at most explore_share of the time since its last.
            try_seconds = seconds[depth] + (catch_up_seconds if depth else 0.0)
            if arms.since_try[depth] * self.explore_share >= try_seconds:
                return depth, f"{figures}: trying {name} again"
        return best, figures


def pays_back(plain_rate: float, drafted_rate: float, catch_up_seconds: float, num_requests: int,
              tokens_left: float | None) -> bool:
    """Whether drafting at drafted_rate (tokens/s of the batch) rather than plain_rate wins back
    catch_up_seconds before the num_requests requests have generated tokens_left tokens each."""
    if catch_up_seconds <= 0 or tokens_left is None or not plain_rate > 0 or not drafted_rate > 0:
        return True
    tokens = num_requests * tokens_left
    return tokens / plain_rate - tokens / drafted_rate > catch_up_seconds


@dataclass
class _ArmStats:
    """One load bucket's steps, per arm (index = depth drafted, 0 = plain)."""

    size: int

    def __post_init__(self) -> None:
        self.log_cost = np.zeros(self.size)  # measured / predicted seconds, log, averaged
        self.count = np.zeros(self.size, dtype=np.int64)
        self.last_step = np.zeros(self.size, dtype=np.int64)  # bucket step of the arm's last
        self.steps = 0  # steps of the bucket
        self.drafted_steps = 0
        self.emitted = 0.0  # tokens drafted steps emitted, summed over a window of steps
        self.expected = 0.0  # tokens the model expected of those steps
        self.since_try = np.zeros(self.size)  # seconds of steps since the arm last ran
