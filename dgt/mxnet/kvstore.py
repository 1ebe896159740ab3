"""``mx.kv.create('dgt')``: the MXNet face of :class:`dgt.worker.Worker`.

The only module of dgt that imports mxnet.  It converts NDArrays to numpy on the way out and
writes results back with NDArray-to-NDArray copies (numpy writes into MKLDNN-layout weights
fail, see the MXNet notes).  ``pushpull`` works *through MXNet's engine*, as the native
kvstore does: it returns at once after enqueueing two small custom operators per key, one that
pushes the gradient as soon as backward has computed it (so communication overlaps the rest of
the backward pass) and one that waits for the reply and writes it into the output arrays;
anything that reads those arrays (the optimizer, ``asnumpy``) waits for it.

Semantics are those of ``dist_sync``: ``pushpull`` returns the *sum* over workers, broadcast
returns rank 0's value, and ``type`` contains ``dist`` and ``_sync`` so that Gluon and Module
treat the store exactly like ``dist_sync`` (batch-size scaling in Module, no kvstore reset).
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import itertools
import logging
import pickle
import threading
import types
from typing import Dict, Optional

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, check_call
from mxnet.kvstore.base import KVStoreBase

from .. import current_config
from ..config import Config
from ..errors import LocalProtocolError
from ..worker import Pending, Worker

__all__ = ["DGT"]

logger = logging.getLogger(__name__)

class _Ticket:
    """What the engine operators of one push share: the push result, its error, its users."""

    __slots__ = ("store", "key", "stats", "pending", "error", "users")

    def __init__(self, store, key, stats, users):
        self.store, self.key, self.stats, self.users = store, key, stats, users
        self.pending: Optional[Pending] = None
        self.error: Optional[BaseException] = None


_tickets: Dict[int, _Ticket] = {}
_ticket_ids = itertools.count()
_tickets_lock = threading.Lock()


def _ticket(ticket_id: int, release: bool = False) -> _Ticket:
    with _tickets_lock:
        ticket = _tickets[ticket_id]
        if release:
            ticket.users -= 1
            if ticket.users == 0:
                del _tickets[ticket_id]
        return ticket


class _PushGradient(mx.operator.CustomOp):
    """Engine operator: runs as soon as the gradient is computed (overlapping the rest of the
    backward pass), sums it over the local devices and hands it to the dgt worker.  It never
    waits for the network."""

    def __init__(self, ticket_id: int):
        super().__init__()
        self._ticket_id = ticket_id

    def forward(self, is_train, req, in_data, out_data, aux):
        ticket = _ticket(self._ticket_id)
        try:
            total = ticket.store._host_buffer(ticket.key, in_data[0])
            _copy_to_host(in_data[0], total)
            for array in in_data[1:]:
                total += array.asnumpy()
            ticket.pending = ticket.store._worker.pushpull(ticket.key, total, ticket.stats)
        except Exception as exc:
            ticket.error = exc
            ticket.store._remember_error(exc)
            raise
        self.assign(out_data[0], req[0], mx.nd.zeros(1))

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        raise RuntimeError("dgt_push has no gradient")


class _AwaitResult(mx.operator.CustomOp):
    """Engine operator: wait for the reply of a push and write it into the output array.

    Its extra input is the push operator's output, so the engine starts it only after the push
    left; every waiting operator has its own thread (MXNet starts custom-operator threads on
    demand), so waits never block pushes.
    """

    def __init__(self, ticket_id: int):
        super().__init__()
        self._ticket_id = ticket_id

    def forward(self, is_train, req, in_data, out_data, aux):
        ticket = _ticket(self._ticket_id, release=True)
        try:
            if ticket.error is not None:
                raise ticket.error
            result = ticket.pending.wait()
        except Exception as exc:  # keep the real error for the next kvstore call
            ticket.store._remember_error(exc)
            raise
        self.assign(out_data[0], req[0], _wrap(result, out_data[0].shape))

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        raise RuntimeError("dgt_await has no gradient")


@mx.operator.register("dgt_push")
class _PushGradientProp(mx.operator.CustomOpProp):
    def __init__(self, ticket, num_inputs="1"):
        super().__init__(need_top_grad=False)
        self._ticket_id = int(ticket)
        self._num_inputs = int(num_inputs)

    def list_arguments(self):
        return [f"grad{i}" for i in range(self._num_inputs)]

    def list_outputs(self):
        return ["token"]

    def infer_shape(self, in_shape):
        return in_shape, [(1,)], []

    def infer_type(self, in_type):
        return in_type, [np.float32], []

    def create_operator(self, ctx, shapes, dtypes):
        return _PushGradient(self._ticket_id)


@mx.operator.register("dgt_await")
class _AwaitResultProp(mx.operator.CustomOpProp):
    def __init__(self, ticket):
        super().__init__(need_top_grad=False)
        self._ticket_id = int(ticket)

    def list_arguments(self):
        return ["data", "token"]

    def list_outputs(self):
        return ["output"]

    def infer_shape(self, in_shape):
        return in_shape, [in_shape[0]], []

    def infer_type(self, in_type):
        return in_type, [in_type[0]], []

    def create_operator(self, ctx, shapes, dtypes):
        return _AwaitResult(self._ticket_id)


def _copy_to_host(array, out: np.ndarray) -> None:
    """``out[:] = array.asnumpy()`` without allocating (the C call ``asnumpy`` makes)."""
    check_call(_LIB.MXNDArraySyncCopyToCPU(array.handle, out.ctypes.data_as(ctypes.c_void_p),
                                           ctypes.c_size_t(out.size)))


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
        self._host_buffers: Dict[int, np.ndarray] = {}
        self._staging_arrays: Dict[tuple, object] = {}
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
        for k, v, o in self._zip(key, value, targets):
            key_id = self._key_id(k)
            values, outs = _as_list(v), _as_list(o)
            ticket_id = next(_ticket_ids)
            with _tickets_lock:
                _tickets[ticket_id] = _Ticket(self, key_id, self._worker.begin(key_id), len(outs))
            token = mx.nd.Custom(*values, op_type="dgt_push", ticket=str(ticket_id),
                                 num_inputs=str(len(values)))
            if out is None:  # gradients: default layout, written in place
                for target in outs:
                    mx.nd.Custom(target, token, op_type="dgt_await", ticket=str(ticket_id),
                                 out=target)
                continue
            # Weights may be in MKLDNN layout after an inference forward, and a custom operator
            # cannot write those ("can't generate TBlob for MKLDNN data"): the reply lands in a
            # staging array of ours, then an NDArray copy (which reorders) fills each target.
            for index, target in enumerate(outs):
                staging = self._staging(key_id, index, target)
                mx.nd.Custom(staging, token, op_type="dgt_await", ticket=str(ticket_id),
                             out=staging)
                target[:] = staging

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
                pending = self._worker.pull(key_id, _as_list(o)[0].asnumpy())
            result = pending.wait()
            for target in _as_list(o):
                target[:] = _wrap(result, target.shape)

    # -- control ------------------------------------------------------------------------------
    def set_optimizer(self, optimizer):
        """Run ``optimizer`` on the servers; pushes then return updated weights."""
        self._raise_pending_error()
        self._optimizer = optimizer
        self._worker.set_optimizer(pickle.dumps(optimizer, 0))

    def set_gradient_compression(self, compression_params):
        raise LocalProtocolError(
            "dgt does its own gradient reduction; MXNet gradient compression cannot be "
            "combined with it (drop compression_params, or use kvstore='dist_sync')")

    def barrier(self):
        self._raise_pending_error()
        self._worker.barrier()

    def _barrier(self):
        self.barrier()

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Save the server-side optimizer's states (momentum, ...) to ``fname``.

        Unlike ``dist_sync``, which cannot, dgt fetches them from every server."""
        self._raise_pending_error()
        mx.nd.waitall()
        blobs = self._worker.get_optimizer_states(dump_optimizer)
        with open(fname, "wb") as f:
            pickle.dump({"dgt_optimizer_states": blobs}, f)

    def load_optimizer_states(self, fname):
        """Load states saved by :meth:`save_optimizer_states` into the servers.  Call it on
        every worker, or on one before training starts (loading is idempotent)."""
        self._raise_pending_error()
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
        self._worker.close()

    # -- helpers ------------------------------------------------------------------------------
    def _staging(self, key_id: int, index: int, like):
        """A default-layout NDArray per (key, output), reused every step (the engine orders
        each step's write after the previous step's copy out of it)."""
        staging = self._staging_arrays.get((key_id, index))
        if staging is None or staging.shape != like.shape or staging.dtype != like.dtype:
            staging = mx.nd.empty(like.shape, ctx=like.context, dtype=like.dtype)
            self._staging_arrays[(key_id, index)] = staging
        return staging

    def _host_buffer(self, key_id: int, like) -> np.ndarray:
        """The numpy buffer a key's gradient is copied into, reused every step: the worker
        is done with the previous step's copy once its reply arrived, which the engine
        orders before the next backward pass writes this gradient again."""
        buffer = self._host_buffers.get(key_id)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = np.empty(like.shape, dtype=like.dtype)
            self._host_buffers[key_id] = buffer
        return buffer

    def _key_id(self, key) -> int:
        if isinstance(key, str):
            # Module uses parameter names; ids in first-use order, as MXNet's own stores do,
            # so the server-side optimizer sees the same indices as with dist_sync.
            if key not in self._key_ids:
                self._key_ids[key] = len(self._key_ids)
            return self._key_ids[key]
        key = int(key)
        if self._key_ids and key in self._key_ids.values():
            raise LocalProtocolError(f"integer key {key} collides with a string key; use one "
                                     "kind of key per store")
        return key

    def _zip(self, key, value, out):
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
