"""Key tensor <-> blocks <-> datagram fragments, and key tensor <-> server parts.

Invariants (pure numpy, no I/O):

* A *part* is a slice of a key's flattened tensor, merged and answered on its own by one
  server.  Tensors larger than ``part_elems`` are cut in near-equal parts so that pushes and
  replies of one big tensor pipeline (P3 and BytePS slice for the same reason).  Tensors of at
  least ``bigarray_elems`` elements are spread over all servers (part i on server i mod S);
  smaller ones live on one server picked by a hash of the key (:func:`home_server`).  MXNet's
  ``dist_sync`` uses ``(key * 9973) % num_servers``, which with 2 servers is the key's parity:
  Gluon numbers a layer's weight and bias one after the other, so every weight landed on the
  same server (GoogLeNet: 5.97 M elements on one, 0.007 M on the other).
* A *block* is a contiguous run of ``block_elems`` elements of a part; the last block may be
  shorter.  Blocks are the unit of scoring and of channel choice.
* A *fragment* is the piece of a block that fits one UDP datagram.  Every full block has
  ``frags_per_block`` fragment slots; the last block may use fewer.  Fragments are the unit of
  loss: the server merges whatever fragments arrive and reports the missing ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import List, Optional

import numpy as np

from .kernels import blocks_into_, cast, gather_bfloat16_
from .splitmix import GOLDEN, mix64

__all__ = ["BlockLayout", "FragmentLayout", "Part", "home_server", "plan_parts", "fragment_elems"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Part:
    """The ``[start, stop)`` slice of a key's flat tensor that server ``server`` owns."""

    server: int
    index: int
    start: int
    stop: int

    @property
    def n_elems(self) -> int:
        return self.stop - self.start


