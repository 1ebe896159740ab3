"""Typed errors.  Local faults (misuse, bad configuration) and remote faults (a peer sent
garbage, a peer vanished) are kept apart so callers can tell whose fault it is."""

__all__ = ["DGTError", "ConfigError", "LocalProtocolError", "RemoteProtocolError",
           "PeerLost", "StepTimeout"]


class DGTError(Exception):
    """Base class of every error dgt raises on purpose."""


class ConfigError(DGTError, ValueError):
    """A configuration value is missing, malformed or out of range."""


class LocalProtocolError(DGTError):
    """This process used the API in a way the protocol does not allow."""


class RemoteProtocolError(DGTError):
    """A peer sent a message that does not decode or does not fit the protocol."""


class PeerLost(DGTError):
    """A server or worker stopped answering or said it is leaving."""


class StepTimeout(DGTError, TimeoutError):
    """A bounded wait ran out (DGT_TIMEOUT_S)."""
