"""Error feedback: what a worker remembers of the gradient that did not reach the merge.

The server's reply says which UDP fragments of this worker were not merged; the worker keeps
exactly those values and adds them to the next gradient of the same part.  So every value a
worker pushes is eventually merged or still held here: ``sum(merged) + residual == sum(pushed)``.
"""
from __future__ import annotations

from typing import Dict, Hashable, Optional

import numpy as np

__all__ = ["ResidualMemory"]


class ResidualMemory:
    __slots__ = ("_residuals",)

    def __init__(self):
        self._residuals: Dict[Hashable, np.ndarray] = {}

    def compensate(self, key: Hashable, flat: np.ndarray,
                   out: Optional[np.ndarray] = None) -> np.ndarray:
        """``flat`` plus what is owed for ``key``: ``flat`` itself when nothing is owed, else a
        new array (or ``out``, same shape and dtype as ``flat``)."""
        residual = self._residuals.pop(key, None)
        if residual is None:
            return flat
        if out is None:
            out = np.empty_like(flat)
        np.add(flat, residual, out=out, casting="unsafe")
        return out

    def remember(self, key: Hashable, sent: np.ndarray, starts: np.ndarray,
                 stops: np.ndarray) -> int:
        """Keep ``sent[start:stop]`` for every missing range, for the next step; returns how
        many elements are kept.  Ranges are few (lost datagrams), so a loop over them is
        cheaper than an element mask over the whole tensor."""
        if not len(starts):
            return 0
        residual = np.zeros(sent.shape, dtype=np.float32)
        for start, stop in zip(starts.tolist(), stops.tolist()):
            residual[start:stop] = sent[start:stop]
        self._residuals[key] = residual
        return int((stops - starts).sum())

    def owed(self, key: Hashable):
        """The residual held for ``key``, or None."""
        return self._residuals.get(key)
