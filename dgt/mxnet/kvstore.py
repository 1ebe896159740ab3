"""``mx.kv.create('dgt')``: the MXNet face of :class:`dgt.worker.Worker`.

The only package of dgt that imports mxnet.  It converts NDArrays to numpy on the way out and
writes results back with NDArray-to-NDArray copies (numpy writes into MKLDNN-layout weights
fail, see the MXNet notes).  ``pushpull`` works *through MXNet's engine*, as the native
kvstore does: per key it enqueues a copy of the gradient into a host buffer, one asynchronous
engine operator (:mod:`dgt.mxnet.engine`) that hands the buffer to the worker as soon as
backward has computed it (so communication overlaps the rest of the backward pass) and
finishes when the reply is in, and a copy of the reply into the output arrays; anything that
reads those arrays (the optimizer, ``asnumpy``) waits for it.  No thread waits meanwhile.

A failure in flight (a timeout, a lost server) cannot travel through the engine: it is logged
at once and raised by the next call of this store; the outputs keep their old values.

Semantics are those of ``dist_sync``: ``pushpull`` returns the *sum* over workers, broadcast
returns rank 0's value, and ``type`` contains ``dist`` and ``_sync`` so that Gluon and Module
treat the store exactly like ``dist_sync`` (batch-size scaling in Module, no kvstore reset).
"""
from __future__ import annotations

import atexit
import functools
import logging
import pickle
import types
from typing import Dict, Optional

import mxnet as mx
import numpy as np
from mxnet.kvstore.base import KVStoreBase

from .. import current_config
from ..config import Config
from ..errors import LocalProtocolError
from ..fusion import FUSED_KEY_BASE, Call, FusionPlanner, Slot
from ..pending import Pending
from ..worker import Worker
from .engine import HostBuffers, push_async, sum_into
from .fused import Fuser

__all__ = ["DGT"]

logger = logging.getLogger(__name__)

def _wrap(result: np.ndarray, shape) -> "mx.nd.NDArray":
    """A CPU NDArray over ``result``'s memory (no copy).  Copying it into the target is an
    NDArray-to-NDArray copy, which also works for weights held in MKLDNN layout."""
    return mx.nd.from_numpy(np.ascontiguousarray(result).reshape(shape), zero_copy=True)


