"""Counter-based uniforms: u(seed, position), the same whatever the batch or the tree.

A seeded request must sample the same text in any batch, as vLLM guarantees without speculation.
With trees, how many draws a step makes depends on the tree, which depends on the draft's
numerics in that batch; a stateful generator would then drift. Keying each draw by the absolute
position of the token it samples makes the k-th output token always use the same uniform, so
tree verification reproduces plain inverse-CDF sampling of the target, step split or not.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX1
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX2
    return x ^ (x >> np.uint64(31))


def counter_keys(seed: np.ndarray, position: np.ndarray) -> np.ndarray:
    """uint64, one well-mixed key per (seed, position) pair (broadcast)."""
    with np.errstate(over="ignore"):
        key = _splitmix64(np.asarray(seed).astype(np.uint64) * _GOLDEN + _GOLDEN)
        return _splitmix64(key + np.asarray(position).astype(np.uint64) * _GOLDEN)


def counter_uniforms(seed: np.ndarray, position: np.ndarray) -> np.ndarray:
    """float64 uniforms in [0, 1), one per (seed, position) pair (broadcast), 53 random bits."""
    return (counter_keys(seed, position) >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)
