"""Compiled passes over whole gradients (numba), each with the numpy expression it replaces.

A push touches every element of a gradient a few times; on AlexNet's 81 MB each numpy pass
costs 4-10 ms, and three of them did more work than their memory traffic needs:

* the block scores: ``np.abs`` writes a full-size temporary and ``np.add.reduceat`` reads it
  back with a pairwise sum that does not vectorise across 1024-element blocks (9 ms for
  16 M float32 on the development machine); one compiled sweep reads the gradient once (2 ms);
* the cast to bfloat16: ml_dtypes' cast runs an element loop per value (6.7 ms for 16 M); a
  compiled bit-level rounding runs at memory speed (3.2 ms) and gives the same bits;
* a server adding bfloat16 blocks into its float32 sum: numpy casts through ml_dtypes and
  then adds (9 ms for 16 M); widening a bfloat16 is a 16-bit shift, done block by block in
  cache on the way into the sum;
* a server merging a run of datagrams: deduplicating the slots (``np.unique``), masking and
  marking them and computing their element ranges took a dozen numpy calls per run of ~60
  datagrams, more than the additions; one compiled call claims the slots and adds the rows;
* the datagram rows (header, then a fragment's payload): numpy took the fragments into a
  temporary and copied headers and payloads into the rows in two more passes; one compiled
  pass copies each row's bytes once;
* with bfloat16 on the wire, a push cast the whole part and then gathered the reliable blocks
  and the datagrams' fragments from the cast copy; the gather and the rows now round each
  value on the way, so the float32 part is read once and no bfloat16 copy of it is written.

Each function takes the compiled path for the dtypes it was written for (float32, contiguous)
and the numpy expression otherwise, so every input dtype keeps working; the tests check the two
paths against each other.  Kernels are compiled on first use and cached on disk by numba
(``cache=True``), so a process pays the compilation once per machine, not once per start.
"""
from __future__ import annotations

from typing import Optional

import ml_dtypes
import numpy as np
from numba import njit

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

__all__ = ["add_bfloat16_", "block_abs_sums", "blocks_into_", "cast", "datagram_rows_",
           "datagram_rows_bfloat16_", "gather_bfloat16_", "gather_rows_", "merge_rows_",
           "rows_add_", "scale_ranges_", "scan_datagrams", "to_bfloat16",
           "weights_delta_bfloat16_", "warm_up"]

# Reassociation lets the compiler keep several partial sums in vector registers; the flags
# that assume no NaN or infinity are left out, so a NaN gradient still gives a NaN score.
_SUM_FASTMATH = {"reassoc"}


@njit(cache=True, nogil=True, boundscheck=False, fastmath=_SUM_FASTMATH)
def _block_abs_sums_f32(flat, block_elems, out):  # pragma: no cover - compiled
    n_full = flat.size // block_elems
    # Rows of fixed length: the inner loop vectorises (indexing the flat array from a
    # computed start does not, and runs 8x slower).
    rows = flat[:n_full * block_elems].reshape(n_full, block_elems)
    for block in range(n_full):
        row = rows[block]
        total = np.float32(0.0)
        for i in range(block_elems):
            total += abs(row[i])
        out[block] = total
    if n_full < out.size:
        total = np.float32(0.0)
        for i in range(n_full * block_elems, flat.size):
            total += abs(flat[i])
        out[n_full] = total


