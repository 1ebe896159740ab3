"""Numpy references for the server's compiled batch scan (:func:`dgt.wire.scan_datagram_batch`).

The server once ran these; the scan replaced them (one compiled pass per batch instead of
~75 us of numpy calls), and they stay here as the oracles it is tested against.
"""
from typing import List

import numpy as np

from dgt.wire import _DATAGRAM_ITEMSIZE, HEADER_BYTES, MAGIC, VERSION, MsgType


def check_datagrams(headers: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Vectorised :func:`dgt.wire.decode_datagram` checks: True where a datagram is well formed.

    ``headers`` (HEADER_DTYPE) and ``sizes`` (total datagram bytes) describe a batch.
    """
    ok = ((sizes >= HEADER_BYTES) & (headers["magic"] == MAGIC) & (headers["version"] == VERSION)
          & (headers["type"] == int(MsgType.DATA))
          & (headers["channel"] >= 1) & (headers["n_elems"] >= 1)
          & (headers["block_elems"] >= 1) & (headers["frag_elems"] >= 1))
    n = headers["n_elems"].astype(np.int64)
    b = np.where(ok, headers["block_elems"], 1).astype(np.int64)
    fe = np.where(ok, headers["frag_elems"], 1).astype(np.int64)
    block = headers["block"].astype(np.int64)
    frag = headers["frag"].astype(np.int64)
    ok &= block < -(-n // b)
    block_len = np.minimum(b, n - block * b)
    ok &= frag < -(-np.maximum(block_len, 1) // fe)
    frag_len = np.minimum(fe, block_len - frag * fe)
    itemsize = _DATAGRAM_ITEMSIZE[headers["dtype"]]
    ok &= (itemsize > 0) & (sizes == HEADER_BYTES + frag_len * itemsize)
    return ok


_PUSH_FIELDS = ("rank", "key", "part", "step", "dtype", "n_elems", "block_elems", "frag_elems")


def header_runs(headers: np.ndarray, index: np.ndarray) -> List[np.ndarray]:
    """``index`` (ascending rows of ``headers``, a HEADER_DTYPE array) cut into runs of
    datagrams of the same push, in order.

    Datagrams of one push arrive in long runs (a sender hands the kernel up to 60 per call),
    so the server merges run by run; a push split over several runs is merged in several
    calls, which gives the same sums.  (Grouping with ``np.unique`` on the structured headers
    cost more than the merge itself.)
    """
    if len(index) == 0:
        return []
    every_row = len(index) == len(headers) and index[0] == 0 and index[-1] == len(headers) - 1
    starts = np.zeros(len(index), dtype=bool)
    starts[0] = True
    for name in _PUSH_FIELDS:
        # Column by column: fancy-indexing the structured array itself costs 20x more.
        column = headers[name] if every_row else headers[name][index]
        starts[1:] |= column[1:] != column[:-1]
    return np.split(index, np.flatnonzero(starts)[1:])
