"""The result of an asynchronous call of a :class:`dgt.worker.Worker`: a small future that
finishes once every part of the call has been answered, at its first error, or at the timeout
of :meth:`Pending.wait`.  Callbacks run on the thread that finishes it (the I/O thread), so
the MXNet adapter can complete an engine operator without a thread waiting for it.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, List, Optional

import numpy as np

from .errors import StepTimeout

__all__ = ["Pending"]

logger = logging.getLogger(__name__)


class Pending:
    """The result of an asynchronous call; :meth:`wait` returns it or raises."""

    def __init__(self, what: str, result: Optional[np.ndarray], parts: int, timeout_s: float):
        self.what = what
        self.result = result
        self._left = parts
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._error: Optional[BaseException] = None
        self._timeout_s = timeout_s
        self._callbacks: List[Callable[["Pending"], None]] = []
        if parts == 0:
            self._event.set()

    def _part_done(self) -> None:
        with self._lock:
            self._left -= 1
            finished = self._left == 0 and not self._event.is_set()
            if finished:
                self._event.set()
        if finished:
            self._run_callbacks()

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
            finished = not self._event.is_set()
            self._event.set()
        if finished:
            self._run_callbacks()

    def _run_callbacks(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # noqa: BLE001 - one bad callback must not starve the others
                logger.exception("callback of %s failed", self.what)

    def add_done_callback(self, callback: Callable[["Pending"], None]) -> None:
        """Call ``callback(self)`` once the result or an error is there (at once if it is),
        on the thread that finishes it (usually the I/O thread: keep it short).  Timeouts
        finish a pending too, so the callback always comes."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    @classmethod
    def all_of(cls, what: str, pendings: List["Pending"], result: Optional[np.ndarray],
               timeout_s: float) -> "Pending":
        """A call made of ``pendings``: it finishes once every one of them has finished (not
        at the first error, as the others may still read their buffers), with the first error
        any of them had and ``result``."""
        combined = cls(what, result, len(pendings), timeout_s)

        def one_done(done: "Pending") -> None:
            if done.error() is not None:
                with combined._lock:
                    if combined._error is None:
                        combined._error = done.error()
            combined._part_done()

        for pending in pendings:
            pending.add_done_callback(one_done)
        return combined

    def error(self) -> Optional[BaseException]:
        """The error that finished this call, if any (None while running or on success)."""
        return self._error

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: Optional[float] = None) -> Optional[np.ndarray]:
        limit = self._timeout_s if timeout_s is None else timeout_s
        if not self._event.wait(limit):
            raise StepTimeout(f"{self.what}: no reply within {limit:g} s (DGT_TIMEOUT_S); "
                              "is every worker and server of the job still running?")
        if self._error is not None:
            raise self._error
        return self.result
