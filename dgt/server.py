"""The dgt parameter server: ``python -m dgt.server`` (configured by environment, see README).

One thread, one event loop over the reliable ZeroMQ ROUTER socket and the UDP socket; every
decision about steps is taken by :class:`dgt.merge.StepMerger`.  The server imports mxnet only
when a worker asks it to run the optimizer (``set_optimizer``).

Every malformed, foreign or stale datagram is counted and dropped; a malformed reliable message
gets an ERROR reply and changes nothing.  The server leaves when every worker said BYE, on
SIGTERM/SIGINT, or -- with an error -- when steps are open and nothing at all arrived for
``DGT_TIMEOUT_S`` (a worker died).
"""
from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import zmq

from .config import Config
from .errors import ConfigError, DGTError, RemoteProtocolError
from .fusion import FUSED_KEY_BASE
from .kernels import warm_up
from .merge import ClosedStep, StepMerger, merge_datagram_batch
from .partition import BlockLayout
from .trace import open_tracer
from .transport.links import (CLOSE_DRAIN_S, POLLIN, POLLOUT, SOCKET_QUEUE_MESSAGES,
                               send_frames_nowait)
from .transport.outbox import PriorityOutbox
from .transport.priority import apply_zmq_priority
from .transport.udp import UdpReceiver
from .weights import HeldWeights
from .wire import (FLAG_ALL_RELIABLE, FLAG_DELTA, FLAG_FEEDBACK, FLAG_SCORES, FLAG_SPARSE,
                   FLAG_WEIGHTS, HEADER_BYTES, NO_RANK, PRIORITY_CONTROL, PRIORITY_LAST, Header,
                   MsgType, code_dtype, decode_blocks, decode_header, decode_scores, dtype_code,
                   encode_header, split_dense, sum_reply_frames)

__all__ = ["Server", "main"]

logger = logging.getLogger(__name__)

# The exit line that reports Server.own_cpu_s; own_cpu_from_log reads it back.
OWN_CPU_LOG = "server %d: dgt's own CPU %.6f s (decode, merge, close, frame the replies)"
_OWN_CPU_PATTERN = re.compile(r"server (\d+): dgt's own CPU ([0-9.]+) s")


def own_cpu_from_log(text: str) -> Dict[int, float]:
    """Server index -> dgt's own CPU seconds, from the exit lines of servers' logs."""
    return {int(index): float(seconds) for index, seconds in _OWN_CPU_PATTERN.findall(text)}

_UDP_BATCHES_PER_TURN = 16  # batches of datagrams read per loop turn, so a flood cannot starve TCP


class _Optimizer:
    """The MXNet optimizer a worker sent, applied as ``dist_sync``'s server does.

    One updater per part index: the parts of a sliced tensor keep separate states (momentum)
    while every part is updated under the key's own index, which the optimizer maps to the
    parameter's name for its per-parameter learning-rate and weight-decay multipliers.
    Weights are NDArrays sharing memory with the numpy arrays the server replies with, and
    gradients are wrapped the same way, so an update copies no tensor in Python.
    """

    def __init__(self, blob: bytes):
        mx = _import_mxnet()
        self._mx = mx
        self._blob = blob
        self._updaters: Dict[int, object] = {}

    def _updater(self, part: int):
        updater = self._updaters.get(part)
        if updater is None:
            import pickle

            # trusted: comes from a job member over TCP, as in MXNet's dist_sync
            updater = self._mx.optimizer.get_updater(pickle.loads(self._blob))
            self._updaters[part] = updater
        return updater

    def wrap(self, value: np.ndarray):
        return self._mx.nd.from_numpy(value, zero_copy=True)

    def get_states(self, dump_optimizer: bool) -> bytes:
        import pickle

        return pickle.dumps({part: updater.get_states(dump_optimizer=dump_optimizer)
                             for part, updater in self._updaters.items()})

    def set_states(self, blob: bytes) -> None:
        import pickle

        for part, states in pickle.loads(blob).items():  # trusted: the job's own saved file
            self._updater(part).set_states(states)

    def update(self, keys, part: int, weights, grads) -> None:
        """Update the weights of ``keys`` in one call: MXNet's updater runs several keys as
        multi-tensor operators (MXNET_OPTIMIZER_AGGREGATION_SIZE per call), the same
        arithmetic per key as one by one."""
        weights = list(weights)
        self._updater(part)(list(keys), [self.wrap(np.ascontiguousarray(g)) for g in grads],
                            weights)
        for weight in weights:
            weight.wait_to_read()