def block_abs_sums(flat: np.ndarray, block_elems: int) -> np.ndarray:
    """Sum of ``|x|`` over every ``block_elems`` elements of ``flat`` (the last block over what
    is left), in float32 whatever ``flat``'s dtype."""
    n_blocks = -(-flat.size // block_elems)
    if flat.dtype == np.float32 and flat.ndim == 1 and flat.flags.c_contiguous:
        out = np.empty(n_blocks, np.float32)
        _block_abs_sums_f32(flat, block_elems, out)
        return out
    absolute = np.abs(flat.astype(np.float32, copy=False))
    return np.add.reduceat(absolute, np.arange(0, flat.size, block_elems))


@njit(cache=True, nogil=True, boundscheck=False)
def _to_bfloat16_bits(bits, out):  # pragma: no cover - compiled
    for i in range(bits.size):
        value = bits[i]
        if (value & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            # NaN: the quiet NaN of its sign, as ml_dtypes makes it.
            out[i] = np.uint16(((value >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0))
        else:
            # Round to nearest, ties to even; overflow rounds to infinity as it should.
            rounding = np.uint32(0x7FFF) + ((value >> np.uint32(16)) & np.uint32(1))
            out[i] = np.uint16((value + rounding) >> np.uint32(16))


def to_bfloat16(values: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``values`` rounded into the bfloat16 array ``out`` (same size), as
    ``np.copyto(out, values, casting="unsafe")`` rounds it; returns ``out``."""
    if values.dtype == np.float32 and values.ndim == 1 and out.ndim == 1 \
            and values.flags.c_contiguous and out.flags.c_contiguous:
        _to_bfloat16_bits(values.view(np.uint32), out.view(np.uint16))
    else:
        np.copyto(out, values, casting="unsafe")
    return out


def cast(values: np.ndarray, dtype, out: np.ndarray = None) -> np.ndarray:
    """``values`` in ``dtype``, into ``out`` when given (same size); without ``out``, the same
    array when it already is of ``dtype``.  float32 to bfloat16 takes the compiled rounding;
    every other pair numpy's cast (``casting="unsafe"``, ml_dtypes' for bfloat16)."""
    dtype = np.dtype(dtype)
    if out is None:
        if values.dtype == dtype:
            return values
        out = np.empty(values.shape, dtype)
    if dtype == _BFLOAT16:
        return to_bfloat16(values, out)
    np.copyto(out, values, casting="unsafe")
    return out


@njit(cache=True, nogil=True, boundscheck=False)
def _bfloat16_gather(bits, blocks, block_elems, n_elems, out):  # pragma: no cover - compiled
    offset = 0
    for j in range(blocks.size):
        start = blocks[j] * block_elems
        length = min(block_elems, n_elems - start)  # the tensor's last block may be short
        _to_bfloat16_bits(bits[start:start + length], out[offset:offset + length])
        offset += length


def gather_bfloat16_(out: np.ndarray, values: np.ndarray, blocks: np.ndarray,
                     block_elems: int) -> bool:
    """Round the float32 ``values``' ascending ``blocks`` (at their true lengths) into the
    bfloat16 ``out``, one pass: the cast and the gather of a push, without a bfloat16 copy
    of the whole part in between.  Returns False, having done nothing, for any other dtypes
    or layouts."""
    if values.dtype != np.float32 or out.dtype != _BFLOAT16 or values.ndim != 1 \
            or out.ndim != 1 or not values.flags.c_contiguous or not out.flags.c_contiguous:
        return False
    _bfloat16_gather(values.view(np.uint32), np.asarray(blocks, dtype=np.int64), block_elems,
                     values.size, out.view(np.uint16))
    return True


@njit(cache=True, nogil=True, boundscheck=False)
def _write_or_add(target, source, add):  # pragma: no cover - compiled, inlined by LLVM
    if add:
        for i in range(target.size):
            target[i] += source[i]
    else:
        for i in range(target.size):
            target[i] = source[i]


@njit(cache=True, nogil=True, boundscheck=False)
def _bfloat16_blocks_into(padded, blocks, block_elems, n_elems, bits, filled):  # pragma: no cover
    # One block at a time: the widened block stays in cache between its two loops.
    widened = np.empty(block_elems, np.uint32)
    as_float = widened.view(np.float32)
    offset = 0
    for j in range(blocks.size):
        start = blocks[j] * block_elems
        length = min(block_elems, n_elems - start)  # the tensor's last block may be short
        source = bits[offset:offset + length]
        for i in range(length):
            widened[i] = np.uint32(source[i]) << np.uint32(16)
        _write_or_add(padded[start:start + length], as_float[:length], filled[blocks[j]])
        filled[blocks[j]] = True
        offset += length


@njit(cache=True, nogil=True, boundscheck=False)
def _float32_blocks_into(padded, blocks, block_elems, n_elems, payload, filled):  # pragma: no cover
    offset = 0
    for j in range(blocks.size):
        start = blocks[j] * block_elems
        length = min(block_elems, n_elems - start)
        _write_or_add(padded[start:start + length], payload[offset:offset + length],
                      filled[blocks[j]])
        filled[blocks[j]] = True
        offset += length


def blocks_into_(padded: np.ndarray, blocks: np.ndarray, block_elems: int, n_elems: int,
                 payload: np.ndarray, add) -> bool:
    """Write (``add``: add) the float32 or bfloat16 ``payload`` of ascending ``blocks``
    (gathered at their true lengths, see :meth:`dgt.partition.BlockLayout.gather`) into the
    float32 ``padded``, block by block.  ``add`` is one bool for every block, or a bool per
    block of the tensor (a server's "this block already holds data"): those blocks are added
    to, the others written, and all of ``blocks`` are then marked in it.  Returns False,
    having done nothing, for any other dtypes or layouts."""
    if padded.dtype != np.float32 or padded.ndim != 1 or payload.ndim != 1 \
            or not padded.flags.c_contiguous or not payload.flags.c_contiguous:
        return False
    if payload.dtype not in (np.float32, _BFLOAT16):
        return False
    blocks = np.asarray(blocks, dtype=np.int64)  # one compiled signature (and warm_up's)
    if isinstance(add, np.ndarray):
        if add.dtype != np.bool_ or add.ndim != 1 or (len(blocks) and blocks.max() >= add.size):
            raise ValueError(f"blocks_into_: `add` must be a bool per block ({add.dtype}, "
                             f"{add.shape} for block {blocks.max() if len(blocks) else 0})")
        filled = add
    else:
        filled = np.full(-(-n_elems // block_elems), bool(add))
    if payload.dtype == np.float32:
        _float32_blocks_into(padded, blocks, block_elems, n_elems, payload, filled)
    else:
        _bfloat16_blocks_into(padded, blocks, block_elems, n_elems, payload.view(np.uint16),
                              filled)
    return True


@njit(cache=True, nogil=True, boundscheck=False)
def _float32_rows_add(acc, starts, stops, rows):  # pragma: no cover - compiled
    for r in range(rows.shape[0]):
        target, row = acc[starts[r]:stops[r]], rows[r]
        for i in range(target.size):
            target[i] += row[i]


@njit(cache=True, nogil=True, boundscheck=False)
def _bfloat16_rows_add(acc, starts, stops, bits):  # pragma: no cover - compiled
    widened = np.empty(bits.shape[1], np.uint32)
    as_float = widened.view(np.float32)
    for r in range(bits.shape[0]):
        target, row = acc[starts[r]:stops[r]], bits[r]
        for i in range(target.size):
            widened[i] = np.uint32(row[i]) << np.uint32(16)
        for i in range(target.size):
            target[i] += as_float[i]


def rows_add_(acc: np.ndarray, starts: np.ndarray, stops: np.ndarray, rows: np.ndarray) -> bool:
    """Add ``rows[r, :stops[r] - starts[r]]`` (float32 or bfloat16; rows may be strided views
    of a receive buffer) into the float32 ``acc[starts[r]:stops[r]]``, row by row in one
    pass: a server merging a batch of datagrams.  Ranges must not overlap (a batch's slots
    are unique).  Returns False, having done nothing, for any other dtypes or shapes."""
    if acc.dtype != np.float32 or acc.ndim != 1 or not acc.flags.c_contiguous \
            or rows.ndim != 2 or (rows.shape[0] and rows.strides[1] != rows.itemsize):
        return False
    starts = np.asarray(starts, dtype=np.int64)
    stops = np.asarray(stops, dtype=np.int64)
    if len(starts) != rows.shape[0] or len(stops) != rows.shape[0]:
        return False
    if rows.shape[0] and (starts.min() < 0 or stops.max() > acc.size
                          or (stops - starts).max() > rows.shape[1]
                          or (stops - starts).min() < 0):
        raise ValueError("rows_add_: a row's range lies outside the accumulator or the row")
    if rows.dtype == np.float32:
        _float32_rows_add(acc, starts, stops, rows)
    elif rows.dtype == _BFLOAT16:
        _bfloat16_rows_add(acc, starts, stops, rows.view(np.uint16))
    else:
        return False
    return True


_DELTA_CHUNK = 1024  # elements widened at a time: the chunk stays in cache between its loops


# Both delta kernels index slices of the chunk's range, not the whole arrays from `lo + i`: the
# computed offset kept LLVM from vectorising the loops, which then ran 2.5-3x slower.
@njit(cache=True, nogil=True, boundscheck=False)
def _weights_delta_bfloat16(weights, held, out_bits):  # pragma: no cover - compiled
    chunk = np.empty(_DELTA_CHUNK, np.float32)
    chunk_bits = chunk.view(np.uint32)
    for lo in range(0, weights.size, _DELTA_CHUNK):
        hi = min(lo + _DELTA_CHUNK, weights.size)
        n = hi - lo
        weights_part, held_part, out_part = weights[lo:hi], held[lo:hi], out_bits[lo:hi]
        for i in range(n):
            chunk[i] = weights_part[i] - held_part[i]
        _to_bfloat16_bits(chunk_bits[:n], out_part)
        for i in range(n):
            chunk_bits[i] = np.uint32(out_part[i]) << np.uint32(16)
        for i in range(n):
            held_part[i] += chunk[i]


def weights_delta_bfloat16_(weights: np.ndarray, held: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The bfloat16 step from ``held`` (float32: the weights the workers hold) towards
    ``weights`` (float32: the server's), into ``out``, and ``held`` moved by exactly that
    step, as a worker adding it will move: ``out = bfloat16(weights - held);
    held += float32(out)``.  One pass; numpy's expression otherwise.  Returns ``out``."""
    if weights.shape != held.shape or weights.shape != out.shape:
        raise ValueError(f"weights_delta_bfloat16_: shapes {weights.shape}, {held.shape} and "
                         f"{out.shape} differ")
    if weights.dtype == np.float32 and held.dtype == np.float32 and out.dtype == _BFLOAT16 \
            and weights.ndim == 1 and weights.flags.c_contiguous and held.flags.c_contiguous \
            and out.flags.c_contiguous:
        _weights_delta_bfloat16(weights, held, out.view(np.uint16))
    else:
        to_bfloat16(np.subtract(weights, held, dtype=np.float32), out)
        held += out.astype(held.dtype)
    return out


@njit(cache=True, nogil=True, boundscheck=False)
def _add_bfloat16(target, bits):  # pragma: no cover - compiled
    widened = np.empty(_DELTA_CHUNK, np.uint32)
    as_float = widened.view(np.float32)
    for lo in range(0, target.size, _DELTA_CHUNK):
        hi = min(lo + _DELTA_CHUNK, target.size)
        n = hi - lo
        target_part, bits_part = target[lo:hi], bits[lo:hi]
        for i in range(n):
            widened[i] = np.uint32(bits_part[i]) << np.uint32(16)
        for i in range(n):
            target_part[i] += as_float[i]


def add_bfloat16_(target: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """``target += delta`` for a float32 ``target`` and a bfloat16 ``delta`` (a worker
    applying :func:`weights_delta_bfloat16_`'s step), widening in cache instead of through a
    float32 copy of ``delta``.  Returns ``target``."""
    if target.shape != delta.shape:
        raise ValueError(f"add_bfloat16_: shapes {target.shape} and {delta.shape} differ")
    if target.dtype == np.float32 and delta.dtype == _BFLOAT16 and target.ndim == 1 \
            and target.flags.c_contiguous and delta.flags.c_contiguous:
        _add_bfloat16(target, delta.view(np.uint16))
    else:
        target += delta.astype(target.dtype)
    return target


@njit(cache=True, nogil=True, boundscheck=False)
def _float32_gather_rows(rows, source, starts, stops):  # pragma: no cover - compiled
    for r in range(rows.shape[0]):
        piece, row = source[starts[r]:stops[r]], rows[r]
        for i in range(piece.size):
            row[i] = piece[i]


def gather_rows_(rows: np.ndarray, source: np.ndarray, starts: np.ndarray,
                 stops: np.ndarray) -> np.ndarray:
    """Copy ``source[starts[r]:stops[r]]`` into ``rows[r, :stops[r] - starts[r]]`` for every
    row, leaving the rest of each row as it was: the inverse of :func:`rows_add_` into a zero
    accumulator, a worker keeping the values of its lost datagrams (error feedback).  Numpy's
    expression is a Python loop over the ranges; any dtypes numpy can cast work, float32 ones
    in one compiled pass.  Returns ``rows``."""
    starts = np.asarray(starts, dtype=np.int64)
    stops = np.asarray(stops, dtype=np.int64)
    if rows.ndim != 2 or len(starts) != rows.shape[0] or len(stops) != rows.shape[0]:
        raise ValueError(f"gather_rows_: {len(starts)} ranges for rows of shape {rows.shape}")
    if rows.shape[0] and (starts.min() < 0 or stops.max() > source.size
                          or (stops - starts).max() > rows.shape[1]
                          or (stops - starts).min() < 0):
        raise ValueError("gather_rows_: a range lies outside the source or the row")
    if rows.dtype == np.float32 and source.dtype == np.float32 and source.ndim == 1 \
            and source.flags.c_contiguous and (rows.shape[0] == 0
                                               or rows.strides[1] == rows.itemsize):
        _float32_gather_rows(rows, source, starts, stops)
    else:
        for r, (start, stop) in enumerate(zip(starts.tolist(), stops.tolist())):
            rows[r, :stop - start] = source[start:stop]
    return rows


@njit(cache=True, nogil=True, boundscheck=False)
def _float32_scale_ranges(acc, starts, stops, factors):  # pragma: no cover - compiled
    for r in range(starts.size):
        factor = np.float32(factors[r])
        for i in range(starts[r], stops[r]):
            acc[i] *= factor


def scale_ranges_(acc: np.ndarray, starts: np.ndarray, stops: np.ndarray,
                  factors: np.ndarray) -> np.ndarray:
    """Multiply ``acc[starts[r]:stops[r]]`` by ``factors[r]`` (rounded to ``acc``'s dtype
    first, as numpy's in-place multiply by a cast factor array does): ``rescale`` mode
    scaling the few fragments that not every worker delivered, without a factor array the
    size of the part.  Float32 in one compiled pass, other dtypes range by range.
    Returns ``acc``."""
    starts = np.asarray(starts, dtype=np.int64)
    stops = np.asarray(stops, dtype=np.int64)
    factors = np.asarray(factors, dtype=np.float64)
    if not len(starts) == len(stops) == len(factors):
        raise ValueError(f"scale_ranges_: {len(starts)} starts, {len(stops)} stops and "
                         f"{len(factors)} factors")
    if len(starts) and (starts.min() < 0 or stops.max() > acc.size
                        or (stops - starts).min() < 0):
        raise ValueError("scale_ranges_: a range lies outside the accumulator")
    if acc.dtype == np.float32 and acc.ndim == 1 and acc.flags.c_contiguous:
        _float32_scale_ranges(acc, starts, stops, factors)
    else:
        for start, stop, factor in zip(starts.tolist(), stops.tolist(),
                                       factors.astype(acc.dtype).tolist()):
            acc[start:stop] *= factor
    return acc


_NO_MARKS = np.zeros(0, np.bool_)


@njit(cache=True, nogil=True, boundscheck=False)
def _claim_slots(received, reliable, blocks, frags, frags_per_block, block_elems, n_elems,
                 frag_elems, width, acc, filled, track, starts, stops):  # pragma: no cover
    acc_size = acc.size
    for r in range(blocks.size):  # every index is checked before anything is marked
        block, frag = blocks[r], frags[r]
        if block < 0 or block >= reliable.size or frag < 0 or frag >= frags_per_block \
                or block * frags_per_block + frag >= received.size:
            return -1
        start = block * block_elems + frag * frag_elems
        stop = min(start + frag_elems, block * block_elems + block_elems, n_elems)
        if stop < start or stop - start > width or stop > acc_size:
            return -1
        starts[r], stops[r] = start, stop
    fresh = 0
    for r in range(blocks.size):
        slot = blocks[r] * frags_per_block + frags[r]
        if received[slot] or reliable[blocks[r]]:
            stops[r] = starts[r]  # a duplicate (or a block that came reliably): adds nothing
        else:
            received[slot] = True
            fresh += 1
            block = blocks[r]
            if track and not filled[block]:  # the block's first data: zero it, then add
                lo = block * block_elems
                acc[lo:min(lo + block_elems, n_elems)] = 0.0
                filled[block] = True
    return fresh


def merge_rows_(acc: np.ndarray, received: np.ndarray, reliable: np.ndarray,
                blocks: np.ndarray, frags: np.ndarray, frags_per_block: int, block_elems: int,
                n_elems: int, frag_elems: int, rows: np.ndarray,
                filled: Optional[np.ndarray] = None) -> int:
    """A server merging one worker's run of datagrams into an open step, in one call.

    Row r is fragment ``frags[r]`` of block ``blocks[r]`` (the fragment layout of a part of
    ``n_elems`` elements); it is added into the float32 ``acc`` unless its slot is already
    set in ``received`` (a duplicate, also one repeated inside the run) or its block in
    ``reliable`` (sent over TCP too); ``received`` is set for the rows added.  With
    ``filled`` (a bool per block: the block holds data), a block's first row zeroes it before
    adding, and marks it: an accumulator need not be zeroed as a whole.  Replaces
    ``np.unique`` on the slots, two masks, their fancy-indexed updates and
    :func:`rows_add_`'s checks: the per-run numpy calls cost a server more than the additions.

    Returns how many rows were added; -1, having changed nothing, when the dtypes or shapes
    are not those compiled for (float32 or bfloat16 rows, int64 indices, bool masks); raises
    ValueError, having changed nothing, when an index lies outside the layout or a row.
    """
    if acc.dtype != np.float32 or acc.ndim != 1 or not acc.flags.c_contiguous \
            or received.dtype != np.bool_ or reliable.dtype != np.bool_ \
            or received.ndim != 1 or reliable.ndim != 1 \
            or (filled is not None and (filled.dtype != np.bool_ or filled.ndim != 1
                                        or filled.size != reliable.size)) \
            or blocks.dtype != np.int64 or frags.dtype != np.int64 or rows.ndim != 2 \
            or not len(blocks) == len(frags) == rows.shape[0] \
            or (rows.shape[0] and rows.strides[1] != rows.itemsize):
        return -1
    if rows.dtype == np.float32:
        add_rows, payload = _float32_rows_add, rows
    elif rows.dtype == _BFLOAT16:
        add_rows, payload = _bfloat16_rows_add, rows.view(np.uint16)
    else:
        return -1
    starts = np.empty(len(blocks), np.int64)
    stops = np.empty(len(blocks), np.int64)
    track = filled is not None
    fresh = _claim_slots(received, reliable, blocks, frags, frags_per_block, block_elems,
                         n_elems, frag_elems, rows.shape[1], acc,
                         filled if track else _NO_MARKS, track, starts, stops)
    if fresh < 0:
        raise ValueError("merge_rows_: a datagram's block or fragment lies outside the part's "
                         "layout, the accumulator or its row")
    if fresh:
        add_rows(acc, starts, stops, payload)  # a duplicate's range is empty: it adds nothing
    return fresh


# The header fields a batch scan reads, in this order (offsets and widths come from the wire
# module's record layout, which imports this one).
SCAN_FIELDS = ("magic", "version", "type", "job", "rank", "channel", "dtype", "key", "part",
               "step", "n_elems", "block_elems", "frag_elems", "block", "frag")
# The fields that identify a datagram's push, as columns of the scan's run table.
SCAN_RUN_FIELDS = ("job", "rank", "dtype", "key", "part", "step", "n_elems", "block_elems",
                   "frag_elems")
(_F_MAGIC, _F_VERSION, _F_TYPE, _F_JOB, _F_RANK, _F_CHANNEL, _F_DTYPE, _F_KEY, _F_PART,
 _F_STEP, _F_N, _F_BLOCK_ELEMS, _F_FRAG_ELEMS, _F_BLOCK, _F_FRAG) = range(len(SCAN_FIELDS))
_RUN_COLUMNS = np.array([SCAN_FIELDS.index(name) for name in SCAN_RUN_FIELDS], np.int64)
# What a scan says of each datagram.
SCAN_OK, SCAN_MALFORMED, SCAN_FOREIGN, SCAN_UNKNOWN_SENDER = 0, 1, 2, 3


@njit(cache=True, nogil=True, boundscheck=False)
def _scan_datagrams(rows, sizes, offsets, widths, expect, job_id, known, itemsizes, run_columns,
                    verdicts, blocks, frags, index, run_bounds, run_fields):  # pragma: no cover
    header_bytes, magic, version, data_type = expect[0], expect[1], expect[2], expect[3]
    fields = np.empty(offsets.size, np.int64)
    previous = np.empty(offsets.size, np.int64)
    n_ok = n_runs = 0
    for r in range(sizes.size):
        for f in range(offsets.size):  # little-endian, as the record layout is
            value = 0
            for byte in range(widths[f]):
                value |= np.int64(rows[r, offsets[f] + byte]) << (8 * byte)
            fields[f] = value
        blocks[r], frags[r] = fields[_F_BLOCK], fields[_F_FRAG]
        n, b, fe = fields[_F_N], fields[_F_BLOCK_ELEMS], fields[_F_FRAG_ELEMS]
        ok = (sizes[r] >= header_bytes and fields[_F_MAGIC] == magic
              and fields[_F_VERSION] == version and fields[_F_TYPE] == data_type
              and fields[_F_CHANNEL] >= 1 and n >= 1 and b >= 1 and fe >= 1)
        if ok:
            block, frag = fields[_F_BLOCK], fields[_F_FRAG]
            ok = block < -(-n // b)
            block_len = min(b, n - block * b)
            ok = ok and frag < -(-max(block_len, 1) // fe)
            frag_len = min(fe, block_len - frag * fe)
            itemsize = itemsizes[fields[_F_DTYPE]]
            ok = ok and itemsize > 0 and sizes[r] == header_bytes + frag_len * itemsize
        if not ok:
            verdicts[r] = SCAN_MALFORMED
            continue
        if fields[_F_JOB] != job_id:
            verdicts[r] = SCAN_FOREIGN
            continue
        rank = fields[_F_RANK]
        if rank >= known.size or not known[rank]:
            verdicts[r] = SCAN_UNKNOWN_SENDER
            continue
        verdicts[r] = SCAN_OK
        fresh_run = n_runs == 0
        if not fresh_run:
            for c in range(run_columns.size):
                if fields[run_columns[c]] != previous[run_columns[c]]:
                    fresh_run = True
                    break
        if fresh_run:
            run_bounds[n_runs] = n_ok
            for c in range(run_columns.size):
                run_fields[n_runs, c] = fields[run_columns[c]]
            n_runs += 1
        previous[:] = fields
        index[n_ok] = r
        n_ok += 1
    run_bounds[n_runs] = n_ok
    return n_ok, n_runs


def scan_datagrams(rows: np.ndarray, sizes: np.ndarray, offsets: np.ndarray,
                   widths: np.ndarray, expect: np.ndarray, job_id: int, known: np.ndarray,
                   itemsizes: np.ndarray):
    """A server's whole check of a received batch in one call: which datagrams are well
    formed, of this job and from a worker that said HELLO, each datagram's block and fragment
    numbers, and the good ones cut into runs of one push.

    Datagram i's header is ``rows[i, :expect[0]]`` (uint8, fields at ``offsets``/``widths``
    in :data:`SCAN_FIELDS` order), its length ``sizes[i]``; ``expect`` is (header bytes,
    magic, version, DATA type code) and ``itemsizes[code]`` the element size of each dtype
    code a datagram may carry (0 for the others).  Returns ``(verdicts, blocks, frags, index,
    run_bounds, run_fields)``: a ``SCAN_*`` code per datagram; the good rows ascending; run k
    is ``index[run_bounds[k]:run_bounds[k + 1]]`` and ``run_fields[k]`` its push's
    :data:`SCAN_RUN_FIELDS`.  The same verdicts and runs as the numpy references in
    ``tests/unit/wire_oracles.py``, whose calls cost a server ~75 us per batch, more than
    merging a dozen datagrams."""
    count = len(sizes)
    if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[0] < count \
            or rows.shape[1] < expect[0]:
        raise ValueError(f"scan_datagrams: rows must be uint8 (n, >= header bytes), got "
                         f"{rows.dtype} {rows.shape} for {count} sizes")
    verdicts = np.empty(count, np.int8)
    blocks = np.empty(count, np.int64)
    frags = np.empty(count, np.int64)
    index = np.empty(count, np.int64)
    run_bounds = np.empty(count + 1, np.int64)
    run_fields = np.empty((count, _RUN_COLUMNS.size), np.int64)
    n_ok, n_runs = _scan_datagrams(rows, np.asarray(sizes, np.int64), offsets, widths, expect,
                                   job_id, known, itemsizes, _RUN_COLUMNS, verdicts, blocks,
                                   frags, index, run_bounds, run_fields)
    return (verdicts, blocks, frags, index[:n_ok], run_bounds[:n_runs + 1],
            run_fields[:n_runs])


@njit(cache=True, nogil=True, boundscheck=False)
def _datagram_rows(headers, source, starts, out):  # pragma: no cover - compiled
    header_bytes = headers.shape[1]
    payload_bytes = out.shape[1] - header_bytes
    for row in range(out.shape[0]):
        # Plain loops over 1-D views become memcpy-speed code; 2-D slice assignment compiled
        # to a generic strided copy, 8x slower.
        target, header = out[row], headers[row]
        for i in range(header_bytes):
            target[i] = header[i]
        payload = target[header_bytes:]
        source_row = source[starts[row]:starts[row] + payload_bytes]
        for i in range(payload_bytes):
            payload[i] = source_row[i]


@njit(cache=True, nogil=True, boundscheck=False)
def _datagram_rows_bfloat16(headers, bits, starts, out):  # pragma: no cover - compiled
    header_bytes = headers.shape[1]
    payload_elems = (out.shape[1] - header_bytes) // 2
    rounded = np.empty(payload_elems, np.uint16)
    rounded_bytes = rounded.view(np.uint8)  # rows are not 2-byte aligned: copy bytes
    for row in range(out.shape[0]):
        target, header = out[row], headers[row]
        for i in range(header_bytes):
            target[i] = header[i]
        _to_bfloat16_bits(bits[starts[row]:starts[row] + payload_elems], rounded)
        payload = target[header_bytes:]
        for i in range(2 * payload_elems):
            payload[i] = rounded_bytes[i]


def _check_rows(out, headers, source, starts, source_units: int):
    n_rows, row_bytes = out.shape
    header_bytes = headers.shape[1] if headers.ndim == 2 else -1
    if out.dtype != np.uint8 or headers.dtype != np.uint8 or headers.shape[0] != n_rows \
            or not 0 <= header_bytes <= row_bytes or source.ndim != 1 \
            or not source.flags.c_contiguous or len(starts) != n_rows:
        raise ValueError(f"datagram rows: {n_rows} rows of {row_bytes} bytes need {n_rows} "
                         f"uint8 header rows and starts and a flat source, got headers "
                         f"{headers.dtype}{headers.shape}, source {source.dtype}{source.shape}, "
                         f"{len(starts)} starts")
    starts = np.asarray(starts, dtype=np.int64)
    if n_rows and (starts.min() < 0
                   or starts.max() + (row_bytes - header_bytes) // source_units > source.size):
        raise ValueError("datagram rows: a row's payload lies outside the source")
    return np.ascontiguousarray(headers), starts


def datagram_rows_bfloat16_(out: np.ndarray, headers: np.ndarray, values: np.ndarray,
                            starts_elems: np.ndarray) -> np.ndarray:
    """:func:`datagram_rows_` whose payloads are the float32 ``values`` from
    ``starts_elems[r]`` on, rounded to bfloat16 on the way into the row."""
    if values.dtype != np.float32:
        raise ValueError(f"datagram_rows_bfloat16_: values must be float32, got {values.dtype}")
    headers, starts = _check_rows(out, headers, values, starts_elems, 2)
    _datagram_rows_bfloat16(headers, values.view(np.uint32), starts, out)
    return out


def datagram_rows_(out: np.ndarray, headers: np.ndarray, source: np.ndarray,
                   starts_bytes: np.ndarray) -> np.ndarray:
    """Fill ``out`` (uint8, one datagram per row): row ``r`` is ``headers[r]`` (uint8 rows)
    followed by the bytes of ``source`` (uint8) from ``starts_bytes[r]`` on, as many as the
    row has left.  Every range must lie within ``source`` (checked).  Returns ``out``."""
    if source.dtype != np.uint8:
        raise ValueError(f"datagram_rows_: the source must be uint8, got {source.dtype}")
    headers, starts = _check_rows(out, headers, source, starts_bytes, 1)
    _datagram_rows(headers, source, starts, out)
    return out


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel now, with the argument types a worker
    and a server pass, so that the first training step does not pay for it (up to seconds on a
    machine without the cache) and per-step CPU figures measure steady work."""
    values = np.linspace(-1.0, 1.0, 128, dtype=np.float32)
    blocks = np.array([0, 1], dtype=np.int64)
    block_abs_sums(values, 64)
    wire = to_bfloat16(values, np.empty(128, _BFLOAT16))
    padded = np.zeros(128, np.float32)
    received = []  # a server's payloads are read-only views of ZeroMQ frames
    for payload in (values, wire):
        frozen = payload.copy()
        frozen.flags.writeable = False
        received += [payload, frozen]
    for payload in received:
        for add in (False, True):
            blocks_into_(padded, blocks, 64, 128, payload, add)
    gather_bfloat16_(np.empty(128, _BFLOAT16), values, blocks, 64)
    # A server's datagram rows: strided views of its receive buffer, contiguous in tests.
    buffer = np.zeros((2, 4 + 2 * 32 * 4), np.uint8)
    for dtype in (np.float32, _BFLOAT16):
        width = 32 * 4 // np.dtype(dtype).itemsize
        strided = buffer[:, 4:4 + width * np.dtype(dtype).itemsize].view(dtype)
        for rows in (strided, np.ascontiguousarray(strided)):
            rows_add_(padded, np.array([0, 32]), np.array([32, 64]), rows)
            marks = np.zeros((2, 4), bool)  # a server's per-worker rows of (W, n) masks
            merge_rows_(padded, marks[0], marks[1, :2], blocks, np.zeros(2, np.int64), 2, 64,
                        128, 32, rows)
    # rescale mode: factors come as N / counts, float64 from an int64 division.
    scale_ranges_(padded, np.array([0, 32]), np.array([32, 64]), 2 / np.array([1, 1]))
    for source in received[:2]:  # a worker keeping its lost datagrams' values
        gather_rows_(np.zeros((2, 32), np.float32), source, np.array([0, 32]),
                     np.array([32, 64]))
    held = np.zeros(128, np.float32)
    delta = weights_delta_bfloat16_(values, held, np.empty(128, _BFLOAT16))
    add_bfloat16_(padded, delta)
    for payload in received[2:]:  # a worker's delta is a read-only view of a ZeroMQ frame
        add_bfloat16_(padded, payload)
    # A server's batch scan: a slice of its receive buffer, int64 sizes, a bool rank mask.
    fields = np.zeros(len(SCAN_FIELDS), np.int64)
    scan_datagrams(np.zeros((4, 64), np.uint8)[:2], np.zeros(4, np.int64)[:2], fields,
                   fields + 1, np.array([64, 0, 0, 0], np.int64), 0, np.ones(2, np.bool_),
                   np.zeros(256, np.int64))
    headers = np.zeros((2, 4), np.uint8)
    datagram_rows_(np.empty((2, 4 + 64), np.uint8), headers, values.view(np.uint8),
                   np.array([0, 64]))
    datagram_rows_bfloat16_(np.empty((2, 4 + 64), np.uint8), headers, values,
                            np.array([0, 32]))
