"""Tensor fusion in MXNet's engine: the members of a bucket (:mod:`dgt.fusion`) are copied into
one host buffer, pushed as one key, and copied back out.

Per step and bucket (a *round*), in program order:

* at the first member's pushpull: one asynchronous engine operator that *owns* the bucket's
  receive buffer until the reply of this round is in (it blocks no thread; it finishes from
  the I/O thread);
* at every member's pushpull: an engine copy of its gradient into its slice of the send
  buffer, and engine copies of its slice of the receive buffer into its outputs, which
  therefore wait for the reply;
* at the last member's pushpull (the round is *sealed*): one asynchronous operator that takes
  the whole send buffer after all the copies into it and pushes it (declared as writing it:
  error feedback adds what is owed there in place).

A round whose last member never comes (the keys pushed per step changed) is sealed by the next
call of the store: its members so far travel one by one, and fusion stops.  If the missing keys
were the last of the step and the program reads a member's output before calling the store
again (a loss printed every step waits for the forward pass, which waits for the weights), no
call comes: a watchdog seals such a round after :data:`STALL_S`.  A round's members are
normally pushed within one ``Trainer.step``, microseconds apart, so only a changed key set
stalls a round, the same way on every worker.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, List, Optional

import numpy as np

from ..fusion import Bucket, Slot
from ..wire import PRIORITY_LAST
from ..pending import Pending
from ..worker import Worker
from .engine import Completion, HostBuffers, push_async, sum_into

__all__ = ["Fuser", "STALL_S"]

STALL_S = 5.0  # seconds an open round may wait for its last member

logger = logging.getLogger(__name__)


class _BucketBuffers(HostBuffers):
    """A bucket's flat send and receive buffers, and each member's views of them."""

    def __init__(self, bucket: Bucket, shapes: List[tuple], dtype):
        super().__init__((bucket.n_elems,), dtype)
        spans = list(zip(bucket.offsets[:-1], bucket.offsets[1:], shapes))
        self.send_views = [self.send[lo:hi].reshape(shape) for lo, hi, shape in spans]
        self.recv_views = [self.recv[lo:hi].reshape(shape) for lo, hi, shape in spans]


class _Round:
    """One step of one bucket: which members came, and the hand-over between the operator
    that owns the receive buffer and the reply."""

    def __init__(self, bucket: Bucket, buffers: _BucketBuffers, stats):
        self.bucket, self.buffers, self.stats = bucket, buffers, stats
        self.collected: List[int] = []
        self.priority = PRIORITY_LAST  # raised by every member that comes
        self.opened_s = time.monotonic()
        self._lock = threading.Lock()
        self._owner: Optional[Completion] = None
        self._result: Optional[np.ndarray] = None  # what to copy into recv_host
        self._resolved = False

    def own_receive_buffer(self, completion: Completion) -> None:
        """Body of the first operator: holds ``buffers.recv`` until :meth:`resolve`."""
        with self._lock:
            if not self._resolved:
                self._owner = completion
                return
        self._finish(completion)

    def resolve(self, result: Optional[np.ndarray]) -> None:
        """The reply (the bucket's new values, in member order) or None after a failure."""
        with self._lock:
            if self._resolved:
                return
            self._resolved, self._result = True, result
            owner, self._owner = self._owner, None
        if owner is not None:
            self._finish(owner)

    def _finish(self, completion: Completion) -> None:
        if self._result is not None:
            # Written while this round's operator owns the receive buffer: no reader of the
            # previous round is still copying out of it.
            self.buffers.recv_host[:] = self._result
        completion()


class Fuser:
    """The store's fused path.  ``remember_error`` reports failures to the store;
    ``on_stall(reason)`` is called (from the watchdog thread) before a round that waited
    :data:`STALL_S` for its last members is sent member by member."""

    def __init__(self, worker: Worker, remember_error: Callable[[BaseException], None],
                 on_stall: Callable[[str], None]):
        self._worker = worker
        self._remember_error = remember_error
        self._on_stall = on_stall
        self._buffers: Dict[int, _BucketBuffers] = {}
        self._open: Dict[int, _Round] = {}
        self._open_lock = threading.Lock()
        self._watchdog: Optional[threading.Thread] = None
        self._closed = threading.Event()

    def define(self, buckets: List[Bucket], shapes: Dict[int, tuple]) -> None:
        """Allocate the buffers of ``buckets`` and declare them to the servers (waits)."""
        acks = []
        for bucket in buckets:
            dtype = np.dtype(bucket.dtype)
            self._buffers[bucket.key] = _BucketBuffers(
                bucket, [shapes[c.key] for c in bucket.members], dtype)
            acks.append(self._worker.define_bucket(
                bucket.key, bucket.server, [(c.key, c.n_elems) for c in bucket.members], dtype))
        for ack in acks:
            ack.wait()
        logger.info("tensor fusion: %d keys travel in %d buckets",
                    sum(len(b.members) for b in buckets), len(buckets))

    def pushpull(self, slot: Slot, values: list, outs: list, stats, priority: int) -> None:
        """One member's pushpull (program order, the caller's thread)."""
        bucket = slot.bucket
        buffers = self._buffers[bucket.key]
        with self._open_lock:
            round_ = self._open.get(bucket.key)
            if round_ is None:
                round_ = _Round(bucket, buffers, stats)
                self._open[bucket.key] = round_
                push_async(round_.own_receive_buffer, reads=[], writes=[buffers.recv],
                           priority=priority, name="dgt_fused_receive")
                self._start_watchdog()
        sum_into(values, buffers.send_views[slot.index])
        round_.collected.append(slot.index)
        round_.priority = max(round_.priority, priority)  # as urgent as its most urgent member
        for out in outs:
            buffers.recv_views[slot.index].copyto(out)
        if slot.last:
            with self._open_lock:
                ours = self._open.get(bucket.key) is round_
                if ours:
                    del self._open[bucket.key]
            if ours:  # else the watchdog sent it already
                self._seal(round_)

    def flush(self) -> None:
        """Seal every open round now (its members travel one by one)."""
        with self._open_lock:
            rounds, self._open = list(self._open.values()), {}
        for round_ in rounds:
            self._seal(round_)

    def close(self) -> None:
        self.flush()
        self._closed.set()

    # -- sealing ------------------------------------------------------------------------------
    def _seal(self, round_: _Round) -> None:
        push_async(lambda completion: self._send_round(round_, completion),
                   reads=[], writes=[round_.buffers.send], priority=round_.priority,
                   name="dgt_fused_push")

    def _send_round(self, round_: _Round, completion: Completion) -> None:
        """Engine operator: push the round (whole, or member by member when it is partial)
        and finish once the servers answered, which keeps every other access off the send
        buffer until then."""
        bucket, buffers = round_.bucket, round_.buffers
        complete = len(round_.collected) == len(bucket.members)
        result = np.empty(bucket.n_elems, dtype=buffers.send_host.dtype)
        try:
            if complete:
                # One push for every member's begin(): the members are consecutive keys of
                # one step, so their begin() calls returned the same statistics.
                pendings = [self._worker.pushpull(bucket.key, buffers.send_host, round_.stats,
                                                  out=result, priority=round_.priority,
                                                  begun=len(round_.collected),
                                                  may_overwrite=True)]
            else:  # only the members that came are copied out of this round
                offsets = bucket.offsets
                pendings = [self._worker.pushpull(
                    bucket.members[i].key, buffers.send_host[offsets[i]:offsets[i + 1]],
                    round_.stats, out=result[offsets[i]:offsets[i + 1]],
                    priority=round_.priority, may_overwrite=True)
                    for i in round_.collected]
        except Exception as exc:  # noqa: BLE001 - raised by the next call of the store
            self._remember_error(exc)
            round_.resolve(None)
            completion()
            return
        def finished(done: Pending) -> None:
            if done.error() is not None:
                self._remember_error(done.error())
            round_.resolve(None if done.error() is not None else result)
            completion()

        Pending.all_of(f"bucket {bucket.key}", pendings, result,
                       self._worker.config.timeout_s).add_done_callback(finished)

    # -- a round nobody seals ----------------------------------------------------------------
    def _start_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="dgt-fusion-watchdog",
                                              daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        while not self._closed.wait(0.5):
            now = time.monotonic()
            with self._open_lock:
                stale = [k for k, r in self._open.items() if now - r.opened_s > STALL_S]
                rounds = [self._open.pop(k) for k in stale]
            for round_ in rounds:
                self._on_stall(f"bucket {round_.bucket.key} waited {STALL_S:g} s for its last "
                               f"{len(round_.bucket.members) - len(round_.collected)} key(s)")
                self._seal(round_)
