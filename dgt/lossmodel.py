"""Seeded, order-independent loss injection for UDP datagrams.

Whether a datagram is dropped depends only on ``(seed, rank, key, part, step, slot)``, through
a splitmix64 hash, never on the order in which datagrams are sent or on threads.  A test can
therefore recompute exactly which fragments were lost (:func:`dropped_slots`) and check the
merge against the sum of the survivors.
"""
from __future__ import annotations

import numpy as np

from .splitmix import GOLDEN, mix64

__all__ = ["dropped_slots"]


def dropped_slots(probability: float, seed: int, rank: int, key: int, part: int, step: int,
                  slots: np.ndarray) -> np.ndarray:
    """Boolean mask, True where the datagram of that fragment slot is dropped."""
    slots = np.asarray(slots, dtype=np.uint64)
    if probability <= 0.0:
        return np.zeros(slots.shape, dtype=bool)
    if probability >= 1.0:
        return np.ones(slots.shape, dtype=bool)
    with np.errstate(over="ignore"):
        h = np.full(1, seed, dtype=np.uint64)
        for value in (rank, key, part, step):
            h = mix64(h * GOLDEN + np.uint64(value & 0xFFFFFFFFFFFFFFFF))
        u = mix64(h * GOLDEN + slots) >> np.uint64(11)
    return (u.astype(np.float64) * (1.0 / 2 ** 53)) < probability