def _as_list(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


@KVStoreBase.register
class DGT(KVStoreBase):
    """Differential Gradient Transmission kvstore.

    Created by MXNet with no arguments (``mx.kv.create('dgt')`` or ``kvstore='dgt'``): the
    configuration comes from the ``DGT_*`` environment (set by ``dgt-launch``) and
    :func:`dgt.configure`.  ``DGT(config=...)`` is accepted too.

    >>> import dgt, mxnet as mx                      # doctest: +SKIP
    >>> kv = mx.kv.create('dgt')                     # doctest: +SKIP
    >>> kv.pushpull(0, mx.nd.ones(4) * (kv.rank + 1))  # sum over workers, in place
    """

    def __init__(self, config: Optional[Config] = None):
        super().__init__()
        self._config = config or current_config()
        self._worker = Worker(self._config)
        self._key_ids: Dict[str, int] = {}
        self._pushed: Dict[int, Pending] = {}
        self._buffers: Dict[int, HostBuffers] = {}
        self._planner = FusionPlanner(self._config.fusion_elems, self._worker.server_of)
        self._shapes: Dict[int, tuple] = {}
        self._fuser = Fuser(self._worker, self._remember_error, self._stop_fusion)
        self._error: Optional[BaseException] = None
        self._optimizer = None
        atexit.register(self.close)

    # -- properties ---------------------------------------------------------------------------
    @property
    def type(self) -> str:
        return "dist_sync_dgt"

    @property
    def rank(self) -> int:
        return self._worker.rank

    @property
    def num_workers(self) -> int:
        return self._worker.num_workers

    @property
    def worker(self) -> Worker:
        """The underlying transport (statistics, threshold)."""
        return self._worker

    def is_capable(self, capability: str) -> bool:
        if capability.lower() == KVStoreBase.OPTIMIZER:
            return True
        raise ValueError(f"unknown capability {capability!r}; dgt knows "
                         f"{KVStoreBase.OPTIMIZER!r}")

    # -- data path ----------------------------------------------------------------------------
    def broadcast(self, key, value, out, priority=0):
        for k, v, o in self._zip(key, value, out):
            pending = self._worker.broadcast(self._key_id(k), _as_list(v)[0].asnumpy())
            result = pending.wait()  # once per parameter: no need to overlap
            for target in _as_list(o):
                target[:] = _wrap(result, target.shape)

    def pushpull(self, key, value, out=None, priority=0):
        targets = value if out is None else out
        for k, v, o in self._zip(key, value, targets, flush=False):
            key_id = self._key_id(k)
            values, outs = _as_list(v), _as_list(o)
            slot = self._fusion_slot(key_id, values[0])
            if slot is not None:
                self._fuser.pushpull(slot, values, outs, self._worker.begin(key_id), priority)
                continue
            buffers = self._buffers_for(key_id, values[0])
            sum_into(values, buffers.send)
            stats = self._worker.begin(key_id)  # program order, for the step statistics
            push_async(functools.partial(self._exchange, key_id, buffers, stats, priority),
                       reads=[], writes=[buffers.send, buffers.recv], priority=priority)
            for target in outs:
                buffers.recv.copyto(target)

    def _exchange(self, key_id: int, buffers: HostBuffers, stats, priority: int,
                  completion) -> None:
        """The engine operator of one pushpull: hand the gradient to the worker and complete
        when the reply is in ``buffers.recv`` (on the I/O thread, or at the timeout)."""
        try:
            # The send buffer is ours and declared written: error feedback may add in place.
            pending = self._worker.pushpull(key_id, buffers.send_host, stats,
                                            priority=priority,
                                            may_overwrite=True)  # into buffers.recv_host
        except Exception as exc:  # noqa: BLE001 - raised by the next kvstore call
            self._remember_error(exc)
            completion()
            return

        def finished(done: Pending) -> None:
            if done.error() is not None:
                self._remember_error(done.error())
            completion()

        pending.add_done_callback(finished)

    def init(self, key, value):
        for k, v, _ in self._zip(key, value, value):
            self._worker.init(self._key_id(k), _as_list(v)[0].asnumpy())

    def push(self, key, value, priority=0):
        for k, v, _ in self._zip(key, value, value):
            key_id = self._key_id(k)
            self._pushed[key_id] = self._worker.pushpull(key_id, self._local_sum(v))

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        if out is None:
            raise LocalProtocolError("pull needs `out`")
        for k, o, _ in self._zip(key, out, out):
            key_id = self._key_id(k)
            pending = self._pushed.pop(key_id, None)
            if pending is None:
                pending = self._worker.pull(key_id, _as_list(o)[0].asnumpy(), priority)
            result = pending.wait()
            for target in _as_list(o):
                target[:] = _wrap(result, target.shape)

    # -- control ------------------------------------------------------------------------------
    def set_optimizer(self, optimizer):
        """Run ``optimizer`` on the servers; pushes then return updated weights."""
        self._settle()
        self._optimizer = optimizer
        self._worker.set_optimizer(pickle.dumps(optimizer, 0))

    def set_gradient_compression(self, compression_params):
        raise LocalProtocolError(
            "dgt does its own gradient reduction; MXNet gradient compression cannot be "
            "combined with it (drop compression_params, or use kvstore='dist_sync')")

    def barrier(self):
        self._settle()
        self._worker.barrier()

    def _barrier(self):
        self.barrier()

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Save the server-side optimizer's states (momentum, ...) to ``fname``.

        Unlike ``dist_sync``, which cannot, dgt fetches them from every server."""
        self._settle()
        mx.nd.waitall()
        blobs = self._worker.get_optimizer_states(dump_optimizer)
        with open(fname, "wb") as f:
            pickle.dump({"dgt_optimizer_states": blobs}, f)

    def load_optimizer_states(self, fname):
        """Load states saved by :meth:`save_optimizer_states` into the servers.  Call it on
        every worker, or on one before training starts (loading is idempotent)."""
        self._settle()
        with open(fname, "rb") as f:
            saved = pickle.load(f)  # the user's own file, as MXNet's loaders do
        if not isinstance(saved, dict) or "dgt_optimizer_states" not in saved:
            raise LocalProtocolError(f"{fname} was not written by dgt's save_optimizer_states")
        blobs = saved["dgt_optimizer_states"]
        self._worker.set_optimizer_states(blobs)
        per_part = pickle.loads(blobs[0])
        states = next(iter(per_part.values()), None)
        states = pickle.loads(states) if states is not None else None
        if isinstance(states, tuple) and len(states) == 2:
            self._optimizer = states[1]
        # gluon.Trainer.load_states reads the optimizer back from here.
        self._updater = types.SimpleNamespace(optimizer=self._optimizer)

    def report_loss(self, value: float) -> None:
        """Feed the training loss to the adaptive threshold (see :func:`dgt.report_loss`)."""
        self._worker.report_loss(value)

    def close(self) -> None:
        """Wait for results in flight and leave the job; called at exit automatically."""
        try:
            mx.nd.waitall()
        except Exception:  # noqa: BLE001 - an error already reported by the engine
            pass
        self._fuser.close()
        try:
            mx.nd.waitall()
        except Exception:  # noqa: BLE001
            pass
        self._worker.close()

    # -- helpers ------------------------------------------------------------------------------
    def _fusion_slot(self, key_id: int, like) -> Optional[Slot]:
        """Where this pushpull goes in the learned step (None: on its own)."""
        planner = self._planner
        if planner.stopped:
            return None
        was_active = planner.active
        slot, broke = planner.place(Call(key_id, int(np.prod(like.shape)),
                                         np.dtype(like.dtype).name))
        self._shapes.setdefault(key_id, tuple(like.shape))
        if broke:
            logger.warning("dgt: tensor fusion stops: %s", planner.stop_reason)
            self._fuser.flush()
        if planner.active and not was_active:
            self._fuser.define(planner.buckets, self._shapes)
        return slot

    def _stop_fusion(self, reason: str) -> None:
        self._planner.stop(reason)
        logger.warning("dgt: tensor fusion stops: %s", reason)

    @property
    def fused_keys(self) -> int:
        """How many keys travel in buckets (0 while the first step is learned, or when
        fusion is off or stopped; see DGT_FUSION_ELEMS)."""
        if not self._planner.active:
            return 0
        return sum(len(bucket.members) for bucket in self._planner.buckets)

    def _buffers_for(self, key_id: int, like) -> HostBuffers:
        buffers = self._buffers.get(key_id)
        if buffers is None or not buffers.fits(like):
            buffers = HostBuffers(like.shape, like.dtype)
            self._buffers[key_id] = buffers
            # Replies land in it directly: with the optimizer on the servers it then also
            # holds the weights a delta reply applies to, without a copy of its own.
            self._worker.set_reply_buffer(key_id, buffers.recv_host)
        return buffers

    def _key_id(self, key) -> int:
        if isinstance(key, str):
            # Module uses parameter names; ids in first-use order, as MXNet's own stores do,
            # so the server-side optimizer sees the same indices as with dist_sync.
            if key not in self._key_ids:
                self._key_ids[key] = len(self._key_ids)
            return self._key_ids[key]
        key = int(key)
        if not 0 <= key < FUSED_KEY_BASE:
            raise LocalProtocolError(f"key {key} is out of range 0..{FUSED_KEY_BASE - 1} (dgt "
                                     "keeps the keys above for fused tensors)")
        if self._key_ids and key in self._key_ids.values():
            raise LocalProtocolError(f"integer key {key} collides with a string key; use one "
                                     "kind of key per store")
        return key

    def _zip(self, key, value, out, flush=True):
        if flush:
            self._settle()
        else:
            self._raise_pending_error()
        if isinstance(key, (list, tuple)):
            if not (len(key) == len(value) == len(out)):
                raise LocalProtocolError("key, value and out lists differ in length")
            return list(zip(key, value, out))
        return [(key, value, out)]

    @staticmethod
    def _local_sum(value) -> np.ndarray:
        arrays = _as_list(value)
        total = arrays[0].asnumpy()
        for array in arrays[1:]:
            total = total + array.asnumpy()
        return total

    def _remember_error(self, error: BaseException) -> None:
        logger.error("dgt: %s", error)
        if self._error is None:
            self._error = error

    def _settle(self) -> None:
        """Any call but pushpull ends the open fusion rounds first (nothing is left waiting
        for a member), then raises an error from earlier asynchronous work."""
        self._fuser.flush()
        self._raise_pending_error()

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            raise self._error


def _wrap_create_kvstore(original):
    """MXNet drops any kvstore *string* without 'dist' when there is one device per worker
    (and trains locally, silently).  Turn 'dgt' into an instance first."""
    if getattr(original, "_dgt_wrapped", False):
        return original

    @functools.wraps(original)
    def _create_kvstore(kvstore, num_device, arg_params):
        if isinstance(kvstore, str) and kvstore.lower() == "dgt":
            kvstore = mx.kv.create(kvstore)
        return original(kvstore, num_device, arg_params)

    _create_kvstore._dgt_wrapped = True
    return _create_kvstore


def _install():
    import mxnet.gluon.trainer as trainer_module
    import mxnet.model as model_module
    import mxnet.module.module as module_module

    for module in (model_module, trainer_module, module_module):
        module._create_kvstore = _wrap_create_kvstore(module._create_kvstore)


_install()
