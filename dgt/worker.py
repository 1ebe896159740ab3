"""The worker side: turn one ``pushpull(key, gradient)`` into a reliable part and datagrams.

Flow of one push, per server part (each step a plain function of :mod:`dgt.partition`,
:mod:`dgt.scoring`, :mod:`dgt.policy`, :mod:`dgt.memory`)::

    compensate (error feedback) -> score blocks -> assign channels
      -> reliable PUSH (TCP, first) -> UDP datagrams (channel 1 first) -> await REPLY

Calls return a :class:`Pending` at once; the network work of different keys overlaps.
:class:`dgt.transport.links.ServerLinks` moves the reliable messages on its own I/O thread, and
this module resolves pending results as replies arrive.  Every wait is bounded by
``Config.timeout_s``.
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Tuple

import numpy as np
import zmq

from .config import Config
from .errors import LocalProtocolError, PeerLost, RemoteProtocolError, StepTimeout
from .kernels import add_bfloat16_, cast, warm_up
from .lossmodel import dropped_slots
from .memory import ResidualMemory
from .partition import BlockLayout, FragmentLayout, Part, fragment_elems, plan_parts
from .pending import Pending
from .policy import AdaptiveThreshold, assign_channels
from .scoring import ContributionState, score_blocks
from .stats import JsonLinesSink, StepStats
from .trace import NO_TRACE, open_tracer
from .transport.links import ServerLinks
from .transport.udp import UdpSender
from .wire import (FLAG_ALL_RELIABLE, FLAG_DELTA, FLAG_FEEDBACK, FLAG_SCORES, FLAG_SPARSE,
                   FLAG_WEIGHTS, FLOAT_CODES, HEADER_BYTES, NO_RANK, PRIORITY_CONTROL,
                   PRIORITY_LAST, Header, MsgType, BFLOAT16, clamp_priority, code_dtype,
                   decode_blocks, decode_header, decode_scores, dtype_code, encode_header,
                   split_blocks, split_dense, frame_datagrams)

__all__ = ["Worker", "Pending", "report_loss"]

logger = logging.getLogger(__name__)

_ACTIVE: "weakref.WeakSet[Worker]" = weakref.WeakSet()


def report_loss(value: float) -> None:
    """Feed the training loss to the adaptive threshold of every worker in this process.

    Optional: without it, dgt adapts k to the gradient norm it sees by itself.
    """
    for worker in list(_ACTIVE):
        worker.report_loss(value)


@dataclass
class _Inflight:
    pending: Pending
    part: Part
    started: float
    compensated: Optional[np.ndarray] = None  # what was pushed, kept for error feedback
    layout: Optional[FragmentLayout] = None
    ident: Tuple[int, int] = (0, 0)
    stats: Optional[StepStats] = None
    blob: bytes = b""


@dataclass
class _Scratch:
    compensated: np.ndarray
    gathered: np.ndarray  # in the wire dtype: the reliable blocks, or the whole part cast


@dataclass
class _KeyPlan:
    n_elems: int
    dtype: np.dtype
    parts: List[Part]
    steps: List[int] = field(default_factory=list)  # next step number per part
    last: Optional[Pending] = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # see _pushpull
    result: Optional[np.ndarray] = None  # reply buffer, reused every step
    # With a server-side optimizer ``result`` also holds the weights the next delta reply
    # (wire.FLAG_DELTA) applies to: part index -> the step of the reply it holds.
    held_steps: Dict[int, int] = field(default_factory=dict)


class Worker:
    """One training process's connection to the dgt servers.

    Parameters
    ----------
    config : Config
        Needs ``server_addrs``; ``rank`` -1 lets server 0 assign one.
    """

    def __init__(self, config: Config, context: Optional[zmq.Context] = None):
        self.config = config
        addrs = config.server_addr_list()
        if not addrs:
            raise LocalProtocolError(
                "no server address: set DGT_SERVER_ADDRS (dgt-launch does) or "
                "DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT")
        if any(port == 0 for _, port in addrs):
            raise LocalProtocolError(f"DGT_SERVER_ADDRS={config.server_addrs!r}: a worker needs "
                                     "the servers' real ports, not 0")
        self._addrs = addrs
        warm_up()  # before any step: compiling a kernel is no step's cost
        self._ctx = context or zmq.Context.instance()
        self._inflight: Dict[tuple, _Inflight] = {}
        self._inflight_lock = threading.Lock()
        self._fatal: Optional[BaseException] = None
        self._serial = itertools.count(1)
        self._keys: Dict[int, _KeyPlan] = {}
        self._scores = ContributionState(config.score_alpha)
        self._shared_scores: Dict[tuple, np.ndarray] = {}  # (key, part) -> the last reply's sum
        self._scratches: Dict[tuple, _Scratch] = {}
        self._memory = ResidualMemory()
        # Error feedback across fusion (a bucket and its members owe in separate ledgers):
        # bucket key -> (member key, offset, n_elems), and member key -> bucket key.
        self._bucket_members: Dict[int, List[Tuple[int, int, int]]] = {}
        self._bucket_of: Dict[int, int] = {}
        self._ledger_lock = threading.Lock()
        self._threshold = AdaptiveThreshold(config.threshold, config.threshold_min,
                                            config.adaptive_smoothing, config.adaptive)
        self._loss_reported = False
        self._grad_sq = 0.0
        self._round_key: Optional[int] = None
        self._round = -1
        self._stats: Optional[StepStats] = None
        self._sealed: Deque[StepStats] = deque()  # begun steps still counting, oldest first
        self.last_stats: Optional[StepStats] = None  # the last finished step
        self.totals = {"steps": 0, "bytes_per_channel": [0] * (config.udp_channels + 1),
                       "udp_expected": 0, "udp_merged": 0, "udp_lost": 0, "udp_late": 0,
                       "feedback_elems": 0, "cpu_ms": 0.0}
        self._stats_lock = threading.Lock()
        self._round_lock = threading.RLock()
        self._plan_lock = threading.Lock()
        self._sink: Optional[JsonLinesSink] = None
        self._trace = NO_TRACE
        self._udp = UdpSender(config.udp_channels, config.udp_buffer_bytes)
        self._closed = False
        self.rank = config.rank
        self.num_workers = config.num_workers

        self._links = ServerLinks(self._ctx, addrs, config.udp_channels, self._on_message,
                                  self._expire, self._fail_all, config.priority_order)
        self._hello()
        if config.stats:
            self._sink = JsonLinesSink(config.stats_path(self.rank))
        self._trace = open_tracer(config.trace, "worker", self.rank)
        _ACTIVE.add(self)
        logger.info("worker %d/%d connected to %d server(s); %s", self.rank, self.num_workers,
                    len(addrs), config)

    # == public API ===========================================================================
    def begin(self, key: int) -> Optional[StepStats]:
        """Note, in the caller's order, that ``key`` is about to be pushed.

        A *step* (for statistics and the adaptive threshold) starts each time the first key
        ever pushed comes again.  Call this from the thread that issues the pushes in program
        order; :meth:`pushpull` may then run on any thread.  Returns the step's statistics:
        hand them to the :meth:`pushpull` of this key, which counts its bytes, CPU and replies
        there.  Each call is also a ticket that pushpull redeems once it has counted its push
        (``begun`` of them for a push that stands for several begun keys): a step is recorded
        when the next one has begun and its tickets and replies are all in.
        """
        with self._round_lock:
            if self._round_key is None:
                self._round_key = key
            if key == self._round_key:
                self._finish_round()
                if not self._loss_reported and self._round >= 0:
                    self._threshold.observe(math.sqrt(self._grad_sq), "gradient norm")
                self._grad_sq = 0.0
                self._round += 1
                self._stats = StepStats(self._round, self.rank, self._threshold.k,
                                        self.config.udp_channels, time.time())
            stats = self._stats
        self._hold(stats)
        return stats

    def pushpull(self, key: int, flat: np.ndarray, step_stats: Optional[StepStats] = None,
                 out: Optional[np.ndarray] = None, priority: int = 0, begun: int = 1,
                 may_overwrite: bool = False) -> Pending:
        """Push ``flat`` (this worker's gradient of ``key``) and get the merged result.

        Thread-safe.  ``step_stats`` is what :meth:`begin` returned for this push (it is
        called here when omitted).  The array is read asynchronously: do not modify it until
        the result is ready.  The result lands in ``out`` (flat, same size and dtype) when
        given, else in an array the key's next pushpull reuses: copy it if you keep it longer.
        ``priority`` is MXNet's (higher: sent and answered sooner, see ``DGT_PRIORITY_ORDER``).
        ``begun``: how many :meth:`begin` calls with ``step_stats`` this push stands for (the
        members of a fused bucket).  ``may_overwrite``: ``flat`` is the caller's scratch, which
        the worker may change until the result is ready (error feedback then adds what is
        owed in place, saving a copy of the gradient); it must be writeable.
        """
        cpu_began = time.thread_time()  # CPU only: the waits below do not count
        if step_stats is None:
            step_stats, begun = self.begin(key), 1
        try:
            self._check_usable()
            flat = self._as_flat(flat)
            if may_overwrite and not flat.flags.writeable:
                raise LocalProtocolError(f"pushpull of key {key}: may_overwrite=True needs a "
                                         "writeable array")
            return self._pushpull(key, flat, step_stats, out, priority, cpu_began,
                                  may_overwrite)
        finally:
            self._release(step_stats, begun)

    def _pushpull(self, key: int, flat: np.ndarray, step_stats: Optional[StepStats],
                  out: Optional[np.ndarray], priority: int, cpu_began: float,
                  may_overwrite: bool = False) -> Pending:
        plan = self._plan(key, flat)
        if out is not None:
            if out.shape != (plan.n_elems,) or out.dtype != plan.dtype:
                raise LocalProtocolError(f"pushpull of key {key}: `out` must be flat "
                                         f"{plan.dtype} of {plan.n_elems} elements")
            result = out
        else:
            if plan.result is None:
                plan.result = np.empty(plan.n_elems, dtype=plan.dtype)
            result = plan.result
        pending = Pending(f"pushpull of key {key}", result, len(plan.parts),
                          self.config.timeout_s)
        # Steps of one key are strictly ordered, also when two threads push it (a fused
        # round sealed member by member and the member's next push on its own): waiting for
        # the last push and taking the next step number are one move.
        with plan.lock:
            if plan.last is not None and not plan.last.done():
                plan.last.wait()
            if self._bucket_members:
                with self._ledger_lock:  # a member's push checks while another one splits
                    self._move_residuals(key, plan.n_elems)
            steps = []
            for part in plan.parts:
                steps.append(plan.steps[part.index])
                plan.steps[part.index] += 1
            plan.last = pending
        if self.config.adaptive and not self._loss_reported and flat.dtype.kind == "f":
            as32 = flat.astype(np.float32, copy=False)
            norm_sq = float(np.dot(as32, as32))
            with self._round_lock:
                self._grad_sq += norm_sq
        k = step_stats.k if step_stats is not None else self._threshold.k
        priority = clamp_priority(priority)
        socket_s = 0.0
        trace = self._trace
        for part, step in zip(plan.parts, steps):
            began = time.time() if trace.enabled else 0.0
            socket_s += self._push_part(key, part, step, flat[part.start:part.stop], pending,
                                        step_stats, k, priority, may_overwrite)
            if trace.enabled:  # stamped when it began: the server may merge it before now
                trace.record("push", key, part.index, step, self.rank, t=began,
                             handed=time.time(),
                             round=step_stats.step if step_stats is not None else -1)
        self._add_cpu(step_stats, time.thread_time() - cpu_began - socket_s)
        return pending

    def _move_residuals(self, key: int, n_elems: int) -> None:
        """Error feedback across fusion, before ``key``'s push: a bucket takes over what its
        members owe from their pushes on their own (its first push, after the unfused first
        step), and a member pushed on its own again (fusion stopped) takes back its slice of
        what the bucket owes; either once the other side's last push was answered, so its
        losses are in the ledger."""
        members = self._bucket_members.get(key)
        if members is not None:
            owing = [(member, offset) for member, offset, _ in members
                     if self._answered(member) and self._memory.owes((member, 0))]
            if owing:  # a bucket's members are one server's whole keys: one part each
                moved = self._memory.absorb((key, 0), n_elems,
                                            [((member, 0), offset) for member, offset in owing])
                logger.debug("bucket %d takes over %d owed elements of its members", key,
                             moved)
            return
        bucket = self._bucket_of.get(key)
        if bucket is not None and self._answered(bucket) and self._memory.owes((bucket, 0)):
            moved = self._memory.split((bucket, 0), [((member, 0), offset, n)
                                                     for member, offset, n
                                                     in self._bucket_members[bucket]])
            logger.debug("bucket %d's members take back %d owed elements", bucket, moved)

    def _answered(self, key: int) -> bool:
        """Waits for ``key``'s last push to be answered; False if it was never pushed."""
        plan = self._keys.get(key)
        if plan is None:
            return False
        if plan.last is not None and not plan.last.done():
            plan.last.wait()
        return True

    def server_of(self, key: int, n_elems: int) -> Optional[int]:
        """The server that owns all of ``key`` (a tensor of ``n_elems``), or None when the
        key is cut into parts."""
        parts = plan_parts(n_elems, key, len(self._addrs), self.config.bigarray_elems,
                           self.config.part_elems)
        return parts[0].server if len(parts) == 1 else None

    def set_reply_buffer(self, key: int, array: np.ndarray) -> None:
        """Let the replies of ``key`` land in ``array`` (flat, contiguous, the key's size and
        dtype) when :meth:`pushpull` gets no ``out``, from now on.  Nothing else may write
        it: with a server-side optimizer it holds the weights the next reply's delta applies
        to (``DGT_WEIGHTS_REPLY``), so a caller that lends its own buffer saves a copy."""
        if array.ndim != 1 or not array.flags.c_contiguous or not array.flags.writeable:
            raise LocalProtocolError(f"reply buffer of key {key}: must be a flat, contiguous, "
                                     f"writeable array (got shape {array.shape})")
        plan = self._plan(key, array)
        if plan.last is not None and not plan.last.done():
            plan.last.wait()
        if plan.result is not None and plan.result is not array and plan.held_steps:
            array[:] = plan.result
        plan.result = array

    def define_bucket(self, bucket_key: int, server: int, members: List[Tuple[int, int]],
                      dtype) -> Pending:
        """Declare that key ``bucket_key`` is the concatenation of ``members`` ((key, n_elems)
        pairs, all owned by ``server``): the server then updates and stores each member, and
        the bucket is pushed like any key.  Every worker declares the same buckets."""
        self._check_usable()
        dtype = np.dtype(dtype)
        table = np.array(members, dtype=np.int64).reshape(-1, 2)
        total = int(table[:, 1].sum())
        with self._plan_lock:
            self._keys[bucket_key] = _KeyPlan(total, dtype, [Part(server, 0, 0, total)], [0])
        if self.config.error_feedback:
            offsets = np.concatenate([[0], np.cumsum(table[:, 1])[:-1]])
            self._bucket_members[bucket_key] = list(zip(table[:, 0].tolist(), offsets.tolist(),
                                                        table[:, 1].tolist()))
            self._bucket_of.update((member, bucket_key) for member in table[:, 0].tolist())
        serial = next(self._serial)
        pending = Pending(f"definition of bucket {bucket_key}", None, 1, self.config.timeout_s)
        self._register(("ack", 0, 0, serial), _Inflight(pending, Part(server, 0, 0, 0),
                                                         time.time()))
        header = self._header(MsgType.FUSE, bucket_key, None, serial, dtype, total)
        self._send(server, [encode_header(header), table])
        return pending

    def broadcast(self, key: int, flat: np.ndarray) -> Pending:
        """Rank 0's ``flat`` for everyone (the server also stores it as the key's value)."""
        return self._init_or_broadcast(key, flat, "broadcast")

    def init(self, key: int, flat: np.ndarray) -> Pending:
        """Store rank 0's value of ``key`` on the servers (MXNet's ``kv.init``)."""
        return self._init_or_broadcast(key, flat, "init")

    def pull(self, key: int, shape_like: np.ndarray, priority: int = 0) -> Pending:
        """The stored value of ``key``: last merged gradient, or weights with a server-side
        optimizer.  A pending push of the key is waited for first."""
        self._check_usable()
        flat = self._as_flat(shape_like)
        plan = self._plan(key, flat)
        if plan.last is not None:
            plan.last.wait()
        pending = Pending(f"pull of key {key}", np.empty(plan.n_elems, dtype=plan.dtype),
                          len(plan.parts), self.config.timeout_s)
        for part in plan.parts:
            serial = next(self._serial)
            header = self._header(MsgType.PULL, key, part, serial, flat.dtype, part.n_elems)
            header = header._replace(priority=clamp_priority(priority))
            self._register(("value", key, part.index, serial), _Inflight(pending, part, time.time()))
            self._send(part.server, [encode_header(header)], header.priority)
        return pending

    def set_optimizer(self, optimizer_blob: bytes) -> None:
        """Make the servers run the (pickled MXNet) optimizer; rank 0 sends it, all wait."""
        self._check_usable()
        if self.rank == 0:
            acks = []
            for server in range(len(self._addrs)):
                acks.append(self._request(server, MsgType.SET_OPTIMIZER, [optimizer_blob],
                                          "set_optimizer"))
            for ack in acks:
                ack.wait()
        self.barrier()

    def get_optimizer_states(self, dump_optimizer: bool = False) -> List[bytes]:
        """The server-side optimizer's states, one blob per server."""
        self._check_usable()
        blobs = []
        for server in range(len(self._addrs)):
            serial = next(self._serial)
            pending = Pending(f"optimizer states of server {server}", None, 1,
                              self.config.timeout_s)
            entry = _Inflight(pending, Part(server, 0, 0, 0), time.time())
            self._register(("value", 0, 0, serial), entry)
            header = self._header(MsgType.GET_STATES, 0, None, serial)
            self._send(server, [encode_header(header._replace(flags=int(dump_optimizer)))])
            pending.wait()
            blobs.append(entry.blob)
        return blobs

    def set_optimizer_states(self, blobs: List[bytes]) -> None:
        """Replace the server-side optimizer's states (as :meth:`get_optimizer_states` gave)."""
        self._check_usable()
        if len(blobs) != len(self._addrs):
            raise LocalProtocolError(f"the states are for {len(blobs)} server(s), this job has "
                                     f"{len(self._addrs)}")
        acks = [self._request(server, MsgType.SET_STATES, [blob], "set optimizer states")
                for server, blob in enumerate(blobs)]
        for ack in acks:
            ack.wait()

    def barrier(self) -> None:
        """Return when every worker has called barrier (server 0 counts)."""
        self._check_usable()
        self._request(0, MsgType.BARRIER, [], "barrier").wait()

    def report_loss(self, value: float) -> None:
        self._loss_reported = True
        self._threshold.observe(float(value), "loss")

    @property
    def threshold(self) -> float:
        return self._threshold.k

    def close(self) -> None:
        """Say BYE to every server and stop the I/O thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        _ACTIVE.discard(self)
        with self._round_lock:
            self._finish_round()
        for server in range(len(self._addrs)):
            self._send(server, [encode_header(self._header(MsgType.BYE, 0, None, 0))],
                       PRIORITY_LAST)  # after every message still queued
        self._links.close()  # hands over what is queued, the BYEs last
        self._udp.close()
        with self._stats_lock:  # replies still owed will not come now
            self._record_counted(everything=True)
        if self._sink is not None:
            self._sink.close()
        self._trace.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # == push path ============================================================================
    def _push_part(self, key: int, part: Part, step: int, values: np.ndarray,
                   pending: Pending, stats: Optional[StepStats], k: float,
                   priority: int, may_overwrite: bool = False) -> float:
        """Queue one part's push; returns the CPU seconds spent in datagram socket calls."""
        cfg = self.config
        wire_dtype = self._wire_dtype(values.dtype)
        code = dtype_code(wire_dtype)
        frag_elems = fragment_elems(cfg.block_elems, wire_dtype.itemsize,
                                    cfg.udp_payload_bytes)
        blocks = BlockLayout(part.n_elems, cfg.block_elems)
        layout = FragmentLayout(blocks, frag_elems)
        ident = (key, part.index)
        differential = (cfg.enable and code in FLOAT_CODES and blocks.n_blocks > 1)
        inflight = _Inflight(pending, part, time.time(), layout=layout, ident=ident, stats=stats)
        base = Header(MsgType.PUSH, job=cfg.job_id, rank=self.rank, dtype=code, key=key,
                      part=part.index, step=step, n_elems=part.n_elems,
                      block_elems=cfg.block_elems, frag_elems=frag_elems, priority=priority)
        scratch = self._scratch(ident, values, wire_dtype)
        if not differential:
            self._register(("push", key, part.index, step), inflight)
            self._hold(stats)  # until its reply is counted (or it fails)
            header = base._replace(flags=FLAG_ALL_RELIABLE, block=blocks.n_blocks)
            everything = np.arange(blocks.n_blocks)
            payload = values if wire_dtype == values.dtype \
                else cast(values, wire_dtype, out=scratch.gathered)
            self._send(part.server, [encode_header(header),
                                     *split_blocks(blocks, everything, payload)], priority)
            self._count(stats, 0, blocks.n_blocks, payload.nbytes)
            return 0.0
        if cfg.error_feedback:
            values = self._memory.compensate(
                ident, values, out=values if may_overwrite else scratch.compensated)
            inflight.compensated = values
        scores = score_blocks(self._scores, ident, blocks, values)
        ranking = scores
        if cfg.shared_ranking:
            # Every worker ranks by the same sum (the last reply's), so all send the same
            # blocks reliably; the first step, with no sum yet, ranks by its own scores.
            shared = self._shared_scores.get(ident)
            if shared is not None and shared.shape == scores.shape:
                ranking = shared
        rng = (np.random.default_rng([cfg.seed, self.rank, key, part.index, step])
               if cfg.random_order else None)
        channels = assign_channels(ranking, k, cfg.udp_channels, rng)
        # One stable sort: the reliable blocks first, ascending, then channel 1's, 2's, ...
        by_channel = np.argsort(channels, kind="stable")
        blocks_per_channel = np.bincount(channels, minlength=cfg.udp_channels + 1)
        reliable = by_channel[:blocks_per_channel[0]].astype(np.uint32)
        udp_blocks = by_channel[blocks_per_channel[0]:]
        slots = layout.slots_of_blocks(udp_blocks) if not cfg.send_drop else np.empty(0, np.int64)
        header = base._replace(block=len(reliable), udp_expected=len(slots))
        score_frames = []
        if cfg.shared_ranking:
            header = header._replace(flags=FLAG_SCORES)
            score_frames = [np.asarray(scores, dtype=np.float32)]  # a new array every step
        # Scores and error feedback above use the exact values; only what travels is cast,
        # on the way into the payload and the datagrams (scratch.gathered is in the wire dtype).
        payload = blocks.gather(values, reliable, out=scratch.gathered)
        self._register(("push", key, part.index, step), inflight)
        self._hold(stats)  # until its reply is counted (or it fails)
        self._send(part.server, [encode_header(header), reliable, *score_frames,
                                 *split_blocks(blocks, reliable, payload)], priority)
        self._count(stats, 0, len(reliable), payload.nbytes)
        elems_per_channel = np.bincount(channels, weights=blocks.block_lengths,
                                        minlength=cfg.udp_channels + 1)
        for channel in range(1, cfg.udp_channels + 1):
            self._count(stats, channel, int(blocks_per_channel[channel]),
                        int(elems_per_channel[channel]) * wire_dtype.itemsize)
        socket_s = 0.0
        if len(slots):
            socket_s = self._send_datagrams(base, layout, values, wire_dtype, channels, slots,
                                            stats, part.server)
            self._send(part.server, [encode_header(base._replace(type=MsgType.PUSH_END))],
                       priority)
        return socket_s

    def _wire_dtype(self, dtype: np.dtype) -> np.dtype:
        """The dtype ``dtype`` gradients travel in (``DGT_WIRE_DTYPE``)."""
        if self.config.wire_dtype == "bfloat16" and dtype == np.float32:
            return BFLOAT16
        return np.dtype(dtype)

    def _scratch(self, ident, values: np.ndarray, wire_dtype: np.dtype) -> "_Scratch":
        """Per-part buffers reused every step: fresh arrays of this size would page-fault on
        every touch (tens of ms for a 64 MB tensor).  A buffer is reused only when the next
        step of the same part is pushed, after the previous reply, so nothing in flight reads
        it any more."""
        scratch = self._scratches.get(ident)
        if scratch is None or scratch.compensated.shape != values.shape \
                or scratch.compensated.dtype != values.dtype \
                or scratch.gathered.dtype != wire_dtype:
            scratch = _Scratch(np.empty_like(values), np.empty(values.shape, wire_dtype))
            self._scratches[ident] = scratch
        return scratch

    def _send_datagrams(self, base: Header, layout: FragmentLayout, values: np.ndarray,
                        wire_dtype: np.dtype, channels: np.ndarray, slots: np.ndarray,
                        stats: Optional[StepStats], server: int) -> float:
        """Send one datagram per fragment slot, in the given order (channel 1 first).

        Datagrams of full size are rows of one array (:func:`dgt.wire.frame_datagrams`),
        handed to the kernel many rows per call (UDP GSO); the rest, if any, one by one.  Loss
        injection removes slots before framing.  Returns the CPU seconds spent in
        the socket calls (the transport's cost, not dgt's own).
        """
        cfg = self.config
        dropped = dropped_slots(cfg.udp_drop, cfg.seed, self.rank, base.key, base.part,
                                base.step, slots)
        datagrams = frame_datagrams(base, layout, values, channels, slots[~dropped], wire_dtype)
        addr = self._addrs[server]
        sent = errors = 0
        socket_began = time.thread_time()
        row_chans = datagrams.row_channels
        if len(row_chans):
            bounds = np.flatnonzero(np.diff(row_chans)) + 1
            for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), len(row_chans)]):
                ok, bad = self._udp.send_rows(int(row_chans[lo]), addr, datagrams.rows[lo:hi])
                sent += ok
                errors += bad
        header_view = memoryview(datagrams.odd_headers)
        for i, (channel, payload) in enumerate(zip(datagrams.odd_channels.tolist(),
                                                   datagrams.odd_payloads)):
            if self._udp.send(channel, addr, header_view[i * HEADER_BYTES:(i + 1) * HEADER_BYTES],
                              memoryview(payload)):
                sent += 1
            else:
                errors += 1
        socket_s = time.thread_time() - socket_began
        if stats is not None:
            with self._stats_lock:
                stats.datagrams_sent += sent
                stats.datagrams_injected_loss += int(np.count_nonzero(dropped))
                stats.datagrams_send_errors += errors
        return socket_s

    # == helpers ==============================================================================
    @staticmethod
    def _as_flat(array: np.ndarray) -> np.ndarray:
        flat = np.ascontiguousarray(array).reshape(-1)
        if flat.size == 0:
            raise LocalProtocolError("dgt cannot synchronise an empty array")
        return flat

    def _plan(self, key: int, flat: np.ndarray) -> _KeyPlan:
        if not 0 <= key < 2 ** 32:
            raise LocalProtocolError(f"key {key} is out of range 0..2**32-1")
        plan = self._keys.get(key)
        if plan is None:
            with self._plan_lock:
                plan = self._keys.get(key)
                if plan is None:
                    parts = plan_parts(flat.size, key, len(self._addrs),
                                       self.config.bigarray_elems, self.config.part_elems)
                    plan = _KeyPlan(flat.size, flat.dtype, parts, [0] * len(parts))
                    self._keys[key] = plan
        elif plan.n_elems != flat.size or plan.dtype != flat.dtype:
            raise LocalProtocolError(
                f"key {key} was first used with {plan.n_elems} elements of {plan.dtype}, now "
                f"with {flat.size} of {flat.dtype}")
        return plan

    def _header(self, mtype: MsgType, key: int, part: Optional[Part], step: int,
                dtype=np.float32, n_elems: int = 0) -> Header:
        return Header(mtype, job=self.config.job_id, rank=self.rank if self.rank >= 0 else NO_RANK,
                      key=key, part=part.index if part else 0, step=step,
                      dtype=dtype_code(dtype), n_elems=n_elems)

    def _init_or_broadcast(self, key: int, flat: np.ndarray, what: str) -> Pending:
        self._check_usable()
        flat = self._as_flat(flat)
        plan = self._plan(key, flat)
        pending = Pending(f"{what} of key {key}", np.empty(plan.n_elems, dtype=plan.dtype),
                          len(plan.parts), self.config.timeout_s)
        for part in plan.parts:
            serial = next(self._serial)
            header = self._header(MsgType.INIT, key, part, serial, flat.dtype, part.n_elems)
            frames = [encode_header(header)]
            if self.rank == 0:
                frames.extend(split_dense(flat[part.start:part.stop]))
            self._register(("value", key, part.index, serial), _Inflight(pending, part, time.time()))
            self._send(part.server, frames)
        plan.last = pending
        return pending

    def _request(self, server: int, mtype: MsgType, frames: list, what: str) -> Pending:
        serial = next(self._serial)
        pending = Pending(what, None, 1, self.config.timeout_s)
        self._register(("ack", 0, 0, serial), _Inflight(pending, Part(server, 0, 0, 0), time.time()))
        self._send(server, [encode_header(self._header(mtype, 0, None, serial))] + frames)
        return pending

    def _register(self, ident: tuple, inflight: _Inflight) -> None:
        with self._inflight_lock:
            # _fail_all may have emptied the table since this call's _check_usable; an entry
            # added now would wait for an I/O thread that is gone.
            if self._fatal is not None:
                raise self._fatal
            self._inflight[ident] = inflight

    def _send(self, server: int, frames: list, priority: int = PRIORITY_CONTROL) -> None:
        """Queue a message; control messages (the default) pass every queued gradient."""
        self._links.send(server, frames, priority)

    def _check_usable(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        if self._closed:
            raise LocalProtocolError("this dgt worker is closed")

    def _hello(self) -> None:
        """Join server 0 (which assigns a rank when we have none), then the others."""
        for server in range(len(self._addrs)):
            pending = self._request(server, MsgType.HELLO, [], f"connection to server {server} "
                                    f"at {self._addrs[server][0]}:{self._addrs[server][1]}")
            pending.wait()
        logger.debug("worker rank %d joined", self.rank)

    # == statistics and adaptive threshold ====================================================
    def _finish_round(self) -> None:
        """The current step takes no new push; it is recorded once its pushes are counted."""
        stats, self._stats = self._stats, None
        if stats is None:
            return
        with self._stats_lock:
            self._sealed.append(stats)
            self._record_counted()

    def _hold(self, stats: Optional[StepStats]) -> None:
        if stats is not None:
            with self._stats_lock:
                stats._inflight += 1

    def _release(self, stats: Optional[StepStats], count: int = 1) -> None:
        if stats is not None:
            with self._stats_lock:
                stats._inflight -= count
                self._record_counted()

    def _record_counted(self, everything: bool = False) -> None:
        """Record the sealed steps whose pushes are all counted, in step order (all of them
        when ``everything``: at close, when no reply can come any more).  Call it holding
        _stats_lock."""
        while self._sealed and (everything or self._sealed[0]._inflight <= 0):
            self._record(self._sealed.popleft())

    def _record(self, stats: StepStats) -> None:
        self.last_stats = stats
        totals = self.totals
        totals["steps"] += 1
        for index, nbytes in enumerate(stats.bytes_per_channel):
            totals["bytes_per_channel"][index] += nbytes
        for name in ("udp_expected", "udp_merged", "udp_lost", "udp_late", "feedback_elems",
                     "cpu_ms"):
            totals[name] += getattr(stats, name)
        if self._sink is not None:
            self._sink.write(stats)

    def _add_cpu(self, stats: Optional[StepStats], seconds: float) -> None:
        if stats is not None:
            with self._stats_lock:
                stats.cpu_ms += seconds * 1000.0

    def _count(self, stats: Optional[StepStats], channel: int, blocks: int, nbytes: int) -> None:
        if stats is not None:
            with self._stats_lock:
                stats.blocks_per_channel[channel] += blocks
                stats.bytes_per_channel[channel] += nbytes

    # == replies (called on the I/O thread of ServerLinks) ====================================
    def _on_message(self, server: int, frames) -> None:
        try:
            header = decode_header(frames[0].buffer)
        except RemoteProtocolError as exc:
            self._fail_all(RemoteProtocolError(f"server {server} sent garbage: {exc}"))
            return
        if header.job != self.config.job_id:
            self._fail_all(RemoteProtocolError(
                f"server {server} belongs to job {header.job}, this worker to job "
                f"{self.config.job_id}: check DGT_SERVER_ADDRS"))
            return
        mtype = header.type
        if mtype is MsgType.REPLY:
            self._on_reply(header, frames)
        elif mtype is MsgType.VALUE:
            entry = self._pop(("value", header.key, header.part, header.step))
            if entry is not None:
                if entry.pending.result is None:  # raw bytes (optimizer states)
                    entry.blob = b"".join(f.bytes for f in frames[1:])
                else:
                    self._fill(entry, header, frames[1:])
                entry.pending._part_done()
        elif mtype in (MsgType.ACK, MsgType.WELCOME):
            entry = self._pop(("ack", 0, 0, header.step))
            if entry is not None:
                if mtype is MsgType.WELCOME:
                    if self.rank < 0:
                        self.rank = header.rank
                    elif header.rank != self.rank:
                        entry.pending._fail(RemoteProtocolError(
                            f"server {server} gave rank {header.rank}, server 0 gave {self.rank}"))
                entry.pending._part_done()
        elif mtype is MsgType.ERROR:
            text = bytes(frames[1].buffer).decode("utf-8", "replace") if len(frames) > 1 else ""
            error = RemoteProtocolError(f"server {server} refused a request: {text}")
            entry = None
            for kind in ("push", "value"):
                entry = entry or self._pop((kind, header.key, header.part, header.step))
            entry = entry or self._pop(("ack", 0, 0, header.step))
            if entry is not None:
                entry.pending._fail(error)
                self._release(entry.stats)
            else:
                self._fail_all(error)
        elif mtype is MsgType.BYE:
            self._fail_all(PeerLost(f"server {server} is shutting down"))
        else:
            self._fail_all(RemoteProtocolError(f"server {server} sent an unexpected "
                                               f"{mtype.name}"))

    def _on_reply(self, header: Header, frames) -> None:
        cpu_began = time.thread_time()
        self._trace.record("reply", header.key, header.part, header.step, self.rank)
        entry = self._pop(("push", header.key, header.part, header.step))
        if entry is None:
            self._fail_all(RemoteProtocolError(f"reply for an unknown push: {header.debug_str()}"))
            return
        try:
            self._take_reply(entry, header, frames, cpu_began)
        finally:
            self._release(entry.stats)

    def _take_reply(self, entry: _Inflight, header: Header, frames, cpu_began: float) -> None:
        if len(frames) < 2:
            entry.pending._fail(RemoteProtocolError(f"short reply: {header.debug_str()}"))
            return
        first = 2  # after the header and the missing-slot bitmap
        if header.flags & FLAG_SCORES:
            if len(frames) < 3:
                entry.pending._fail(RemoteProtocolError(
                    f"reply without its scores frame: {header.debug_str()}"))
                return
            try:
                self._shared_scores[entry.ident] = decode_scores(frames[2].buffer,
                                                                 entry.layout.blocks.n_blocks)
            except RemoteProtocolError as exc:
                entry.pending._fail(RemoteProtocolError(f"{entry.pending.what}: {exc}"))
                return
            first = 3
        if header.flags & FLAG_SPARSE:
            self._fill_sparse(entry, header, frames[first], frames[first + 1:])
        elif header.flags & FLAG_DELTA:
            self._fill_delta(entry, header, frames[first:])
        else:
            self._fill(entry, header, frames[first:])
        if entry.pending.done():  # failed while filling
            return
        if header.flags & FLAG_WEIGHTS and not header.flags & FLAG_DELTA:
            self._hold_weights(entry, header)
        carried = 0
        if header.flags & FLAG_FEEDBACK and entry.compensated is not None:
            layout = entry.layout
            bitmap = np.frombuffer(frames[1].buffer, dtype=np.uint8)
            if bitmap.size * 8 < layout.n_slots:
                entry.pending._fail(RemoteProtocolError("reply bitmap is too short"))
                return
            missing = np.flatnonzero(np.unpackbits(bitmap, count=layout.n_slots))
            carried = self._memory.remember(entry.ident, entry.compensated,
                                            *layout.slot_ranges(missing))
        stats = entry.stats
        if stats is not None:
            with self._stats_lock:
                stats.keys += 1
                payload = frames[first + 1:] if header.flags & FLAG_SPARSE else frames[first:]
                stats.reply_bytes += sum(len(f.buffer) for f in payload)
                stats.udp_expected += header.udp_expected
                stats.udp_merged += header.udp_merged
                stats.udp_lost += max(0, header.udp_expected - header.udp_merged)
                stats.udp_late += header.udp_late
                stats.feedback_elems += carried
                stats.grace_ms_max = max(stats.grace_ms_max, header.grace_us / 1000.0)
                stats.latency_ms = max(stats.latency_ms,
                                       (time.time() - stats.started_s) * 1000.0)
        self._add_cpu(stats, time.thread_time() - cpu_began)
        entry.pending._part_done()

    def _reply_dtype_ok(self, dtype: np.dtype, result: Optional[np.ndarray]) -> bool:
        """A reply comes in the result's dtype or, for a sum, in the wire dtype."""
        return result is not None and dtype in (result.dtype, self._wire_dtype(result.dtype))

    def _fill(self, entry: _Inflight, header: Header, frames) -> None:
        """Copy the payload frames of a reply into the pending result, checking sizes."""
        pending, part = entry.pending, entry.part
        dtype = code_dtype(header.dtype)
        result = pending.result
        if not self._reply_dtype_ok(dtype, result):
            pending._fail(RemoteProtocolError(f"{pending.what}: reply of dtype {dtype}"))
            return
        offset = part.start
        for frame in frames:
            data = np.frombuffer(frame.buffer, dtype=dtype)
            if offset + data.size > part.stop:
                break
            result[offset:offset + data.size] = data
            offset += data.size
        if offset != part.stop or sum(len(f.buffer) for f in frames) != part.n_elems * dtype.itemsize:
            pending._fail(RemoteProtocolError(
                f"{pending.what}: reply does not hold the {part.n_elems} elements expected"))

    def _hold_weights(self, entry: _Inflight, header: Header) -> None:
        """Keep whole weights in the key's own buffer: the base of the next delta.  Only
        bfloat16 gradients get delta replies, so float32 ones need no copy."""
        plan, part = self._keys[header.key], entry.part
        if self._wire_dtype(plan.dtype) != BFLOAT16:
            return
        result = entry.pending.result
        if plan.result is None:
            plan.result = np.empty(plan.n_elems, dtype=plan.dtype)
        if result is not plan.result:
            plan.result[part.start:part.stop] = result[part.start:part.stop]
        plan.held_steps[part.index] = header.step

    def _fill_delta(self, entry: _Inflight, header: Header, frames) -> None:
        """Add a reply's bfloat16 step (``dgt.weights``) to the weights of the key's last
        reply, then copy them into the pending result when that is another array."""
        pending, part = entry.pending, entry.part
        plan = self._keys[header.key]
        dtype = code_dtype(header.dtype)
        if dtype != BFLOAT16 or plan.dtype != np.float32 \
                or plan.held_steps.get(part.index) != header.step - 1:
            pending._fail(RemoteProtocolError(
                f"{pending.what}: a delta reply ({dtype}) for step {header.step} of part "
                f"{part.index}, but this worker holds the {plan.dtype} weights of step "
                f"{plan.held_steps.get(part.index)}"))
            return
        if sum(len(f.buffer) for f in frames) != part.n_elems * dtype.itemsize:
            pending._fail(RemoteProtocolError(
                f"{pending.what}: delta reply does not hold the {part.n_elems} elements "
                "expected"))
            return
        held = plan.result
        offset = part.start
        for frame in frames:
            data = np.frombuffer(frame.buffer, dtype=dtype)
            add_bfloat16_(held[offset:offset + data.size], data)
            offset += data.size
        if pending.result is not held:
            pending.result[part.start:part.stop] = held[part.start:part.stop]
        plan.held_steps[part.index] = header.step

    def _fill_sparse(self, entry: _Inflight, header: Header, index_frame, frames) -> None:
        """A reply that holds only the blocks some worker's data reached (the server's
        ``wire.sum_reply_frames``): they go in place, every other block of the part becomes zero."""
        pending, part = entry.pending, entry.part
        dtype = code_dtype(header.dtype)
        layout = entry.layout.blocks
        if not self._reply_dtype_ok(dtype, pending.result) \
                or header.block_elems != layout.block_elems or header.n_elems != part.n_elems:
            pending._fail(RemoteProtocolError(f"{pending.what}: sparse reply does not match the "
                                              f"push: {header.debug_str()}"))
            return
        try:
            blocks, chunks = decode_blocks(layout, header.block, index_frame.buffer,
                                           [f.buffer for f in frames], dtype)
        except RemoteProtocolError as exc:
            pending._fail(RemoteProtocolError(f"{pending.what}: sparse reply: {exc}"))
            return
        payload = chunks[0] if len(chunks) == 1 else np.concatenate(chunks) if chunks \
            else np.empty(0, dtype)
        layout.expand_(pending.result[part.start:part.stop], blocks, payload)

    def _pop(self, ident: tuple) -> Optional[_Inflight]:
        with self._inflight_lock:
            return self._inflight.pop(ident, None)

    def _expire(self, now: float) -> None:
        limit = self.config.timeout_s
        with self._inflight_lock:
            expired = [k for k, v in self._inflight.items() if now - v.started > limit]
            entries = [self._inflight.pop(k) for k in expired]
        for entry in entries:
            entry.pending._fail(StepTimeout(
                f"{entry.pending.what}: server {entry.part.server} did not answer within "
                f"{limit:g} s (DGT_TIMEOUT_S)"))
            self._release(entry.stats)

    def _fail_all(self, error: BaseException) -> None:
        self._fatal = error
        with self._inflight_lock:
            entries = list(self._inflight.values())
            self._inflight.clear()
        for entry in entries:
            entry.pending._fail(error)
            self._release(entry.stats)

