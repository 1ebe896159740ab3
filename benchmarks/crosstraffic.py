"""Background cross-traffic for the testbed: another tenant's load on the links a job uses.

    python -m benchmarks.crosstraffic --peer 10.213.77.2 --rate-mbit 250 [--precedence 0]

One process per loaded node, started in the node's namespace by
:meth:`benchmarks.testbed.Testbed.start_cross_traffic`.  It sends an open-loop UDP flow of
``--rate-mbit`` (Ethernet frames included) to its peer's discard port, in full 1514-byte
frames, with the IP precedence ``--precedence`` in its TOS byte.  Open loop, as a video stream
or a storage replication would be: the flow does not back off when the link is full, so the
priority classes decide who loses.

The load must not eat the CPUs the job needs, so the frames leave :data:`SEGMENTS` at a time
through UDP segmentation offload (Linux >= 4.18; it refuses to start without it): one system
call, and one 64 KB packet through the queues and the bridge, per 44 frames.  Nothing listens on
the discard port, so the receiving kernel drops each packet whole at its UDP layer (the ICMP
errors it answers with are rate-limited to about one a second).

The testbed queues this flow in a class of its own (matched on the port) with the priority
and queue length of its precedence, so its bytes are counted exactly and kept out of the
job's byte counts (:func:`interface_bytes` turns the class's count into the interfaces').
"""
from __future__ import annotations

import argparse
import errno
import socket
import sys
import time

DISCARD_PORT = 9  # RFC 863: never used by the jobs the benchmark runs
HEADER_BYTES = 14 + 20 + 8  # Ethernet, IP, UDP
FRAME_BYTES = 1514
PAYLOAD_BYTES = FRAME_BYTES - HEADER_BYTES
SEGMENTS = 44  # frames per send: 44 * 1472 bytes stay under the 64 KB of one IP packet
SOL_UDP = getattr(socket, "SOL_UDP", 17)
UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
MAX_LAG_S = 0.1  # behind by more (CPU contention): restart the schedule instead of bursting


def send_interval_s(rate_mbit: float) -> float:
    """Seconds between sends of :data:`SEGMENTS` frames so that they average ``rate_mbit``."""
    return SEGMENTS * FRAME_BYTES * 8 / (rate_mbit * 1e6)


def interface_bytes(class_bytes: int, class_frames: int) -> int:
    """The bytes that interface counters see for what a queue counted as ``class_bytes`` in
    ``class_frames`` frames.  A queue counts a segmented packet as its frames, headers
    included; an interface that passes the packet unsegmented (veth, the bridge) counts the
    headers once per packet."""
    return class_bytes - (class_frames - class_frames // SEGMENTS) * HEADER_BYTES


def run(peer: str, rate_mbit: float, precedence: int, port: int = DISCARD_PORT,
        duration_s: float = 0.0) -> int:
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sender.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, precedence << 5)
    sender.setsockopt(SOL_UDP, UDP_SEGMENT, PAYLOAD_BYTES)
    payload = bytes(SEGMENTS * PAYLOAD_BYTES)
    interval = send_interval_s(rate_mbit)
    sent = 0
    started = next_send = time.monotonic()
    while not duration_s or time.monotonic() - started < duration_s:
        try:
            sender.sendto(payload, (peer, port))
            sent += SEGMENTS
        except OSError as exc:
            if exc.errno in (errno.EIO, errno.EINVAL, errno.ENOPROTOOPT):  # no UDP GSO
                sys.stderr.write(f"cross traffic needs UDP segmentation offload: {exc}\n")
                return 1
        next_send += interval
        delay = next_send - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        elif delay < -MAX_LAG_S:
            next_send = time.monotonic()
    sys.stdout.write(f"{sent} frames\n")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.crosstraffic",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", required=True, help="address the flow goes to")
    parser.add_argument("--rate-mbit", type=float, required=True)
    parser.add_argument("--precedence", type=int, default=0, help="IP precedence, 0..7")
    parser.add_argument("--port", type=int, default=DISCARD_PORT)
    parser.add_argument("--duration-s", type=float, default=0.0, help="0: until stopped")
    args = parser.parse_args(argv)
    if not args.rate_mbit > 0:
        parser.error(f"--rate-mbit must be > 0 (got {args.rate_mbit:g})")
    if not 0 <= args.precedence <= 7:
        parser.error(f"--precedence must be within 0..7 (got {args.precedence})")
    return run(args.peer, args.rate_mbit, args.precedence, args.port, args.duration_s)


if __name__ == "__main__":
    sys.exit(main())
