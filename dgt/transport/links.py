"""A worker's reliable links to the servers: one ZeroMQ DEALER per server, one I/O thread.

ZeroMQ sockets are not thread-safe, so the I/O thread owns them all.  Any thread may
:meth:`ServerLinks.send`: frames go through a queue and a pipe wakes the thread up (MXNet runs
pushes on its own operator threads, often a new one per operator, so nothing may be kept per
sending thread).  The thread keeps them in a :class:`~dgt.transport.outbox.PriorityOutbox` and
gives each socket only :data:`SOCKET_QUEUE_MESSAGES` at a time, so that an urgent message
passes the queued ones.  Arrays in frames travel without a copy and must stay unchanged until
the server has answered.  The thread hands every received message to ``on_message(server,
frames)``, calls ``on_tick(now)`` about once a second, and reports a crash to ``on_error``.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Callable, List, Tuple

import zmq
# Zero-copy sends hand their buffers to pyzmq's garbage collector, which refuses work once its
# atexit handler has run.  Imported here, before any dgt atexit handler is registered, its
# handler runs after them (atexit runs the last registered first), so a kvstore that closes
# at exit (after a crash in the training script, say) can still send what it owes.
import zmq.utils.garbage  # noqa: F401

from .outbox import PriorityOutbox
from .priority import apply_zmq_priority

__all__ = ["ServerLinks", "SOCKET_QUEUE_MESSAGES", "CLOSE_DRAIN_S",
           "POLLIN", "POLLOUT", "send_frames_nowait"]

logger = logging.getLogger(__name__)

_STOP = -1
# Messages a socket holds beyond the one it is writing (its SNDHWM).  A push part is about
# 4 MB (DGT_PART_ELEMS), so an urgent message waits for at most about three of them plus the
# kernel's send buffer: tens of milliseconds at 1 Gbit/s, instead of the whole queue.
SOCKET_QUEUE_MESSAGES = 2
CLOSE_DRAIN_S = 2.0  # how long close() still hands queued messages (BYE last) to the sockets

# Plain ints: pyzmq's send_multipart ORs its enum flags (and checks every frame's buffer)
# once per frame, which cost a server more than a reply's ZeroMQ calls themselves; the poll
# flags are combined on every turn of a poll loop, where an enum operation costs a microsecond.
_NOBLOCK = int(zmq.NOBLOCK)
POLLIN, POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)


def send_frames_nowait(sock: zmq.Socket, frames: list) -> None:
    """``sock.send_multipart(frames, zmq.NOBLOCK, copy=False)`` for frames that are buffers
    (bytes, numpy arrays, zmq.Frame): raises zmq.Again when the socket takes nothing; ZeroMQ
    queues a multipart message whole or not at all."""
    send = sock.send
    for frame in frames[:-1]:
        send(frame, _NOBLOCK_MORE, copy=False)
    send(frames[-1], _NOBLOCK, copy=False)


class ServerLinks:
    def __init__(self, context: zmq.Context, addrs: List[Tuple[str, int]], udp_channels: int,
                 on_message: Callable, on_tick: Callable, on_error: Callable,
                 by_priority: bool = True):
        self._on_message, self._on_tick, self._on_error = on_message, on_tick, on_error
        self._inbox: "queue.SimpleQueue" = queue.SimpleQueue()  # from any thread
        self._outbox = PriorityOutbox(by_priority)  # the I/O thread's
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._dealers = []
        for host, port in addrs:
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 2000)
            apply_zmq_priority(dealer, udp_channels)
            dealer.setsockopt(zmq.SNDHWM, SOCKET_QUEUE_MESSAGES)
            dealer.setsockopt(zmq.RCVHWM, 0)
            dealer.connect(f"tcp://{host}:{port}")
            self._dealers.append(dealer)
        self._thread = threading.Thread(target=self._loop, name="dgt-worker-io", daemon=True)
        self._thread.start()

    def send(self, server: int, frames: list, priority: int = 0) -> None:
        """Queue ``frames`` (a multipart message) for server ``server``; thread-safe.  Higher
        ``priority`` leaves sooner; equal priorities keep their order."""
        self._inbox.put((server, priority, frames))
        try:
            os.write(self._wake_write, b"\0")
        except BlockingIOError:  # the pipe is full of wake-ups already
            pass

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        self.send(_STOP, [])
        self._thread.join(timeout=timeout_s)
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _try_send(self, dealer: zmq.Socket, frames: list) -> bool:
        try:
            send_frames_nowait(dealer, frames)
            return True
        except zmq.Again:  # SNDHWM reached: the message stays first in line
            return False

    def _hand_over(self) -> None:
        """Move what other threads queued into the outbox, then fill every socket."""
        while True:
            try:
                target, priority, frames = self._inbox.get_nowait()
            except queue.Empty:
                break
            if target == _STOP:
                self._stop_by = time.monotonic() + CLOSE_DRAIN_S
            else:
                self._outbox.put(target, priority, frames)
        for index in self._outbox.destinations():
            dealer = self._dealers[index]
            self._outbox.flush(index, lambda frames: self._try_send(dealer, frames))

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_read, zmq.POLLIN)
        for dealer in self._dealers:
            poller.register(dealer, zmq.POLLIN)
        self._stop_by = None
        next_tick = time.monotonic() + 1.0
        try:
            while True:
                self._hand_over()
                if self._stop_by is not None and (not len(self._outbox)
                                                  or time.monotonic() >= self._stop_by):
                    if len(self._outbox):
                        logger.warning("closing with %d message(s) unsent: a server is not "
                                       "reading", len(self._outbox))
                    break
                waiting = set(self._outbox.destinations())
                for index, dealer in enumerate(self._dealers):
                    poller.modify(dealer, POLLIN | (POLLOUT if index in waiting else 0))
                events = dict(poller.poll(200 if self._stop_by is None else 20))
                if self._wake_read in events:
                    try:
                        os.read(self._wake_read, 65536)
                    except BlockingIOError:
                        pass
                for index, dealer in enumerate(self._dealers):
                    if events.get(dealer, 0) & POLLIN:
                        while True:
                            try:
                                frames = dealer.recv_multipart(zmq.NOBLOCK, copy=False)
                            except zmq.Again:
                                break
                            self._on_message(index, frames)
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + 1.0
                    self._on_tick(time.time())
        except Exception as exc:  # noqa: BLE001 - handed to the owner, who fails its waiters
            logger.exception("dgt worker I/O thread failed")
            self._on_error(exc)
        finally:
            for dealer in self._dealers:
                dealer.close()
