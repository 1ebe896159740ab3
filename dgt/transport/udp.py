"""UDP channels: one sending socket per channel (own TOS/priority), one receiving socket.

Datagrams are written with ``sendmsg`` from two buffers (header, payload view), so gradient
bytes are never copied in Python.  A full socket buffer blocks the sender briefly, which paces
it to what the kernel can take; it never raises into the caller for a transient condition.
"""
from __future__ import annotations

import errno
import logging
import socket
from typing import Iterator, List, Tuple

from .priority import apply_udp_priority

__all__ = ["UdpSender", "UdpReceiver"]

logger = logging.getLogger(__name__)

SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)


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

    def close(self) -> None:
        for sock in self._socks:
            sock.close()
        self._socks = []


class UdpReceiver:
    """A non-blocking UDP socket bound to ``(host, port)`` with a large receive buffer."""

    MAX_DATAGRAM = 65536

    def __init__(self, host: str, port: int, buffer_bytes: int):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        got = _set_buffer(self.sock, socket.SO_RCVBUF, SO_RCVBUFFORCE, buffer_bytes)
        if got < buffer_bytes:
            logger.info("UDP receive buffer is %d bytes (asked %d): raise net.core.rmem_max "
                        "to lose fewer datagrams under bursts", got, buffer_bytes)
        self.sock.bind((host, port))
        self.sock.setblocking(False)
        self._buf = bytearray(self.MAX_DATAGRAM)

    def fileno(self) -> int:
        return self.sock.fileno()

    def drain(self, limit: int) -> Iterator[memoryview]:
        """Yield up to ``limit`` datagrams waiting now.  Each view is valid only until the
        next one is read."""
        view = memoryview(self._buf)
        recv_into = self.sock.recv_into
        for _ in range(limit):
            try:
                nbytes = recv_into(self._buf)
            except (BlockingIOError, InterruptedError):
                return
            yield view[:nbytes]

    def close(self) -> None:
        self.sock.close()