@dataclass(frozen=True)
class _Bucket:
    """A fused key: member ``keys[i]`` is ``[offsets[i], offsets[i+1])`` of it."""

    keys: Tuple[int, ...]
    offsets: Tuple[int, ...]
    dtype: int

    def spans(self):
        return zip(self.keys, self.offsets[:-1], self.offsets[1:])


def _import_mxnet():
    # MXNet starts its own ps-lite server at import when DMLC_ROLE=server: hide it.
    saved = os.environ.pop("DMLC_ROLE", None)
    try:
        import mxnet
    finally:
        if saved is not None:
            os.environ["DMLC_ROLE"] = saved
    return mxnet


class Server:
    """A dgt server bound to ``config.server_addr_list()[config.server_index]``.

    Port 0 binds a free port (tests); :attr:`port` tells which.
    """

    def __init__(self, config: Config, context: Optional[zmq.Context] = None):
        self.config = config
        addrs = config.server_addr_list()
        port = addrs[config.server_index][1] if addrs else 0
        warm_up()  # before any push: compiling a kernel is not a step's cost (own_cpu_s)
        self._ctx = context or zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 1000)
        # Replies wait in self._outbox, most urgent first; a worker's socket holds only a few.
        # MANDATORY: a full socket says so (EAGAIN) instead of dropping the message.
        self._router.setsockopt(zmq.SNDHWM, SOCKET_QUEUE_MESSAGES)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.RCVHWM, 0)
        self._outbox = PriorityOutbox(config.priority_order)
        self._outbox_stalled = False  # the last hand-over moved nothing
        self._push_priority: Dict[Tuple[int, int], int] = {}  # (key, part) -> its replies'
        apply_zmq_priority(self._router, config.udp_channels)
        self._udp, self.port = self._bind(config.bind_host, port)
        self.merger = StepMerger(config.num_workers, config.receive_mode,
                                 config.grace_ms / 1000.0, config.error_feedback)
        self.counters: Counter = Counter()
        # dgt's own CPU seconds (thread CPU): decoding pushes, merging both streams, closing
        # steps and framing replies.  The optimizer and the socket reads are left out: every
        # parameter server has them.  Logged at exit (OWN_CPU_LOG) for the benchmarks.
        self.own_cpu_s = 0.0
        self._identity: Dict[int, bytes] = {}
        self._rank_of: Dict[bytes, int] = {}
        self._next_rank = 0
        self._byes: set = set()
        self._values: Dict[Tuple[int, int], np.ndarray] = {}
        self._weights: Dict[Tuple[int, int], object] = {}  # NDArrays over self._values
        self._init_gen: Dict[Tuple[int, int], int] = {}
        self._init_requests: Dict[Tuple[int, int], List[Tuple[int, int, int]]] = {}
        self._init_seen: Counter = Counter()
        self._barrier: Dict[int, int] = {}
        self._optimizer: Optional[_Optimizer] = None
        self._held = HeldWeights(config.weights_reply == "delta")
        self._buckets: Dict[int, _Bucket] = {}
        self._stop = threading.Event()
        self._last_activity = time.monotonic()
        self._trace = open_tracer(config.trace, "server", config.server_index)

    def _bind(self, host: str, port: int):
        """Bind TCP and UDP on the same port number (a free one when ``port`` is 0)."""
        for _ in range(50):
            udp = UdpReceiver(host, port, self.config.udp_buffer_bytes,
                              row_bytes=HEADER_BYTES + self.config.udp_payload_bytes)
            chosen = udp.sock.getsockname()[1]
            try:
                self._router.bind(f"tcp://{host}:{chosen}")
                return udp, chosen
            except zmq.ZMQError as exc:
                udp.close()
                if port:
                    raise ConfigError(f"server cannot listen on {host}:{port} "
                                      f"(DGT_SERVER_ADDRS): {exc}") from None
        raise ConfigError("no free port with both TCP and UDP available")

    def stop(self) -> None:
        self._stop.set()

    # == event loop ===========================================================================
    def run(self) -> int:
        """Serve until every worker left (0), a stop request (0) or a dead job (1)."""
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._udp.fileno(), zmq.POLLIN)
        logger.info("server %d listening on %s:%d (tcp+udp) for %d worker(s)",
                    self.config.server_index, self.config.bind_host, self.port,
                    self.config.num_workers)
        code = 0
        try:
            while not self._stop.is_set():
                deadline = self.merger.next_deadline()
                wait_ms = 500
                if deadline is not None:
                    wait_ms = max(0, min(wait_ms, int((deadline - time.monotonic()) * 1000) + 1))
                # A ROUTER is writable when any worker's socket is: while one that is full
                # holds replies back, poll it every millisecond instead of spinning.
                backlog = len(self._outbox) > 0
                poller.modify(self._router, POLLIN | (
                    POLLOUT if backlog and not self._outbox_stalled else 0))
                if backlog and self._outbox_stalled:
                    wait_ms = min(wait_ms, 1)
                events = dict(poller.poll(wait_ms))
                if events:
                    self._last_activity = time.monotonic()
                if events.get(self._router, 0) & POLLIN:
                    self._drain_tcp()
                # Read every datagram already queued before judging deadlines: what the kernel
                # holds arrived in time, however slow this loop was to get to it.
                self._drain_udp()
                self._close_steps()
                self._flush_outbox()
                if self._everyone_left():
                    logger.info("every worker left; server %d stops", self.config.server_index)
                    break
                if self._job_stalled():
                    code = 1
                    break
        finally:
            self._drain_outbox(time.monotonic() + CLOSE_DRAIN_S)
            self._log_counters()
            self._router.close()
            self._udp.close()
            self._trace.close()
        return code

    def _everyone_left(self) -> bool:
        return len(self._byes) >= self.config.num_workers

    def _job_stalled(self) -> bool:
        """True (after logging why) when nothing arrived for DGT_TIMEOUT_S although the job
        is not over: no worker ever came, or a connected worker went silent."""
        idle = time.monotonic() - self._last_activity
        if idle < self.config.timeout_s or len(self._byes) >= len(self._rank_of) > 0:
            return False
        if not self._rank_of:
            logger.error("server %d: no worker connected within %.0f s (DGT_TIMEOUT_S). "
                         "Stopping.", self.config.server_index, idle)
            return True
        logger.error("server %d: no message from any worker for %.0f s while workers are "
                     "connected (DGT_TIMEOUT_S); a worker probably died. Stopping.",
                     self.config.server_index, idle)
        for rank in self._identity:
            if rank not in self._byes:
                self._send(rank, Header(MsgType.BYE, job=self.config.job_id, rank=rank),
                           priority=PRIORITY_LAST)
        return True

    def _log_counters(self) -> None:
        counts = dict(self.counters)
        counts.update({f"udp_{k}": v for k, v in self.merger.counters.items()})
        logger.info("server %d counters: %s", self.config.server_index, counts)
        logger.info(OWN_CPU_LOG, self.config.server_index, self.own_cpu_s)

    # == UDP ==================================================================================
    def _drain_udp(self) -> None:
        """Read every waiting datagram (bounded per turn) and merge them batch by batch."""
        udp = self._udp
        for _ in range(_UDP_BATCHES_PER_TURN):
            count = udp.receive_batch()
            if count:
                self.counters["udp_batches"] += 1  # datagrams per batch: udp_merged / this
                began = time.thread_time()
                self._merge_batch(count)
                self.own_cpu_s += time.thread_time() - began
            if count < len(udp.rows):
                return

    def _merge_batch(self, count: int) -> None:
        known = np.zeros(self.config.num_workers, dtype=bool)
        known[list(self._identity)] = True
        refused = merge_datagram_batch(self.merger, self._udp.rows[:count],
                                       self._udp.sizes[:count], self.config.job_id, known)
        for reason, refused_count in refused.items():
            self.counters[f"udp_{reason}"] += refused_count

    # == TCP ==================================================================================
    def _drain_tcp(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity, frames = frames[0].bytes, frames[1:]
            try:
                header = decode_header(frames[0].buffer)
            except (RemoteProtocolError, IndexError) as exc:
                self.counters["tcp_malformed"] += 1
                logger.warning("dropped a malformed reliable message: %s", exc)
                continue
            if header.job != self.config.job_id:
                self.counters["tcp_foreign"] += 1
                logger.warning("dropped a message of job %d (this job is %d)", header.job,
                               self.config.job_id)
                continue
            try:
                self._dispatch(identity, header, frames)
            except RemoteProtocolError as exc:
                self.counters["tcp_refused"] += 1
                logger.warning("refused %s: %s", header.debug_str(), exc)
                self._outbox.put(identity, PRIORITY_CONTROL, [identity, encode_header(
                    header._replace(type=MsgType.ERROR)), str(exc).encode()])

    def _dispatch(self, identity: bytes, header: Header, frames) -> None:
        mtype = header.type
        if mtype is MsgType.HELLO:
            self._on_hello(identity, header)
            return
        rank = self._rank_of.get(identity)
        if rank is None or rank != header.rank:
            raise RemoteProtocolError(f"{mtype.name} from a peer that did not say HELLO as "
                                      f"rank {header.rank}")
        if mtype is MsgType.PUSH:
            began = time.thread_time()
            self._on_push(header, frames)
            self.own_cpu_s += time.thread_time() - began
        elif mtype is MsgType.PUSH_END:
            self.merger.add_push_end(header, time.monotonic())
            self._trace.record("end", header.key, header.part, header.step, header.rank)
        elif mtype is MsgType.INIT:
            self._on_init(header, frames)
        elif mtype is MsgType.PULL:
            key = (header.key, header.part)
            if key not in self._values:
                raise RemoteProtocolError(f"pull of key {header.key} before any init or push")
            self._send_value(header.rank, header, self._values[key], header.priority)
        elif mtype is MsgType.SET_OPTIMIZER:
            if len(frames) != 2:
                raise RemoteProtocolError("SET_OPTIMIZER needs exactly one payload frame")
            self._optimizer = _Optimizer(frames[1].bytes)
            self._weights = {key: self._optimizer.wrap(value)
                             for key, value in self._values.items()}
            self._held.clear()
            logger.info("server %d runs the optimizer from now on", self.config.server_index)
            self._send(rank, header._replace(type=MsgType.ACK))
        elif mtype in (MsgType.GET_STATES, MsgType.SET_STATES):
            if self._optimizer is None:
                raise RemoteProtocolError("no optimizer runs on this server (set_optimizer)")
            if mtype is MsgType.GET_STATES:
                blob = self._optimizer.get_states(bool(header.flags & 1))
                self._send(rank, header._replace(type=MsgType.VALUE, dtype=dtype_code(np.uint8),
                                                 n_elems=len(blob)), blob)
            else:
                if len(frames) != 2:
                    raise RemoteProtocolError("SET_STATES needs exactly one payload frame")
                self._optimizer.set_states(frames[1].bytes)
                self._send(rank, header._replace(type=MsgType.ACK))
        elif mtype is MsgType.FUSE:
            self._on_fuse(header, frames)
            self._send(rank, header._replace(type=MsgType.ACK))
        elif mtype is MsgType.BARRIER:
            self._barrier[rank] = header.step
            if len(self._barrier) == self.config.num_workers:
                for waiting, serial in self._barrier.items():
                    self._send(waiting, Header(MsgType.ACK, job=self.config.job_id,
                                               rank=waiting, step=serial))
                self._barrier = {}
        elif mtype is MsgType.BYE:
            self._byes.add(rank)
        else:
            raise RemoteProtocolError(f"unexpected {mtype.name} on the reliable channel")

    def _on_hello(self, identity: bytes, header: Header) -> None:
        rank = header.rank
        if rank == NO_RANK:
            if self.config.server_index != 0:
                raise RemoteProtocolError("only server 0 assigns ranks; say HELLO there first")
            while self._next_rank in self._identity:
                self._next_rank += 1
            rank = self._next_rank
        if rank >= self.config.num_workers:
            raise RemoteProtocolError(f"rank {rank} is out of range for "
                                      f"{self.config.num_workers} workers (DGT_NUM_WORKERS)")
        known = self._identity.get(rank)
        if known is not None and known != identity:
            raise RemoteProtocolError(f"rank {rank} is already taken by another worker")
        self._identity[rank] = identity
        self._rank_of[identity] = rank
        self._send(rank, header._replace(type=MsgType.WELCOME, rank=rank))

    def _on_push(self, header: Header, frames) -> None:
        dtype = code_dtype(header.dtype)
        if header.block_elems < 1 or header.frag_elems < 1 or header.n_elems < 1:
            raise RemoteProtocolError("PUSH with empty sizes")
        layout = BlockLayout(header.n_elems, header.block_elems)
        # An all-reliable push (no index frame) carries every block, in order.
        all_reliable = bool(header.flags & FLAG_ALL_RELIABLE)
        if not all_reliable and len(frames) < 2:
            raise RemoteProtocolError("PUSH needs an index frame")
        index_frame = np.arange(layout.n_blocks, dtype=np.uint32) if all_reliable \
            else frames[1].buffer
        first_payload = 1 if all_reliable else 2
        scores = None
        if header.flags & FLAG_SCORES:
            if all_reliable or len(frames) < 3:
                raise RemoteProtocolError("PUSH with FLAG_SCORES needs an index and a scores "
                                          "frame")
            scores = decode_scores(frames[2].buffer, layout.n_blocks)
            first_payload = 3
        payload_frames = [f.buffer for f in frames[first_payload:]]
        blocks, chunks = decode_blocks(layout, header.block, index_frame, payload_frames, dtype)
        if self._optimizer is not None and header.key not in self._buckets and \
                (header.key, header.part) not in self._weights:
            raise RemoteProtocolError(f"push of key {header.key} before its weights were "
                                      "initialised (broadcast/init) on the server")
        self._push_priority[(header.key, header.part)] = header.priority
        self.merger.add_push(header, blocks, chunks, time.monotonic(), scores)
        self._trace.record("arrive", header.key, header.part, header.step, header.rank)

    def _on_fuse(self, header: Header, frames) -> None:
        """Record that key ``header.key`` is a bucket: its members' tensors end to end."""
        if len(frames) != 2 or len(frames[1].buffer) % 16:
            raise RemoteProtocolError("FUSE needs one frame of (key, n_elems) int64 pairs")
        table = np.frombuffer(frames[1].buffer, dtype=np.int64).reshape(-1, 2)
        if header.key < FUSED_KEY_BASE or len(table) < 2 or (table[:, 0] < 0).any() or \
                (table[:, 0] >= FUSED_KEY_BASE).any() or (table[:, 1] < 1).any() or \
                int(table[:, 1].sum()) != header.n_elems:
            raise RemoteProtocolError(f"FUSE of key {header.key}: not a valid bucket")
        offsets = np.concatenate([[0], np.cumsum(table[:, 1])])
        bucket = _Bucket(tuple(table[:, 0].tolist()), tuple(offsets.tolist()), header.dtype)
        known = self._buckets.get(header.key)
        if known is not None and known != bucket:
            raise RemoteProtocolError(f"workers disagree on the members of bucket {header.key}")
        if self._optimizer is not None:
            missing = [k for k in bucket.keys if (k, 0) not in self._weights]
            if missing:
                raise RemoteProtocolError(f"bucket {header.key} holds keys without weights on "
                                          f"this server: {missing[:5]}")
        self._buckets[header.key] = bucket
        if (header.key, 0) not in self._values:  # the reply buffer of a server-side update
            self._values[(header.key, 0)] = np.empty(header.n_elems, code_dtype(header.dtype))

    def _on_init(self, header: Header, frames) -> None:
        key = (header.key, header.part)
        self._init_seen[(header.rank, key)] += 1
        generation = self._init_seen[(header.rank, key)]
        if header.rank == 0:
            dtype = code_dtype(header.dtype)
            if len(frames) < 2 or any(len(f.buffer) % dtype.itemsize for f in frames[1:]):
                raise RemoteProtocolError("INIT from rank 0 must carry the value")
            value = np.concatenate([np.frombuffer(f.buffer, dtype=dtype) for f in frames[1:]])
            if value.size != header.n_elems:
                raise RemoteProtocolError("INIT value size does not match its header")
            self._values[key] = value
            self._held.forget(key)
            if self._optimizer is not None:
                self._weights[key] = self._optimizer.wrap(value)
            self._init_gen[key] = generation
            self.merger.forget(*key)
        self._init_requests.setdefault(key, []).append((header.rank, header.step, generation))
        ready = self._init_gen.get(key, 0)
        waiting = self._init_requests[key]
        for request in [r for r in waiting if r[2] <= ready]:
            waiting.remove(request)
            self._send_value(request[0], header._replace(rank=request[0], step=request[1]),
                             self._values[key])

    def _send_value(self, rank: int, header: Header, value: np.ndarray,
                    priority: int = PRIORITY_CONTROL) -> None:
        # A copy: the stored value's buffer is recycled by later steps while this is in flight.
        array = value.astype(code_dtype(header.dtype), copy=True)
        self._send(rank, header._replace(type=MsgType.VALUE, n_elems=array.size),
                   *split_dense(array), priority=priority)

    def _send(self, rank: int, header: Header, *payload, priority: int = PRIORITY_CONTROL
              ) -> None:
        """Queue a message for worker ``rank`` (answers to control messages pass every
        queued reply) and hand the socket what it can take."""
        identity = self._identity.get(rank)
        if identity is None:
            return
        self._outbox.put(identity, priority, [identity, encode_header(header), *payload])
        self._outbox.flush(identity, self._try_send)

    def _try_send(self, frames: list) -> bool:
        try:
            send_frames_nowait(self._router, frames)
            return True
        except zmq.Again:  # the worker's socket is full: the message stays first in line
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.counters["tcp_unroutable"] += 1  # the worker is gone; nobody to tell
            return True

    def _flush_outbox(self) -> None:
        handed = 0
        for identity in self._outbox.destinations():
            handed += self._outbox.flush(identity, self._try_send)
        self._outbox_stalled = handed == 0 and len(self._outbox) > 0

    def _drain_outbox(self, deadline: float) -> None:
        """On the way out: hand over what is still queued (a BYE to each worker last),
        for at most until ``deadline``."""
        while len(self._outbox) and time.monotonic() < deadline:
            self._flush_outbox()
            if len(self._outbox):
                time.sleep(0.005)
        if len(self._outbox):
            logger.warning("server %d stops with %d message(s) unsent", self.config.server_index,
                           len(self._outbox))

    # == closing steps ========================================================================
    def _close_steps(self) -> None:
        began = time.thread_time()
        optimizer_s = 0.0
        for closed in self.merger.poll(time.monotonic()):
            optimizer_s += self._reply(closed)
        self.own_cpu_s += time.thread_time() - began - optimizer_s

    def _reply(self, closed: ClosedStep) -> float:
        """Apply the optimizer (if any) and queue the replies of a closed step; returns the
        optimizer's CPU seconds."""
        key = (closed.key, closed.part)
        self._trace.record("close", closed.key, closed.part, closed.step, -1)
        flags = 0
        bucket = self._buckets.get(closed.key)
        optimizer_s, optimizer_began = 0.0, time.thread_time()
        if self._optimizer is not None:
            payload = self._values[key]
            # The sum before any cast to a 16-bit wire dtype, in the weights' own dtype (cast
            # from the total directly: going through ``merged`` would cast twice).
            grads = closed.total.astype(payload.dtype, copy=False)
            if bucket is None:
                self._optimizer.update([closed.key], closed.part, [self._weights[key]],
                                       [grads])
            else:  # each member under its own key: its own states and lr/wd multipliers
                spans = list(bucket.spans())
                self._optimizer.update(
                    bucket.keys, 0, [self._weights[(member, 0)] for member in bucket.keys],
                    [grads[lo:hi] for _, lo, hi in spans])
                for member, lo, hi in spans:
                    payload[lo:hi] = self._values[(member, 0)]
            flags |= FLAG_WEIGHTS
            optimizer_s = time.thread_time() - optimizer_began
            payload, is_delta = self._held.reply(key, payload, closed.wire_dtype)
            if is_delta:
                flags |= FLAG_DELTA
        else:
            self._values[key] = closed.merged
            payload = closed.merged
            if bucket is not None:  # so that a member can be pulled on its own
                for member, lo, hi in bucket.spans():
                    self._values[(member, 0)] = closed.merged[lo:hi]
        if closed.missing is not None:
            flags |= FLAG_FEEDBACK
        grace_us = int(closed.grace_s * 1e6)
        if flags & FLAG_WEIGHTS:  # weights are dense whatever the gradients touched
            index_frames, n_blocks, chunks = [], 0, split_dense(payload)
        else:
            index_frames, n_blocks, chunks = sum_reply_frames(payload, closed.touched_blocks,
                                                              closed.block_elems)
        if index_frames:
            flags |= FLAG_SPARSE
            self.counters["replies_sparse"] += 1
        score_frames = []
        if closed.scores is not None:
            flags |= FLAG_SCORES
            score_frames = [closed.scores]
        self.counters["reply_bytes"] += sum(c.nbytes for c in chunks) * self.config.num_workers
        priority = self._push_priority.get(key, 0)
        self._trace.record("reply", closed.key, closed.part, closed.step, -1)
        for rank in range(self.config.num_workers):
            header = Header(MsgType.REPLY, job=self.config.job_id, rank=rank,
                            dtype=dtype_code(payload.dtype), key=closed.key,
                            part=closed.part, flags=flags, step=closed.step,
                            n_elems=payload.size, block_elems=closed.block_elems,
                            block=n_blocks, udp_expected=int(closed.udp_expected[rank]),
                            udp_merged=int(closed.udp_merged[rank]),
                            udp_late=int(closed.udp_late[rank]), grace_us=min(grace_us, 2**32 - 1),
                            priority=priority)
            bitmap = np.packbits(closed.missing[rank]) if closed.missing is not None else b""
            self._send(rank, header, bitmap, *score_frames, *index_frames, *chunks,
                       priority=priority)
        self.counters["steps_closed"] += 1
        if logger.isEnabledFor(logging.DEBUG):
            now = time.monotonic()
            logger.debug("key %d.%d step %d: pushes over %.1f ms, closed %.1f ms after the last "
                         "end marker, replied after %.1f ms", closed.key, closed.part, closed.step,
                         (closed.last_push_time - closed.first_push_time) * 1000,
                         closed.grace_s * 1000, (now - closed.last_push_time) * 1000)
        return optimizer_s


def main(argv=None) -> int:
    """Entry point of ``python -m dgt.server``."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = Config.from_env(role="server")
        logging.getLogger().setLevel(config.log_level)
        server = Server(config)
    except DGTError as exc:
        logger.error("%s", exc)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    return server.run()


if __name__ == "__main__":
    sys.exit(main())
