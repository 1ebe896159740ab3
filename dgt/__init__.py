"""dgt: Differential Gradient Transmission for MXNet.

``import dgt`` makes ``kvstore='dgt'`` available to MXNet: if mxnet is already imported the
``DGT`` store is registered now, otherwise as soon as mxnet is imported.  Importing dgt never
imports mxnet by itself (the server does not need it, and importing mxnet in a process with
``DMLC_ROLE=server`` would start MXNet's own server).
"""
from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from typing import Any, Dict

from ._version import __version__
from .config import Config
from .errors import (ConfigError, DGTError, LocalProtocolError, PeerLost, RemoteProtocolError,
                     StepTimeout)

__all__ = ["__version__", "Config", "configure", "current_config", "report_loss", "DGTError",
           "ConfigError", "LocalProtocolError", "RemoteProtocolError", "PeerLost", "StepTimeout"]

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

_overrides: Dict[str, Any] = {}


def configure(**settings) -> Config:
    """Set configuration for stores MXNet creates later (``mx.kv.create('dgt')`` takes no
    arguments).  Keyword names are :class:`Config` fields; they win over ``DGT_*`` variables.
    Returns the resulting configuration (validated now, so mistakes fail here)."""
    candidate = dict(_overrides)
    candidate.update(settings)
    config = Config.from_env(**candidate)
    _overrides.clear()
    _overrides.update(candidate)
    return config


def current_config() -> Config:
    """The configuration a new store would use: environment plus :func:`configure`."""
    return Config.from_env(**_overrides)


def report_loss(value: float) -> None:
    """Report the training loss to dgt's adaptive threshold (optional; see README)."""
    from .worker import report_loss as _report

    _report(value)


# -- registration with mxnet, without importing it -------------------------------------------
_registered = threading.Event()


def _register_with_mxnet() -> None:
    if _registered.is_set():
        return
    _registered.set()
    try:
        from . import mxnet as _adapter  # noqa: F401  (registers the DGT store)
    except Exception:  # noqa: BLE001 - never break the user's `import mxnet`
        logger.exception("dgt could not register its kvstore with mxnet")


class _PostImportLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _register_with_mxnet()


class _MXNetImportHook(importlib.abc.MetaPathFinder):
    """Registers dgt right after ``import mxnet`` finishes."""

    def find_spec(self, name, path, target=None):
        if name != "mxnet" or _registered.is_set():
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PostImportLoader(spec.loader)
                return spec
        return None


if "mxnet" in sys.modules:
    _register_with_mxnet()
elif not any(isinstance(f, _MXNetImportHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _MXNetImportHook())
