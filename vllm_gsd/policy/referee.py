"""The wall-clock referee: which depth (or plain decoding) runs fastest, by whole steps measured.

`WallClockReferee` sets each step's measured time and tokens against what the cost model
predicted for it, per load and per depth, and picks the next step's depth from the corrected
predictions, trying the depths next to the best at a bounded cost. `pays_back` says whether
drafting wins back the draft's catch-up before the requests finish. Plain numpy, deterministic
given what it observed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vllm_gsd.policy.cost_model import StepForecast


@dataclass(frozen=True)
class ArmChoice:
    """`WallClockReferee.choose`'s answer."""

    depth: int  # 0: a plain step; d: draft at most d levels
    why: str  # the figures it rests on, for the log


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
    draft that cannot pay is not walked: a walk at a heavy load costs several slow steps and the
    draft's catch-up on every prompt; the bar is not raised further, since at one request a walk
    is what keeps the estimates fresh when a few poor trees make drafting look slower than it
    is), the load has drafted no step yet and starts from
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

    def corrected(self, num_requests: int, forecast: StepForecast) -> StepForecast:
        """The model's prediction by arm, corrected by the steps measured at this load."""
        arms = self._arms(num_requests)
        log_cost = arms.log_cost.copy()
        lender = self._borrows(num_requests)
        log_cost[1:] = self._drafted_log_cost(arms if lender is None else self._buckets[lender])
        # One yield for every depth: the model's tokens by depth are calibrated per depth
        # already (AcceptanceModel); what is left is its recent bias, and an arm's own history
        # would be measured against predictions the model has since corrected.
        typical = arms.expected / arms.drafted_steps if arms.drafted_steps else 1.0
        prior_tokens = self._prior_steps * typical
        yield_ratio = np.full(forecast.tokens.shape, (arms.emitted + prior_tokens) / (arms.expected + prior_tokens))
        yield_ratio[0] = 1.0  # a plain step emits one token per request, as predicted
        return StepForecast(forecast.tokens * yield_ratio, forecast.seconds * np.exp(log_cost))

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

    def choose(self, num_requests: int, forecast: StepForecast, catch_up_seconds: float = 0.0,
               tokens_left: float | None = None) -> ArmChoice:
        """The arm of the next step (0: plain; d: draft at most d levels) and why (for the log),
        from the model's prediction by arm at this step's load (Decision.forecast).
        catch_up_seconds: what the draft would spend now catching up on tokens decoded plainly
        or on new prompts (left out of the forecast's seconds, it is no depth's cost, but a
        drafted step pays it); tokens_left: how many tokens the requests may still generate, on average (None:
        unbounded). Drafting starts only where the catch-up pays back within them."""
        arms = self._arms(num_requests)
        if arms.count[0] < self.min_steps:
            return ArmChoice(0, "measuring plain steps first")
        corrected = self.corrected(num_requests, forecast)
        seconds, rates = corrected.seconds, corrected.rates
        best = int(np.nanargmax(rates))
        figures = "corrected " + ", ".join(
            f"{'plain' if d == 0 else f'depth {d}'} {rates[d]:.2f}" for d in np.flatnonzero(~np.isnan(rates))
        ) + " tokens/s"
        if best and not pays_back(rates[0], rates[best], catch_up_seconds, num_requests, tokens_left):
            # A short request's prompt costs the draft about what it costs the target, more than
            # its few trees would save.
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
                    return ArmChoice(depth, f"{figures}: measuring depth {depth}")
        for depth in dict.fromkeys((0, best - 1, best + 1)):
            if depth == best or not 0 <= depth <= self.max_depth or np.isnan(rates[depth]):
                continue
            name = "plain" if depth == 0 else f"depth {depth}"
            # One more step of this arm costs at most explore_share of the time since its last.
            try_seconds = seconds[depth] + (catch_up_seconds if depth else 0.0)
            if arms.since_try[depth] * self.explore_share >= try_seconds:
                return ArmChoice(depth, f"{figures}: trying {name} again")
        return ArmChoice(best, figures)


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
