"""UDP channels: one sending socket per channel (own TOS/priority), one receiving socket.

Datagrams are written with ``sendmsg`` from two buffers (header, payload view), so gradient
bytes are never copied in Python.  A full socket buffer blocks the sender briefly, which paces
it to what the kernel can take; it never raises into the caller for a transient condition.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import socket
import struct
import sys
from typing import List, Tuple

import numpy as np

from .priority import apply_udp_priority

__all__ = ["UdpSender", "UdpReceiver"]

logger = logging.getLogger(__name__)

SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
SOL_UDP = getattr(socket, "SOL_UDP", 17)
UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
GSO_MAX_SEGMENTS = 64  # UDP_MAX_SEGMENTS of older kernels
GSO_MAX_BYTES = 65000  # one IP packet's worth before segmentation
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)


# recvmmsg(2): a batch of datagrams in one system call, where the socket module offers one
# recv per datagram (the loop cost a server about a tenth of its CPU).  Linux on 64-bit only:
# the struct layouts below are those of LP64 (struct mmsghdr is a struct msghdr and the
# datagram's length); elsewhere the receiver loops over recv_into.
_IOVEC = np.dtype([("base", np.uintp), ("len", np.uintp)])
_MMSGHDR = np.dtype([("name", np.uintp), ("namelen", np.uint32), ("pad0", np.uint32),
                     ("iov", np.uintp), ("iovlen", np.uintp), ("control", np.uintp),
                     ("controllen", np.uintp), ("flags", np.int32), ("pad1", np.int32),
                     ("len", np.uint32), ("pad2", np.uint32)])
MSG_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0x40)


def _load_recvmmsg():
    """libc's recvmmsg as a ctypes function, or None where it cannot be used."""
    if not sys.platform.startswith("linux") or struct.calcsize("P") != 8 \
            or _MMSGHDR.itemsize != 64 or _IOVEC.itemsize != 16:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = libc.recvmmsg
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int,
                         ctypes.c_void_p]
    return function


_RECVMMSG = _load_recvmmsg()


def _set_buffer(sock: socket.socket, option: int, force_option: int, size: int) -> int:
    try:  # root may exceed net.core.[rw]mem_max; others get what the sysctl allows
        sock.setsockopt(socket.SOL_SOCKET, force_option, size)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, option, size)
    return sock.getsockopt(socket.SOL_SOCKET, option)


