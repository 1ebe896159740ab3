"""Message timelines: when each part's push left a worker, reached its server, closed, and came
back (``DGT_TRACE``; read by ``python -m benchmarks.timeline``).

Step times and byte counts say how long a step took, not where it waited.  A trace answers
that: one JSON line per event, stamped with the wall clock (``time.time()``), so that the
files of every worker and server of a job line up when they share a clock (one machine, or
hosts kept in sync by NTP to well under a millisecond).

Events (``event``; all carry ``key``, ``part``, ``step`` and the ``rank`` of the worker, -1
for a server event that concerns every worker):

* worker ``push``: dgt began the part's push, its gradient ready (``handed``: when the
  encoded part was handed to the sockets, datagrams sent; ``round``: the worker's training
  step, one round over the keys as in ``DGT_STATS``, -1 outside one.  ``step`` counts the
  pushes of one part, and a fused bucket's count starts a round late);
* worker ``reply``: the part's reply arrived;
* server ``arrive``: a worker's push was decoded and merged;  ``end``: its end-of-datagrams
  marker arrived;
* server ``close``: the step of the part closed (every push in, and the datagrams or the
  grace period);  ``reply``: the replies are framed and about to be queued for the workers
  (after the optimizer, when the server runs it).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Optional

__all__ = ["Tracer", "NO_TRACE", "open_tracer"]

logger = logging.getLogger(__name__)


class Tracer:
    """Appends events to a JSON-lines file; thread-safe.  Writes are buffered and flushed at
    :meth:`close`, so a trace costs a dict and a buffered write per message."""

    enabled = True

    def __init__(self, path: str, role: str, index: int):
        self.path = path
        self._role, self._index = role, index
        self._lock = threading.Lock()
        self._file: Optional[object] = open(path, "w", encoding="utf-8")
        self.events = 0

    def record(self, event: str, key: int, part: int, step: int, rank: int,
               t: Optional[float] = None, **fields) -> None:
        """One event, stamped ``t`` (now when None), with any further ``fields``."""
        record = {"t": time.time() if t is None else t, "role": self._role,
                  "index": self._index, "event": event, "key": key, "part": part,
                  "step": step, "rank": rank, **fields}
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)
                self.events += 1

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
                logger.info("trace: %d events in %s", self.events, self.path)


class _NoTrace:
    """What processes without ``DGT_TRACE`` use: every call does nothing."""

    enabled = False

    def record(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


NO_TRACE = _NoTrace()


def open_tracer(path_template: str, role: str, index: int):
    """A :class:`Tracer` writing to ``path_template`` with ``{role}`` and ``{index}``
    filled in, or :data:`NO_TRACE` when the template is empty."""
    if not path_template:
        return NO_TRACE
    return Tracer(path_template.replace("{role}", role).replace("{index}", str(index)),
                  role, index)
