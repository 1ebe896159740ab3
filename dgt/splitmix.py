"""splitmix64's finaliser, vectorised: the hash dgt uses wherever every process must reach the
same pseudo-random choice from the same integers without talking (which datagrams the seeded
loss drops, which server owns a small key)."""
from __future__ import annotations

import numpy as np

__all__ = ["GOLDEN", "mix64"]

GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64(x):
    """The finaliser of splitmix64 on uint64 values (wrapping arithmetic; call it under
    ``np.errstate(over="ignore")``)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))
