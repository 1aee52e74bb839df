"""The load-adaptive node budget: how deep to draft and how many nodes to verify this step.

`NodeBudgetPolicy` answers the questions of a step with one rate, the step's expected tokens per
second (policy/cost_model.py):

* `should_draft`: is speculation expected to beat no speculation at this load, and how many
  levels should the step draft at most? (from the gain curves of recent trees by depth and the
  cost curves; at high load the answer becomes no);
* `next_level_pays`, while drafting: is one more level worth its forward, given how sure the
  draft is of this step's frontier? (a step stops early where its draft is unsure);
* `select`: how many of each request's best nodes (by path probability) to verify, so that the
  batch's rate is the highest. Few nodes per request degenerate to the most likely chain.

Acceptance probabilities come from the draft's path probabilities, calibrated per depth by
`AcceptanceModel` against what the target actually accepted. Everything here is plain numpy and
deterministic given its inputs, so every tensor-parallel rank takes the same decisions (the cost
curves are measured once and shared by the engine).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from vllm_gsd.policy.acceptance_model import AcceptanceModel
from vllm_gsd.policy.cost_model import CostCurve, StepForecast, StepKind, best_step


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
    # The model's step by depth, for the referee, at the load of the decision (None: nothing
    # measured yet to predict from).
    forecast: StepForecast | None = None

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
        self.scale = {kind: 1.0 for kind in StepKind}
        self.learn_scales = learn_scales

    # ---------------------------------------------------------------- costs of real steps

    def plain_seconds(self, num_tokens):
        """A target step without trees, by the target's curve and the learned scale."""
        return self.scale[StepKind.PLAIN] * self.target_cost(num_tokens)

    def tree_seconds(self, num_tokens):
        """A target step that verifies trees, by the target's curve and the learned scale."""
        return self.scale[StepKind.TREE] * self.target_cost(num_tokens)

    def observe_time(self, kind: StepKind, predicted_seconds: float, measured_seconds: float) -> None:
        """Learn the scale of `kind` from one step: an exponential
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
        forecast = self.predict(num_tree_requests, num_other_tokens)
        rates = forecast.rates
        depth = int(np.nanargmax(rates[1:])) + 1
        figures = (f"{rates[depth]:.2f} tokens/s at depth {depth} against {rates[0]:.2f} plain "
                   f"({rates[depth] / rates[0]:.2f}x)")
        decision = functools.partial(Decision, forecast=forecast)
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

    def predict(self, num_tree_requests: int, num_other_tokens: int) -> StepForecast:
        """The model's step by depth at this load (index 0: plain decoding; depth d: d draft
        forwards and the best node count of the cap's gain curve), NaN at caps no recent step
        drafted to."""
        r, base = num_tree_requests, num_tree_requests + num_other_tokens
        tokens, seconds = np.full(self.max_depth + 1, np.nan), np.full(self.max_depth + 1, np.nan)
        tokens[0], seconds[0] = base, self.plain_seconds(base)
        n = np.arange(self.node_budget + 1)
        verify_seconds = self.tree_seconds(base + r * n)
        for depth in np.flatnonzero(self._cap_known):
            draft_seconds = self.scale[StepKind.DRAFT] * self.expected_draft_seconds(r, depth)
            step_tokens = base + r * self.gain_curve(depth)
            best = int(np.argmax(step_tokens / (draft_seconds + verify_seconds)))
            tokens[depth], seconds[depth] = step_tokens[best], draft_seconds + verify_seconds[best]
        return StepForecast(tokens, seconds)

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
        spent = self.scale[StepKind.DRAFT] * draft_seconds
        more = self.scale[StepKind.DRAFT] * float(self.draft_cost(frontier_path_prob.size))
        now = best_step(base, np.sort(drafted)[::-1], spent, self.tree_seconds)
        after = best_step(base, np.sort(np.concatenate([drafted, children]))[::-1], spent + more, self.tree_seconds)
        if rate_to_beat is None:
            rate_to_beat = now.rate
        # The level pays if what it adds comes at a better rate than the step's (a sunk cost,
        # such as a long catch-up, does not make a further level worth more).
        return after.tokens - now.tokens > rate_to_beat * (after.seconds - now.seconds)

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
        step = best_step(batch + num_other_tokens, gain.reshape(-1)[order],
                         self.scale[StepKind.DRAFT] * draft_seconds, self.tree_seconds)
        k, rate = step.num_nodes, step.rate
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
