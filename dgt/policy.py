"""Which channel each block takes, and how the threshold k adapts (pure numpy).

Rule 1 (classification, per tensor part, every step): rank the n blocks by contribution,
descending (ties by block index); the first ``round(k * n)`` ranks go to channel 0, the
reliable TCP channel; the remaining m ranks are cut in C equal bands (sizes differ by at most
one), band i going to UDP channel i + 1, so channel 1 carries the most important unreliable
blocks.  ``round`` is half-up.  A part of one block is always reliable.

Unlike the reference, the last block is *not* forced onto TCP: the reference needed it there as
an end-of-message marker; dgt's reliable message says how many datagrams to expect instead.

Rule 2 (adaptive k): k starts at k0.  Each step the worker feeds one signal value (the training
loss when the script reports one, else the gradient norm); it is smoothed by an EMA and
``k = clamp(k0 * L_t / L_0, k_min, 1)`` where L_0 is the first valid smoothed value.  Values
that are not finite and positive are ignored, so k stays at k0 until the signal is usable
(the reference collapsed to k_min on an empty loss file).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

__all__ = ["assign_channels", "reliable_count", "AdaptiveThreshold"]


def reliable_count(k: float, n_blocks: int) -> int:
    """``round(k * n)`` half-up, and never 0 for a single-block part."""
    if n_blocks <= 1:
        return n_blocks
    return min(n_blocks, int(math.floor(k * n_blocks + 0.5)))


def assign_channels(scores: np.ndarray, k: float, udp_channels: int,
                    rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """Channel (0 = reliable, 1..C = UDP) of every block.

    ``rng`` given: the ranking is a random permutation drawn from it (the random-order
    ablation) instead of the contribution order.
    """
    n = len(scores)
    if rng is not None:
        order = rng.permutation(n)
    else:
        order = np.argsort(-scores, kind="stable")
    n_reliable = reliable_count(k, n)
    channels = np.empty(n, dtype=np.uint8)
    channels[order[:n_reliable]] = 0
    rest = n - n_reliable
    if rest:
        bands = 1 + (np.arange(rest) * udp_channels) // rest
        channels[order[n_reliable:]] = bands
    return channels


class AdaptiveThreshold:
    """Convergence-aware k (see Rule 2 in the module docstring)."""

    __slots__ = ("k0", "k_min", "smoothing", "enabled", "smoothed", "reference", "source")

    def __init__(self, k0: float, k_min: float, smoothing: float, enabled: bool = True):
        if not 0.0 <= k_min <= k0 <= 1.0:
            raise ValueError(f"need 0 <= k_min <= k0 <= 1, got k_min={k_min}, k0={k0}")
        self.k0, self.k_min, self.smoothing, self.enabled = k0, k_min, smoothing, enabled
        self.smoothed: Optional[float] = None
        self.reference: Optional[float] = None
        self.source: Optional[str] = None

    def observe(self, value: float, source: str = "loss") -> None:
        """Feed one signal value.  Switching source (gradient norm -> loss) restarts L_0,
        since the two are not on the same scale."""
        if not self.enabled or not math.isfinite(value) or value <= 0.0:
            return
        if source != self.source:
            self.source, self.smoothed, self.reference = source, None, None
        if self.smoothed is None:
            self.smoothed = float(value)
        else:
            self.smoothed = self.smoothing * self.smoothed + (1.0 - self.smoothing) * float(value)
        if self.reference is None:
            self.reference = self.smoothed

    @property
    def k(self) -> float:
        if not self.enabled or self.reference is None:
            return self.k0
        return min(1.0, max(self.k_min, self.k0 * self.smoothed / self.reference))
