"""Per-channel network priority: IP TOS (DSCP class selector) and Linux socket priority.

Mapping (as the reference, without its sudo/iptables): with C UDP channels, the reliable
channel 0 is class selector CS_C and UDP channel i is CS_(C-i), so the least important UDP
channel is best effort (CS0).  ``SO_PRIORITY`` follows the same order; an unprivileged process
may use 0..6, so levels are capped at 6.  Neither needs root.
"""
from __future__ import annotations

import logging
import socket

__all__ = ["tos_for_channel", "socket_priority_for_channel", "apply_udp_priority"]

logger = logging.getLogger(__name__)
SO_PRIORITY = getattr(socket, "SO_PRIORITY", 12)


def tos_for_channel(channel: int, udp_channels: int) -> int:
    """IP TOS byte: DSCP class selector CS_(C - channel) shifted into the TOS field."""
    return (udp_channels - channel) << 5


def socket_priority_for_channel(channel: int, udp_channels: int) -> int:
    return min(6, udp_channels - channel)


def apply_udp_priority(sock: socket.socket, channel: int, udp_channels: int) -> None:
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos_for_channel(channel, udp_channels))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_PRIORITY,
                        socket_priority_for_channel(channel, udp_channels))
    except OSError as exc:  # not Linux, or a sandbox that forbids it: TOS alone still marks
        logger.debug("SO_PRIORITY not set on UDP channel %d: %s", channel, exc)


def apply_zmq_priority(zsock, udp_channels: int) -> None:
    """Mark a ZeroMQ TCP socket as channel 0 (set before bind/connect to take effect)."""
    import zmq

    zsock.setsockopt(zmq.TOS, tos_for_channel(0, udp_channels))
    try:  # ZMQ_PRIORITY (SO_PRIORITY) exists only in some libzmq builds
        zsock.setsockopt(zmq.PRIORITY, socket_priority_for_channel(0, udp_channels))
    except (AttributeError, zmq.ZMQError) as exc:
        logger.debug("ZMQ_PRIORITY unavailable (%s); TOS alone marks the reliable channel", exc)
