"""Error feedback: what a worker remembers of the gradient that did not reach the merge.

The server's reply says which UDP fragments of this worker were not merged; the worker keeps
exactly those values and adds them to the next gradient of the same part.  So every value a
worker pushes is eventually merged or still held here: ``sum(merged) + residual == sum(pushed)``.

What is owed is kept sparse, as the lost fragments' element ranges and their values in rows of
one array: the lost share of a part (8 % of AlexNet's at the testbed's loss), where a dense
residual cost a full-size allocation and a Python loop over the ranges in ``remember`` and a
three-array pass in ``compensate``.  On AlexNet's 20 M parameters at 40 % UDP loss (~7 000 lost fragments per
step) the two took 63 ms per worker step on the development machine, the sparse ones 33 ms,
most of it the one copy of the gradient that ``compensate`` makes into the worker's buffer.
A caller that lends its own send buffer (``pushpull(..., may_overwrite=True)``, as the MXNet
adapter does) has the owed values added there in place, without that copy.
"""
from __future__ import annotations

from typing import Dict, Hashable, Iterable, NamedTuple, Optional, Tuple

import numpy as np

from .kernels import gather_rows_, rows_add_

__all__ = ["ResidualMemory"]


class _Owed(NamedTuple):
    starts: np.ndarray  # int64 element ranges of the part, not overlapping
    stops: np.ndarray
    rows: np.ndarray    # float32 (n_ranges, longest range); row r holds range r, then zeros
    n_elems: int        # the part's length, for owed()