def fragment_elems(block_elems: int, itemsize: int, payload_bytes: int) -> int:
    """Elements per datagram: as many as fit ``payload_bytes``, preferably a divisor of the
    block so that every datagram of a full block has the same size (the sender can then hand
    the kernel many datagrams per call with UDP GSO, and the receiver can merge them as rows).
    A divisor is used only if it costs at most a third more datagrams."""
    most = max(1, payload_bytes // itemsize)
    if block_elems <= most:
        return block_elems
    fewest = _ceil_div(block_elems, most)
    for count in range(fewest, fewest + max(1, fewest // 3) + 1):
        if block_elems % count == 0:
            return block_elems // count
    return most


def home_server(key_id: int, num_servers: int) -> int:
    """The server of a key that is not spread: splitmix64 of the key, modulo the servers.

    A function of the key alone, so every worker agrees without talking; mixed, so that
    keys that alternate in size (weight, bias, weight, ...) do not all fall on one server."""
    with np.errstate(over="ignore"):
        mixed = mix64(np.uint64(key_id) + GOLDEN)
    return int(mixed % np.uint64(max(num_servers, 1)))


def plan_parts(n_elems: int, key_id: int, num_servers: int, bigarray_elems: int,
               part_elems: int = 0) -> List[Part]:
    """Cut one key into parts (see the module docstring).

    Parts hold at most ``part_elems`` elements (0: no limit), so that the push of one part
    and the reply of an earlier one use both directions of a link at once; tensors of at least
    ``bigarray_elems`` are also spread over all servers, round-robin."""
    count = _ceil_div(n_elems, part_elems) if part_elems > 0 else 1
    spread = num_servers > 1 and n_elems >= bigarray_elems
    if spread:
        count = max(count, num_servers)
    count = max(1, min(count, n_elems, 65535))
    bounds = [n_elems * i // count for i in range(count + 1)]
    home = home_server(key_id, num_servers)
    return [Part(i % num_servers if spread else home, i, bounds[i], bounds[i + 1])
            for i in range(count)]


@dataclass(frozen=True)
class BlockLayout:
    """Fixed-size blocks over a flat array of ``n_elems`` elements."""

    n_elems: int
    block_elems: int

    def __post_init__(self):
        if self.n_elems < 1 or self.block_elems < 1:
            raise ValueError(f"BlockLayout needs n_elems >= 1 and block_elems >= 1, got "
                             f"{self.n_elems}, {self.block_elems}")

    @property
    def n_blocks(self) -> int:
        return _ceil_div(self.n_elems, self.block_elems)

    @property
    def last_block_elems(self) -> int:
        return self.n_elems - (self.n_blocks - 1) * self.block_elems

    @property
    def padded_elems(self) -> int:
        return self.n_blocks * self.block_elems

    @cached_property
    def block_lengths(self) -> np.ndarray:
        lengths = np.full(self.n_blocks, self.block_elems, dtype=np.int64)
        lengths[-1] = self.last_block_elems
        return lengths

    def block_range(self, block: int):
        start = block * self.block_elems
        return start, min(start + self.block_elems, self.n_elems)

    def gather(self, flat: np.ndarray, blocks: np.ndarray,
               out: Optional[np.ndarray] = None) -> np.ndarray:
        """Concatenate the given blocks (ascending indices) at their true lengths.

        Full blocks are gathered through a 2-D view in one ``take``; only the (shorter) last
        block is appended separately.  ``out`` (at least as long as the result) avoids a new
        allocation; the result is then a view of it, in ``out``'s dtype: float32 into
        bfloat16 is rounded on the way by a compiled loop (:func:`dgt.kernels.gather_bfloat16_`),
        any other pair gathered first and then cast.
        """
        if out is not None and out.dtype != flat.dtype:
            result = out[:self.payload_elems(blocks)]
            if not gather_bfloat16_(result, flat, blocks, self.block_elems):
                cast(self.gather(flat, blocks), result.dtype, out=result)
            return result
        last = self.n_blocks - 1
        full = blocks[blocks < last]
        n_full = last * self.block_elems
        size = self.payload_elems(blocks)
        result = np.empty(size, flat.dtype) if out is None else out[:size]
        n_rows = len(full) * self.block_elems
        # mode="clip" lets numpy write straight into `out` (mode="raise" buffers it first);
        # the indices are in range by construction.
        np.take(flat[:n_full].reshape(last, self.block_elems), full, axis=0,
                out=result[:n_rows].reshape(len(full), self.block_elems), mode="clip")
        if len(full) != len(blocks):
            result[n_rows:] = flat[n_full:]
        return result

    def _as_rows(self, padded: np.ndarray) -> np.ndarray:
        return padded[:self.padded_elems].reshape(self.n_blocks, self.block_elems)

    def _rows(self, padded: np.ndarray, blocks: np.ndarray, payload: np.ndarray):
        """Views for a block-wise write: ``padded`` as (n_blocks, block_elems) rows, the full
        blocks among ``blocks`` and their payload as rows, and the last block's payload (its
        true length) or None when the last block is not among ``blocks``."""
        rows = self._as_rows(padded)
        if len(blocks) and blocks[-1] == self.n_blocks - 1:
            n_full = (len(blocks) - 1) * self.block_elems
            return (rows, blocks[:-1], payload[:n_full].reshape(-1, self.block_elems),
                    payload[n_full:])
        return rows, blocks, payload.reshape(-1, self.block_elems), None

    # Mean run length (in blocks) from which adding run by run as slices beats one
    # fancy-indexed add (gather, add, scatter) on 80 MB of 4 MB parts.
    _RUN_ADD_MIN_BLOCKS = 5

    def scatter_add_(self, padded: np.ndarray, blocks: np.ndarray, payload: np.ndarray) -> None:
        """Inverse of :meth:`gather`: add ``payload`` into ``padded`` (``padded_elems`` long).

        float32 or bfloat16 into float32 goes block by block through a compiled loop
        (:func:`dgt.kernels.blocks_into_`).  Other dtypes: long runs of consecutive blocks are
        added as slices, one pass over memory; scattered blocks with one fancy-indexed add,
        which costs a gather and a scatter but no Python per run (each is 2x faster than the
        other at its end of the range)."""
        if not len(blocks) or blocks_into_(padded, blocks, self.block_elems, self.n_elems,
                                            payload, add=True):
            return
        breaks = np.flatnonzero(np.diff(blocks) != 1) + 1
        if len(blocks) >= self._RUN_ADD_MIN_BLOCKS * (len(breaks) + 1):
            offset = 0
            for first, last in zip([0, *breaks.tolist()], [*breaks.tolist(), len(blocks)]):
                start = int(blocks[first]) * self.block_elems
                stop = min(int(blocks[last - 1] + 1) * self.block_elems, self.n_elems)
                padded[start:stop] += payload[offset:offset + stop - start]
                offset += stop - start
            return
        rows, full, full_payload, last = self._rows(padded, blocks, payload)
        rows[full] += full_payload
        if last is not None:
            rows[-1, :last.size] += last

    def scatter_into_(self, padded: np.ndarray, blocks: np.ndarray, payload: np.ndarray,
                      filled: np.ndarray) -> None:
        """Write ``payload`` into those of ``blocks`` (ascending) whose ``filled`` flag (a bool
        per block) is False and add it to the others, in one compiled pass where the dtypes
        allow (else the fresh blocks are zeroed, then everything added); marks every one of
        ``blocks`` filled.  A block's first data is written, not added to a zeroed block: one
        pass over its memory instead of two."""
        if not len(blocks) or blocks_into_(padded, blocks, self.block_elems, self.n_elems,
                                            payload, add=filled):
            return
        self.hold_(padded, blocks, filled)
        self.scatter_add_(padded, blocks, payload)

    def hold_(self, padded: np.ndarray, blocks: np.ndarray, filled: np.ndarray) -> None:
        """Zero those of ``blocks`` (any order, repeats allowed) whose ``filled`` flag is
        False, and set it: they can then be added to."""
        fresh = np.unique(np.asarray(blocks)[~filled[blocks]]) if len(blocks) else blocks
        for block in fresh.tolist():
            lo, hi = self.block_range(block)
            padded[lo:hi] = 0
        filled[fresh] = True

    def zero_except_(self, padded: np.ndarray, blocks: np.ndarray) -> None:
        """Zero every block of ``padded`` not in ``blocks``, and the padding after the last
        element.  With :meth:`scatter_into_` this fills an accumulator in one pass over memory,
        where zeroing it and then adding would take three."""
        keep = np.zeros(self.n_blocks, dtype=bool)
        keep[blocks] = True
        self._as_rows(padded)[~keep] = 0
        padded[self.n_elems:] = 0

    def expand_(self, flat: np.ndarray, blocks: np.ndarray, payload: np.ndarray) -> None:
        """Inverse of :meth:`gather` into an unpadded ``flat`` (``n_elems`` long): ``flat``
        becomes ``payload`` at ``blocks`` (ascending) and zero everywhere else."""
        last = self.n_blocks - 1
        n_full = last * self.block_elems
        keep = np.zeros(self.n_blocks, dtype=bool)
        keep[blocks] = True
        rows = flat[:n_full].reshape(last, self.block_elems)
        rows[~keep[:last]] = 0
        full = blocks[:-1] if keep[last] else blocks
        n_rows = len(full) * self.block_elems
        rows[full] = payload[:n_rows].reshape(len(full), self.block_elems)
        flat[n_full:] = payload[n_rows:] if keep[last] else 0

    def chunk_blocks(self, blocks: np.ndarray, chunk_elems: int) -> List[np.ndarray]:
        """Split ascending ``blocks`` into groups of whole blocks of at most ``chunk_elems``
        elements (at least one block each): one group per wire frame."""
        per_chunk = max(1, chunk_elems // self.block_elems)
        return [blocks[i:i + per_chunk] for i in range(0, len(blocks), per_chunk)]

    def payload_elems(self, blocks: np.ndarray) -> int:
        """Number of elements :meth:`gather` returns for ``blocks``."""
        return int(self.block_lengths[blocks].sum()) if len(blocks) else 0


@dataclass(frozen=True)
class FragmentLayout:
    """Datagram-sized fragments over the blocks of a :class:`BlockLayout`."""

    blocks: BlockLayout
    frag_elems: int

    def __post_init__(self):
        if self.frag_elems < 1:
            raise ValueError(f"frag_elems must be >= 1, got {self.frag_elems}")

    @property
    def frags_per_block(self) -> int:
        return _ceil_div(self.blocks.block_elems, self.frag_elems)

    @property
    def n_slots(self) -> int:
        return self.blocks.n_blocks * self.frags_per_block

    def frags_in_block(self, block: int) -> int:
        return _ceil_div(int(self.blocks.block_lengths[block]), self.frag_elems)

    @cached_property
    def valid_slots(self) -> np.ndarray:
        """Boolean mask over slots: True where the fragment exists."""
        valid = np.ones((self.blocks.n_blocks, self.frags_per_block), dtype=bool)
        valid[-1, self.frags_in_block(self.blocks.n_blocks - 1):] = False
        return valid.reshape(-1)

    def frag_range(self, block: int, frag: int):
        """Element range ``[start, stop)`` of fragment ``frag`` of ``block`` within the part."""
        b_start, b_stop = self.blocks.block_range(block)
        start = b_start + frag * self.frag_elems
        return start, min(start + self.frag_elems, b_stop)

    def slots_of_blocks(self, blocks: np.ndarray) -> np.ndarray:
        """Slot ids (block * frags_per_block + frag) of every existing fragment of ``blocks``."""
        fpb = self.frags_per_block
        slots = (np.asarray(blocks, dtype=np.int64)[:, None] * fpb + np.arange(fpb)).reshape(-1)
        return slots[self.valid_slots[slots]]

    def slot_ranges(self, slots: np.ndarray):
        """``(starts, stops)`` element ranges of the given slot ids (vectorised)."""
        slots = np.asarray(slots, dtype=np.int64)
        blocks, frags = np.divmod(slots, self.frags_per_block)
        block_starts = blocks * self.blocks.block_elems
        starts = block_starts + frags * self.frag_elems
        block_stops = np.minimum(block_starts + self.blocks.block_elems, self.blocks.n_elems)
        return starts, np.minimum(starts + self.frag_elems, block_stops)

    def element_mask(self, slot_mask: np.ndarray) -> np.ndarray:
        """Expand a boolean mask over slots to a boolean mask over the part's elements."""
        per_block = np.repeat(slot_mask.reshape(self.blocks.n_blocks, self.frags_per_block),
                              self.frag_elems, axis=1)[:, :self.blocks.block_elems]
        return per_block.reshape(-1)[:self.blocks.n_elems]
