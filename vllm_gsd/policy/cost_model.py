"""What a step costs and what it is worth: cost curves by query tokens, and the best step rate.

A step of speculative decoding is worth what it emits per second. With R requests growing trees,
D other running requests (one token each), a target forward costing T_t(q) for q query tokens
and a draft forward costing T_d(q), a step that verifies k tree nodes in all emits

    tokens(k) = R + D + sum of the k best nodes' acceptance probabilities
    seconds(k) = draft seconds spent + T_t(R + D + k)

and a step without speculation emits R + D tokens in T_t(R + D) seconds (no draft forward at all).
`best_step` finds the k of the highest rate; `StepForecast` holds a step's tokens and seconds per
arm (plain decoding, or drafting at most d levels), as the node budget predicts them and the
referee corrects them. Plain numpy, deterministic given its inputs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


class StepKind(enum.Enum):
    """What a measured forward time is of: each kind has its own scale over the cost curves."""

    PLAIN = "plain"  # a target step without trees
    TREE = "tree"  # a target step that verifies trees
    DRAFT = "draft"  # the draft's forwards of a step


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


@dataclass(frozen=True)
class BestStep:
    """`best_step`'s answer: the step that verifies `num_nodes` nodes."""

    num_nodes: int
    tokens: float  # expected tokens of the step
    seconds: float  # its seconds

    @property
    def rate(self) -> float:
        """Expected tokens per second."""
        return self.tokens / self.seconds


def best_step(base_tokens: float, gains_desc: np.ndarray, fixed_seconds: float, target_cost) -> BestStep:
    """The step whose rate (base_tokens + sum of the first k gains) / (fixed + T_t(base + k)) is
    the highest.

    gains_desc: float [K], in the order nodes would be added (k = 0 allowed: verify nothing);
    target_cost: seconds by query tokens (a CostCurve, or any function of an array).
    """
    k = np.arange(gains_desc.size + 1)
    tokens = base_tokens + np.concatenate([[0.0], np.cumsum(gains_desc)])
    seconds = fixed_seconds + target_cost(base_tokens + k)
    best = int(np.argmax(tokens / seconds))  # first maximum: the fewest nodes among equals
    return BestStep(best, float(tokens[best]), float(seconds[best]))


@dataclass(frozen=True)
class StepForecast:
    """A step's expected tokens and seconds per arm: index 0 plain decoding, index d drafting at
    most d levels; NaN where no prediction is made."""

    tokens: np.ndarray  # float64 [max_depth + 1]
    seconds: np.ndarray  # float64 [max_depth + 1]

    @property
    def rates(self) -> np.ndarray:
        """float64 [max_depth + 1]: expected tokens per second per arm."""
        return self.tokens / self.seconds

    def rate(self, depth: int) -> float | None:
        """Expected tokens per second of a step drafted `depth` levels (None: plain, or not predicted)."""
        if depth == 0 or np.isnan(self.tokens[depth]):
            return None
        return float(self.tokens[depth] / self.seconds[depth])
