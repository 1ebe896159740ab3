"""What a server-side optimizer's reply carries: the float32 weights, or the bfloat16 step from
the weights the workers hold to them (``DGT_WEIGHTS_REPLY=delta``).

With the optimizer on the servers, MXNet's ``dist_sync`` sends every worker the whole float32
weights each step: on AlexNet that is 1.5 times the bytes of the bfloat16 gradients pushed,
and the busiest server's link carries them once per worker.  A bfloat16 copy of the weights
would halve that but lose the small updates (a weight of 1.0 moves in steps of 2**-7).  The
*step* in bfloat16 loses none of that: the server keeps a float32 copy of what the workers hold
(:class:`HeldWeights`), sends ``bfloat16(weights - held)`` and moves its copy by exactly what
the workers will add.  The workers' weights then lag the server's by one bfloat16 rounding of
one step's change (at most 2**-8 of it), and that remainder is part of the next step's
delta: rounding never accumulates.

Every worker gets every reply of a key, in step order (BSP), so one copy per (key, part)
serves them all.  The first reply of a key, and the first after its value was replaced
(``init``, ``set_optimizer``), carries the float32 weights in full and starts the copy.

Pure: no sockets, no MXNet.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from .kernels import weights_delta_bfloat16_
from .wire import BFLOAT16

__all__ = ["HeldWeights"]


class HeldWeights:
    """A server's copy of the weights every worker holds, per (key, part).

    ``enabled``: send deltas at all (``DGT_WEIGHTS_REPLY=delta``).
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._held: Dict[Tuple[int, int], np.ndarray] = {}
        self._deltas: Dict[Tuple[int, int], np.ndarray] = {}  # reply buffers, reused

    def reply(self, key: Tuple[int, int], weights: np.ndarray, gradient_dtype: np.dtype
              ) -> Tuple[np.ndarray, bool]:
        """``(payload, is_delta)`` of the reply that brings the workers to ``weights``.

        A delta only for float32 weights whose gradients came in bfloat16 (the workers chose
        half-width numbers; float32 gradients get float32 weights).  The payload is valid
        until the next reply of ``key``: a worker pushes the key's next step only after it
        got this one."""
        if not (self.enabled and weights.dtype == np.float32 and gradient_dtype == BFLOAT16):
            self._held.pop(key, None)
            return weights, False
        held = self._held.get(key)
        if held is None or held.shape != weights.shape:
            self._held[key] = weights.copy()
            return weights, False
        delta = self._deltas.get(key)
        if delta is None or delta.shape != weights.shape:
            delta = self._deltas[key] = np.empty(weights.shape, BFLOAT16)
        return weights_delta_bfloat16_(weights, held, delta), True

    def forget(self, key: Tuple[int, int]) -> None:
        """``key``'s value was replaced: its next reply is whole."""
        self._held.pop(key, None)
        self._deltas.pop(key, None)

    def clear(self) -> None:
        self._held.clear()
        self._deltas.clear()

    def __len__(self) -> int:
        return len(self._held)
