"""Asynchronous operators in MXNet's dependency engine, through its C API.

MXNet's own distributed kvstore pushes an *asynchronous* engine operation per key: it runs when
the gradient is ready and tells the engine it is finished later, from the network thread, when
the reply has arrived.  Nothing blocks a thread meanwhile.  This module does the same from
Python with ``MXEnginePushAsyncND``.  (Custom operators, which dgt used before, cost two
operators and a blocked thread per key and step, several milliseconds of Python each: on a
network of 116 small tensors that was most of the step.)

The completion handle the engine passes is a ``CallbackOnComplete``: three pointers, a C
function and its two arguments, valid only during the call.  We copy the three pointers and
call the function later, exactly once; this is the layout MXNet's extension header
(``lib_api.h``) spells out for libraries outside MXNet, and it is fixed for the pinned 1.9.1.
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import threading
from typing import Callable, Dict, Sequence

import mxnet as mx
from mxnet.base import _LIB, check_call

__all__ = ["HostBuffers", "push_async", "host_view", "sum_into"]

logger = logging.getLogger(__name__)

_ASYNC_FUNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_ON_COMPLETE_FUNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


class _CallbackOnComplete(ctypes.Structure):
    _fields_ = [("callback", ctypes.c_void_p), ("engine", ctypes.c_void_p),
                ("param", ctypes.c_void_p)]


class _Context(ctypes.Structure):
    _fields_ = [("dev_type", ctypes.c_int), ("dev_id", ctypes.c_int)]


_CPU = _Context(1, 0)
# FnProperty::kCPUPrioritized: MXNet's own kvstore reductions use it; such operators run on a
# pool of their own threads, so a push never queues behind the backward pass's compute.
_CPU_PRIORITIZED = ctypes.c_int(3)


class Completion:
    """Tell the engine that one asynchronous operator finished.  Call it exactly once, from any
    thread."""

    __slots__ = ("_callback", "_engine", "_param", "_done")

    def __init__(self, handle: _CallbackOnComplete):
        self._callback = _ON_COMPLETE_FUNC(handle.callback)
        self._engine, self._param = handle.engine, handle.param
        self._done = False

    def __call__(self) -> None:
        if self._done:
            return
        self._done = True
        self._callback(self._engine, self._param, None)


_bodies: Dict[int, Callable[[Completion], None]] = {}
_body_ids = itertools.count(1)
_bodies_lock = threading.Lock()


def _run(run_context, on_complete, param) -> None:
    """Entry point of every dgt operator, on an engine thread."""
    with _bodies_lock:
        body = _bodies.pop(param)
    handle = ctypes.cast(on_complete, ctypes.POINTER(_CallbackOnComplete)).contents
    completion = Completion(handle)
    try:
        body(completion)
    except BaseException:  # noqa: BLE001 - the engine must hear back, or every reader hangs
        logger.exception("dgt engine operator failed")
        completion()


_RUN = _ASYNC_FUNC(_run)  # kept alive for the life of the process


def push_async(body: Callable[[Completion], None], reads: Sequence, writes: Sequence,
               priority: int = 0, name: str = "dgt_pushpull") -> None:
    """Enqueue ``body(completion)`` after every pending write of ``reads`` and every pending
    access of ``writes`` (NDArrays), as one engine operator.

    ``body`` runs on an engine thread and must not wait; it arranges for ``completion()`` to be
    called once the ``writes`` hold their new values (from any thread).  Until then, readers of
    ``writes`` and writers of ``reads`` wait.  An exception in ``body`` is logged and completes
    the operator.  The arrays must be default-layout CPU arrays that ``body`` accesses through
    :func:`host_view`: the engine C API cannot wait for them inside an operator.
    """
    with _bodies_lock:
        param = next(_body_ids)
        _bodies[param] = body
    read_handles = (ctypes.c_void_p * max(1, len(reads)))(*[a.handle for a in reads])
    write_handles = (ctypes.c_void_p * max(1, len(writes)))(*[a.handle for a in writes])
    try:
        check_call(_LIB.MXEnginePushAsyncND(
            _RUN, ctypes.c_void_p(param), None, ctypes.byref(_CPU),
            read_handles, ctypes.c_int(len(reads)), write_handles, ctypes.c_int(len(writes)),
            ctypes.byref(_CPU_PRIORITIZED), ctypes.c_int(priority), ctypes.c_char_p(name.encode()),
            ctypes.c_bool(False)))
    except BaseException:
        with _bodies_lock:
            _bodies.pop(param, None)
        raise


def host_view(array, numpy_dtype):
    """A numpy array over the memory of a default-layout CPU NDArray (no copy).

    Valid while the NDArray lives; obtain it before the array is used by operators (the C call
    waits for pending writes)."""
    import numpy as np

    pointer = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(array.handle, ctypes.byref(pointer)))
    count = int(np.prod(array.shape))
    buffer = (ctypes.c_byte * (count * np.dtype(numpy_dtype).itemsize)).from_address(pointer.value)
    return np.frombuffer(buffer, dtype=numpy_dtype, count=count)


def sum_into(values: Sequence, target) -> None:
    """Enqueue ``target = sum(values)`` (one device's gradient, or several devices' summed):
    engine copies, which wait for backward and reorder MKLDNN layouts into ``target``'s."""
    if len(values) == 1:
        values[0].copyto(target)
    else:
        mx.nd.add_n(*[a.as_in_context(target.context) for a in values], out=target)


class HostBuffers:
    """A send and a receive buffer of one shape: our own default-layout CPU NDArrays, so an
    engine operator can touch them through numpy views (``send_host``, ``recv_host``, flat)."""

    def __init__(self, shape, dtype):
        self.send = mx.nd.empty(shape, ctx=mx.cpu(), dtype=dtype)
        self.recv = mx.nd.empty(shape, ctx=mx.cpu(), dtype=dtype)
        self.send_host = host_view(self.send, self.send.dtype)
        self.recv_host = host_view(self.recv, self.recv.dtype)

    def fits(self, like) -> bool:
        return self.send.shape == like.shape and self.send.dtype == like.dtype
