"""Reliable messages waiting for their socket, most urgent first (no sockets here).

MXNet gives every push a priority; gluon and Module give parameter i the priority -i, so the
first layers, whose gradients come last out of the backward pass and whose weights the next
forward pass needs first, are the most urgent.  A ZeroMQ socket sends in the order it was given
messages, so a first layer's few kilobytes would wait behind the megabytes of the last layers'
parts queued before them, and the next forward pass with them.  The I/O shells (worker links,
server) therefore keep their outgoing messages here and give a socket only the few it can take
at once (a small ``SNDHWM``): an urgent message passes everything not yet handed over, as in
P3 and ByteScheduler.  Messages of equal priority keep their order.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, Dict, Hashable, List, Tuple

__all__ = ["PriorityOutbox"]


class PriorityOutbox:
    """Per-destination queues of messages ordered by (priority, descending; then arrival).

    With ``by_priority`` False every message has the same rank: plain arrival order (the
    A/B baseline, ``DGT_PRIORITY_ORDER=0``).  Not thread-safe: one I/O thread owns it.
    """

    def __init__(self, by_priority: bool = True):
        self.by_priority = by_priority
        self._queues: Dict[Hashable, List[Tuple[int, int, object]]] = {}
        self._arrival = itertools.count()

    def put(self, destination: Hashable, priority: int, message: object) -> None:
        rank = -priority if self.by_priority else 0
        heapq.heappush(self._queues.setdefault(destination, []),
                       (rank, next(self._arrival), message))

    def waiting(self, destination: Hashable) -> int:
        """How many messages for ``destination`` are not handed over yet."""
        return len(self._queues.get(destination, ()))

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def destinations(self) -> List[Hashable]:
        """The destinations that have messages waiting."""
        return [d for d, queue in self._queues.items() if queue]

    def flush(self, destination: Hashable, try_send: Callable[[object], bool]) -> int:
        """Hand ``destination``'s messages, most urgent first, to ``try_send`` until it
        returns False (the socket is full: that message stays first in line).  Returns how
        many were handed over."""
        queue = self._queues.get(destination)
        handed = 0
        while queue:
            if not try_send(queue[0][2]):
                break
            heapq.heappop(queue)
            handed += 1
        return handed
