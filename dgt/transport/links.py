"""A worker's reliable links to the servers: one ZeroMQ DEALER per server, one I/O thread.

ZeroMQ sockets are not thread-safe, so the I/O thread owns them all.  Any thread may
:meth:`ServerLinks.send`: frames go through a queue and a pipe wakes the thread up (MXNet runs
pushes on its own operator threads, often a new one per operator, so nothing may be kept per
sending thread).  Arrays in frames travel without a copy and must stay unchanged until the
server has answered.  The thread hands every received message to ``on_message(server,
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

from .priority import apply_zmq_priority

__all__ = ["ServerLinks"]

logger = logging.getLogger(__name__)

_STOP = -1


class ServerLinks:
    def __init__(self, context: zmq.Context, addrs: List[Tuple[str, int]], udp_channels: int,
                 on_message: Callable, on_tick: Callable, on_error: Callable):
        self._on_message, self._on_tick, self._on_error = on_message, on_tick, on_error
        self._outbox: "queue.SimpleQueue" = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._dealers = []
        for host, port in addrs:
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 2000)
            apply_zmq_priority(dealer, udp_channels)
            dealer.setsockopt(zmq.SNDHWM, 0)
            dealer.setsockopt(zmq.RCVHWM, 0)
            dealer.connect(f"tcp://{host}:{port}")
            self._dealers.append(dealer)
        self._thread = threading.Thread(target=self._loop, name="dgt-worker-io", daemon=True)
        self._thread.start()

    def send(self, server: int, frames: list) -> None:
        """Queue ``frames`` (a multipart message) for server ``server``; thread-safe."""
        self._outbox.put((server, frames))
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

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_read, zmq.POLLIN)
        for dealer in self._dealers:
            poller.register(dealer, zmq.POLLIN)
        stopping = False
        next_tick = time.monotonic() + 1.0
        try:
            while not stopping:
                events = dict(poller.poll(200))
                if self._wake_read in events:
                    try:
                        os.read(self._wake_read, 65536)
                    except BlockingIOError:
                        pass
                while not stopping:
                    try:
                        target, frames = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    if target == _STOP:
                        stopping = True
                    else:
                        self._dealers[target].send_multipart(frames, copy=False)
                for index, dealer in enumerate(self._dealers):
                    if dealer in events:
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