class ResidualMemory:
    __slots__ = ("_owed",)

    def __init__(self):
        self._owed: Dict[Hashable, _Owed] = {}

    def compensate(self, key: Hashable, flat: np.ndarray,
                   out: Optional[np.ndarray] = None) -> np.ndarray:
        """``flat`` plus what is owed for ``key``: ``flat`` itself when nothing is owed, else a
        new array (or ``out``, same shape and dtype as ``flat``; ``out=flat`` adds in place)."""
        owed = self._owed.pop(key, None)
        if owed is None:
            return flat
        if owed.n_elems != flat.size:
            raise ValueError(f"compensate: {key!r} owes values for {owed.n_elems} elements, "
                             f"got a gradient of {flat.size}")
        if out is None:
            out = np.empty_like(flat)
        if out is not flat:
            np.copyto(out, flat)
        if not rows_add_(out, owed.starts, owed.stops, owed.rows):
            for start, stop, row in zip(owed.starts.tolist(), owed.stops.tolist(), owed.rows):
                view = out[start:stop]
                np.add(view, row[:stop - start], out=view, casting="unsafe")
        return out

    def remember(self, key: Hashable, sent: np.ndarray, starts: np.ndarray,
                 stops: np.ndarray) -> int:
        """Keep ``sent[start:stop]`` for every missing range (ranges must not overlap), for
        the next step; returns how many elements are kept."""
        if not len(starts):
            self._owed.pop(key, None)
            return 0
        starts = np.asarray(starts, dtype=np.int64)
        stops = np.asarray(stops, dtype=np.int64)
        lengths = stops - starts
        rows = np.zeros((len(starts), int(lengths.max())), dtype=np.float32)
        gather_rows_(rows, sent, starts, stops)
        self._owed[key] = _Owed(starts, stops, rows, sent.size)
        return int(lengths.sum())

    def absorb(self, key: Hashable, n_elems: int,
               members: Iterable[Tuple[Hashable, int]]) -> int:
        """Make what is owed for each ``(member, offset)`` owed for ``key`` instead, a tensor of
        ``n_elems`` holding each member at its offset (a fusion bucket that takes over keys
        which were pushed on their own: without this their last losses were never sent).
        Returns how many elements moved."""
        members = [(member, offset) for member, offset in members if member in self._owed]
        if not members:
            return 0
        for member, offset in members:  # checked before anything moves: a refusal loses nothing
            n_member = self._owed[member].n_elems
            if offset < 0 or offset + n_member > n_elems:
                raise ValueError(f"absorb: {n_member} elements at offset {offset} do not fit "
                                 f"in {key!r}'s {n_elems}")
        pieces = [(self._owed.pop(member), offset) for member, offset in members]
        moved = sum(int((owed.stops - owed.starts).sum()) for owed, _ in pieces)
        mine = self._owed.pop(key, None)
        if mine is not None:
            pieces.append((mine, 0))
        starts = np.concatenate([owed.starts + offset for owed, offset in pieces])
        stops = np.concatenate([owed.stops + offset for owed, offset in pieces])
        rows = np.zeros((len(starts), max(owed.rows.shape[1] for owed, _ in pieces)),
                        dtype=np.float32)
        first = 0
        for owed, _ in pieces:
            rows[first:first + len(owed.rows), :owed.rows.shape[1]] = owed.rows
            first += len(owed.rows)
        order = np.argsort(starts, kind="stable")
        self._owed[key] = _Owed(starts[order], stops[order], rows[order], n_elems)
        return moved

    def split(self, key: Hashable, members: Iterable[Tuple[Hashable, int, int]]) -> int:
        """The inverse of :meth:`absorb`: what is owed for ``key`` becomes owed for each
        ``(member, offset, n_elems)`` slice of it (a fusion bucket whose keys travel on their
        own again); a range that crosses two members is cut between them, and what a member
        already owes is kept and added to.  Returns how many elements moved."""
        owed = self._owed.get(key)
        if owed is None:
            return 0
        members = list(members)
        for member, offset, n_member in members:
            if offset < 0 or n_member < 0 or offset + n_member > owed.n_elems:
                raise ValueError(f"split: {n_member} elements at offset {offset} do not fit "
                                 f"in {key!r}'s {owed.n_elems}")
        del self._owed[key]
        # Once, when fusion stops: dense is simplest, and the bucket is one server's share.
        dense = np.zeros(owed.n_elems, dtype=np.float32)
        rows_add_(dense, owed.starts, owed.stops, owed.rows)
        moved = 0
        for member, offset, n_member in members:
            stop = offset + n_member
            inside = (owed.starts < stop) & (owed.stops > offset)
            if not n_member or not inside.any():
                continue
            starts = np.maximum(owed.starts[inside], offset) - offset
            stops = np.minimum(owed.stops[inside], stop) - offset
            moved += int((stops - starts).sum())
            values = dense[offset:stop]
            mine = self._owed.pop(member, None)
            if mine is not None:
                if mine.n_elems != n_member:
                    raise ValueError(f"split: {member!r} owes values for {mine.n_elems} "
                                     f"elements, its slice of {key!r} has {n_member}")
                values = values.copy()
                rows_add_(values, mine.starts, mine.stops, mine.rows)
                starts, stops = _union(starts, stops, mine.starts, mine.stops)
            self.remember(member, values, starts, stops)
        return moved

    def owes(self, key: Hashable) -> bool:
        return key in self._owed

    def owed(self, key: Hashable) -> Optional[np.ndarray]:
        """What is held for ``key`` as a dense float32 array of the part's length (zeros where
        nothing is owed), or None: for tests and inspection, not the push path."""
        owed = self._owed.get(key)
        if owed is None:
            return None
        dense = np.zeros(owed.n_elems, dtype=np.float32)
        rows_add_(dense, owed.starts, owed.stops, owed.rows)
        return dense


def _union(starts_a, stops_a, starts_b, stops_b) -> Tuple[np.ndarray, np.ndarray]:
    """The non-overlapping ranges that cover two sets of ranges."""
    starts = np.concatenate([starts_a, starts_b])
    stops = np.concatenate([stops_a, stops_b])
    order = np.argsort(starts, kind="stable")
    merged_starts, merged_stops = [], []
    for start, stop in zip(starts[order].tolist(), stops[order].tolist()):
        if merged_stops and start <= merged_stops[-1]:
            merged_stops[-1] = max(merged_stops[-1], stop)
        else:
            merged_starts.append(start)
            merged_stops.append(stop)
    return np.array(merged_starts, dtype=np.int64), np.array(merged_stops, dtype=np.int64)
