"""Seeded, order-independent loss injection for UDP datagrams.

Whether a datagram is dropped depends only on ``(seed, rank, key, part, step, slot)``, through
a splitmix64 hash, never on the order in which datagrams are sent or on threads.  A test can
therefore recompute exactly which fragments were lost (:func:`dropped_slots`) and check the
merge against the sum of the survivors.
"""
from __future__ import annotations

import numpy as np

__all__ = ["dropped_slots"]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


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
            h = _mix(h * _GOLDEN + np.uint64(value & 0xFFFFFFFFFFFFFFFF))
        u = _mix(h * _GOLDEN + slots) >> np.uint64(11)
    return (u.astype(np.float64) * (1.0 / 2 ** 53)) < probability