class UdpSender:
    """Sockets for UDP channels 1..C."""

    def __init__(self, udp_channels: int, buffer_bytes: int):
        self.udp_channels = udp_channels
        self._socks: List[socket.socket] = []
        for channel in range(1, udp_channels + 1):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            apply_udp_priority(sock, channel, udp_channels)
            _set_buffer(sock, socket.SO_SNDBUF, SO_SNDBUFFORCE, buffer_bytes)
            self._socks.append(sock)
        self.send_errors = 0
        self.gso = True  # switched off at the first refusal

    def send(self, channel: int, addr: Tuple[str, int], header, payload) -> bool:
        """Send one datagram; False (and counted) if the kernel refused it."""
        try:
            self._socks[channel - 1].sendmsg((header, payload), (), 0, addr)
            return True
        except OSError as exc:
            if exc.errno not in (errno.ENOBUFS, errno.EAGAIN, errno.ECONNREFUSED, errno.EMSGSIZE):
                raise
            self.send_errors += 1
            return False

    def send_rows(self, channel: int, addr: Tuple[str, int], rows: np.ndarray) -> Tuple[int, int]:
        """Send every row of ``rows`` (uint8, one datagram per row) on ``channel``.

        With UDP generic segmentation offload (Linux >= 4.18) one call hands the kernel up to
        :data:`GSO_MAX_SEGMENTS` rows, which it cuts into datagrams; elsewhere, row by row.
        Returns (sent, refused)."""
        count, row_bytes = rows.shape
        view = memoryview(np.ascontiguousarray(rows)).cast("B")
        sock = self._socks[channel - 1]
        per_call = max(1, min(GSO_MAX_SEGMENTS, GSO_MAX_BYTES // row_bytes)) if self.gso else 1
        ancillary = [(SOL_UDP, UDP_SEGMENT, struct.pack("=H", row_bytes))]
        sent = refused = 0
        for first in range(0, count, per_call):
            last = min(count, first + per_call)
            chunk = view[first * row_bytes:last * row_bytes]
            try:
                if last - first > 1:
                    sock.sendmsg((chunk,), ancillary, 0, addr)
                else:
                    sock.sendmsg((chunk,), (), 0, addr)
                sent += last - first
            except OSError as exc:
                # EMSGSIZE: a segment does not fit the route's MTU, and segmentation never
                # fragments; one datagram at a time, the IP layer may.
                if last - first > 1 and exc.errno in (errno.EINVAL, errno.EIO, errno.ENOPROTOOPT,
                                                      errno.EOPNOTSUPP, errno.EMSGSIZE):
                    logger.info("UDP GSO unavailable for %d-byte datagrams (%s); sending them "
                                "one by one", row_bytes, exc)
                    self.gso = False
                    more_sent, more_refused = self.send_rows(
                        channel, addr, rows[first:])
                    return sent + more_sent, refused + more_refused
                if exc.errno not in (errno.ENOBUFS, errno.EAGAIN, errno.ECONNREFUSED):
                    raise
                refused += last - first
        self.send_errors += refused
        return sent, refused

    def close(self) -> None:
        for sock in self._socks:
            sock.close()
        self._socks = []


class UdpReceiver:
    """A non-blocking UDP socket bound to ``(host, port)`` with a large receive buffer.

    :meth:`receive_batch` reads the datagrams waiting into the rows of a preallocated array,
    so that the caller can decode and merge them all at once.
    """

    def __init__(self, host: str, port: int, buffer_bytes: int, row_bytes: int = 2048,
                 batch_rows: int = 4096):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        got = _set_buffer(self.sock, socket.SO_RCVBUF, SO_RCVBUFFORCE, buffer_bytes)
        if got < buffer_bytes:
            logger.info("UDP receive buffer is %d bytes (asked %d): raise net.core.rmem_max "
                        "to lose fewer datagrams under bursts", got, buffer_bytes)
        self.sock.bind((host, port))
        self.sock.setblocking(False)
        self.rows = np.zeros((batch_rows, row_bytes), dtype=np.uint8)
        self.sizes = np.zeros(batch_rows, dtype=np.int64)
        self._row_views = [memoryview(row) for row in self.rows]
        self.oversized = 0
        self._recvmmsg = _RECVMMSG
        if self._recvmmsg is not None:  # one iovec per row, one message header per iovec
            self._iovecs = np.zeros(batch_rows, dtype=_IOVEC)
            self._iovecs["base"] = self.rows.ctypes.data + np.arange(batch_rows) * row_bytes
            self._iovecs["len"] = row_bytes
            self._messages = np.zeros(batch_rows, dtype=_MMSGHDR)
            self._messages["iov"] = (self._iovecs.ctypes.data
                                     + np.arange(batch_rows) * _IOVEC.itemsize)
            self._messages["iovlen"] = 1

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive_batch(self) -> int:
        """Read up to ``len(self.rows)`` waiting datagrams; returns how many.  Datagram i is
        ``self.rows[i, :self.sizes[i]]``; one longer than a row is counted and skipped."""
        if self._recvmmsg is None:
            return self._receive_one_by_one()
        while True:
            # MSG_TRUNC: each length is the datagram's real one, even when it was cut.
            count = self._recvmmsg(self.sock.fileno(), self._messages.ctypes.data,
                                   len(self._messages), MSG_DONTWAIT | socket.MSG_TRUNC, None)
            if count >= 0:
                break
            code = ctypes.get_errno()
            if code in (errno.EAGAIN, errno.EWOULDBLOCK):
                return 0
            if code != errno.EINTR:  # a signal: try again at once; anything else is a fault
                raise OSError(code, f"recvmmsg: {errno.errorcode.get(code, code)}")
        lengths = self._messages["len"][:count].astype(np.int64)
        fits = lengths <= self.rows.shape[1]
        if not fits.all():  # rare: a foreign sender's oversized datagram, dropped and counted
            self.oversized += int(count - fits.sum())
            kept = np.flatnonzero(fits)
            self.rows[:len(kept)] = self.rows[kept]
            lengths, count = lengths[kept], len(kept)
        self.sizes[:count] = lengths
        return count

    def _receive_one_by_one(self) -> int:
        recv_into = self.sock.recv_into
        sizes = self.sizes
        row_bytes = self.rows.shape[1]
        count = 0
        for view in self._row_views:
            try:
                # MSG_TRUNC: Linux returns the real datagram length even when it was cut.
                nbytes = recv_into(view, row_bytes, socket.MSG_TRUNC)
            except (BlockingIOError, InterruptedError):
                break
            if nbytes > row_bytes:
                self.oversized += 1
                continue
            sizes[count] = nbytes
            if view is not self._row_views[count]:
                self._row_views[count][:nbytes] = view[:nbytes]
            count += 1
        return count

    def close(self) -> None:
        self.sock.close()
