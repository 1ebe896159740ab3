"""Background cross-traffic for the testbed: another tenant's load on the links a job uses.

    python -m benchmarks.crosstraffic --peer 10.213.77.2 --rate-mbit 250 [--precedence 0]

One process per loaded node, started in the node's namespace by
:meth:`benchmarks.testbed.Testbed.start_cross_traffic`.  It sends an open-loop UDP flow of
``--rate-mbit`` (Ethernet frames included) to its peer's discard port, in full 1514-byte
frames, with the IP precedence ``--precedence`` in its TOS byte.  Open loop, as a video stream
or a storage replication would be: the flow does not back off when the link is full, so the
priority classes decide who loses.  It also binds the discard port itself, so that the flow
coming from its own peer is taken (and dropped by the kernel once the socket buffer is full)
without ICMP errors travelling back.

The testbed queues this flow in a class of its own (matched on the port) with the priority
and queue length of its precedence, so its bytes are counted exactly and kept out of the
job's byte counts.
"""
from __future__ import annotations

import argparse
import socket
import sys
import time

DISCARD_PORT = 9  # RFC 863: never used by the jobs the benchmark runs
FRAME_BYTES = 1514  # Ethernet header 14 + IP 20 + UDP 8 + payload
PAYLOAD_BYTES = FRAME_BYTES - 14 - 20 - 8
BURST_PERIOD_S = 0.001  # sleep granularity: send a burst of frames about every millisecond
MAX_LAG_S = 0.1  # behind by more (CPU contention): restart the schedule instead of bursting


def frames_per_burst(rate_mbit: float) -> int:
    return max(1, round(rate_mbit * 1e6 / 8 / FRAME_BYTES * BURST_PERIOD_S))


def burst_interval_s(rate_mbit: float) -> float:
    """Seconds between bursts so that the frames average ``rate_mbit``."""
    return frames_per_burst(rate_mbit) * FRAME_BYTES * 8 / (rate_mbit * 1e6)


def run(peer: str, rate_mbit: float, precedence: int, port: int = DISCARD_PORT,
        duration_s: float = 0.0) -> int:
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    sink.bind(("0.0.0.0", port))
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sender.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, precedence << 5)
    sender.connect((peer, port))
    payload = bytes(PAYLOAD_BYTES)
    burst, interval = frames_per_burst(rate_mbit), burst_interval_s(rate_mbit)
    sent = 0
    started = next_burst = time.monotonic()
    while not duration_s or time.monotonic() - started < duration_s:
        for _ in range(burst):
            try:
                sender.send(payload)
                sent += 1
            except OSError:  # ECONNREFUSED from an ICMP error before the peer bound its port
                pass
        next_burst += interval
        delay = next_burst - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        elif delay < -MAX_LAG_S:
            next_burst = time.monotonic()
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
