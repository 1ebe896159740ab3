"""Tensor fusion: small keys of one step travel together, as one *bucket* key.

A model like GoogLeNet has over a hundred tensors, most of them small (biases, batch-norm
parameters); every key costs a fixed amount of work per step on the worker and the server,
whatever its size.  Horovod and BytePS pack small tensors into buffers for the same reason.

Training calls ``pushpull`` for the same keys in the same order every step (Gluon's Trainer
and Module do), but one key at a time, so the planner learns the order first: the calls up to
the first repeated key are one step.  From then on, small keys of the same server and dtype
that follow each other are packed into buckets of at most ``capacity_elems`` elements; a bucket
is sent when its last member is pushed.  Every decision depends only on the sequence of calls,
so the workers of a job, which make the same calls, form the same buckets without talking.

If the sequence ever changes (a key missing, added or reordered), fusion stops for good and
the members already collected in an open bucket are sent one by one: nothing waits for a
member that will not come.  Pure logic, no I/O.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

__all__ = ["FUSED_KEY_BASE", "Bucket", "Call", "FusionPlanner"]

# Key ids from here on name buckets; user keys must stay below.
FUSED_KEY_BASE = 2 ** 31


@dataclass(frozen=True)
class Call:
    """One pushpull as the planner sees it."""

    key: int
    n_elems: int
    dtype: str


@dataclass
class Bucket:
    """Keys packed into one flat tensor: member ``i`` is ``[offsets[i], offsets[i+1])``."""

    key: int
    server: int
    dtype: str
    members: List[Call] = field(default_factory=list)

    @property
    def offsets(self) -> List[int]:
        bounds = [0]
        for call in self.members:
            bounds.append(bounds[-1] + call.n_elems)
        return bounds

    @property
    def n_elems(self) -> int:
        return sum(call.n_elems for call in self.members)


@dataclass(frozen=True)
class Slot:
    """Where a call goes: member ``index`` of ``bucket``; ``last`` when it completes it."""

    bucket: Bucket
    index: int
    last: bool


class _State(enum.Enum):
    LEARNING = "learning"
    FUSED = "fused"
    OFF = "off"


class FusionPlanner:
    """Decides, call by call, whether a pushpull is sent alone or as part of a bucket.

    ``server_of(key, n_elems)`` is the server that owns a small key (fused keys must share
    one); keys that are not small, not floating point, or whose server is None (a key cut
    into parts) are never fused.  ``capacity_elems`` 0 disables fusion.
    """

    def __init__(self, capacity_elems: int, server_of: Callable[[int, int], Optional[int]]):
        self.capacity_elems = capacity_elems
        self._server_of = server_of
        self._state = _State.LEARNING if capacity_elems > 0 else _State.OFF
        self._sequence: List[Call] = []
        self._slots: List[Optional[Slot]] = []
        self._position = 0
        self.buckets: List[Bucket] = []
        self.stop_reason = "" if capacity_elems > 0 else "DGT_FUSION_ELEMS=0"

    @property
    def active(self) -> bool:
        return self._state is _State.FUSED

    @property
    def stopped(self) -> bool:
        return self._state is _State.OFF

    def place(self, call: Call) -> Tuple[Optional[Slot], bool]:
        """Where ``call`` goes: ``(slot, broke)``.  ``slot`` None means alone.  ``broke`` is
        True when this call broke the learned order: fusion stopped, and buckets with
        members collected must be sent member by member now (see :meth:`stop`)."""
        if self._state is _State.LEARNING:
            if self._sequence and call.key == self._sequence[0].key:
                self._plan()
            else:
                if any(c.key == call.key for c in self._sequence):
                    self.stop("a key came twice before the first key came again")
                    return None, True
                self._sequence.append(call)
                return None, False
        if self._state is _State.OFF:
            return None, False
        expected = self._sequence[self._position]
        if call != expected:
            self.stop(f"pushpull of key {call.key} where key {expected.key} was expected: the "
                      "keys pushed per step changed")
            return None, True
        slot = self._slots[self._position]
        self._position = (self._position + 1) % len(self._sequence)
        return slot, False

    def stop(self, reason: str) -> None:
        """Stop fusing for good (idempotent)."""
        if self._state is not _State.OFF:
            self._state = _State.OFF
            self.stop_reason = reason

    def _plan(self) -> None:
        """Pack the learned step into buckets (called when its first key comes again)."""
        open_buckets: Dict[Tuple[int, str], Bucket] = {}
        slots: List[Optional[Tuple[Bucket, int]]] = []
        for call in self._sequence:
            server = self._server_of(call.key, call.n_elems)
            if server is None or call.n_elems >= self.capacity_elems or \
                    not call.dtype.startswith("float"):
                slots.append(None)
                continue
            group = (server, call.dtype)
            bucket = open_buckets.get(group)
            if bucket is None or bucket.n_elems + call.n_elems > self.capacity_elems:
                bucket = Bucket(FUSED_KEY_BASE + len(self.buckets), server, call.dtype)
                self.buckets.append(bucket)
                open_buckets[group] = bucket
            slots.append((bucket, len(bucket.members)))
            bucket.members.append(call)
        single = {id(b) for b in self.buckets if len(b.members) < 2}
        self.buckets = [b for b in self.buckets if id(b) not in single]
        for index, bucket in enumerate(self.buckets):
            bucket.key = FUSED_KEY_BASE + index
        self._slots = [Slot(s[0], s[1], s[1] == len(s[0].members) - 1)
                       if s is not None and id(s[0]) not in single else None for s in slots]
        self._position = 0
        if self.buckets:
            self._state = _State.FUSED
        else:
            self.stop("no two small keys to pack together")
