"""MXNet adapter.  Importing it registers the ``dgt`` kvstore (the one intended import side
effect); ``import dgt`` does it for you once mxnet is imported."""
from .kvstore import DGT

__all__ = ["DGT"]
