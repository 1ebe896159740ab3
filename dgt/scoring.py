"""Per-block contribution scores (pure: no I/O, no state outside ContributionState).

The contribution of block b of key k at step t is an exponential moving average of the block's
mean absolute gradient, as in the published DGT::

    c_t(k, b) = alpha * c_{t-1}(k, b) + (1 - alpha) * mean(|g_b|),   c_0 = 0

``alpha`` weights the *history* (0.3 by default: 70 % of the score is the current gradient).
Computed in float32 whatever the gradient dtype, so float16 gradients neither overflow nor lose
the ranking to rounding.
"""
from __future__ import annotations

from typing import Dict, Hashable

import numpy as np

from .kernels import block_abs_sums
from .partition import BlockLayout

__all__ = ["ContributionState", "block_mean_abs", "score_blocks"]


def block_mean_abs(layout: BlockLayout, flat: np.ndarray) -> np.ndarray:
    """Mean |g| of every block, the last block averaged over its true length (one compiled
    sweep over float32 gradients, see :mod:`dgt.kernels`)."""
    return block_abs_sums(flat, layout.block_elems) / layout.block_lengths.astype(np.float32)


class ContributionState:
    """The EMA of every (key, block) seen so far.

    Keys are whatever hashable identifies a part (dgt uses ``(key_id, part_index)``).
    """

    __slots__ = ("alpha", "_scores")

    def __init__(self, alpha: float):
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"alpha must be in [0, 1), got {alpha}")
        self.alpha = float(alpha)
        self._scores: Dict[Hashable, np.ndarray] = {}

    def get(self, key: Hashable):
        return self._scores.get(key)


def score_blocks(state: ContributionState, key: Hashable, layout: BlockLayout,
                 flat: np.ndarray) -> np.ndarray:
    """Update and return the contribution of every block of ``flat`` under ``key``."""
    current = block_mean_abs(layout, flat)
    previous = state._scores.get(key)
    if previous is None or previous.shape != current.shape:
        previous = np.zeros_like(current)
    scores = state.alpha * previous + (1.0 - state.alpha) * current
    state._scores[key] = scores
    return scores
