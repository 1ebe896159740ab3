"""Per-step statistics of a worker, written as JSON lines.

One record per worker per *step*, where a step is one round over the keys (it starts when the
first key the worker ever pushed is pushed again).  Counts are datagrams for UDP and blocks for
the split; bytes are gradient payload bytes, headers excluded.  A step is recorded once the
next one has begun *and* every push it made has been answered (or failed): MXNet's engine lets
the training loop begin the next step while this one's pushes still run.
"""
from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field
from typing import List, Optional

__all__ = ["StepStats", "JsonLinesSink"]


@dataclass
class StepStats:
    step: int
    rank: int
    k: float
    channels: int
    started_s: float  # time.time() of the first push of the step
    bytes_per_channel: List[int] = field(default_factory=list)
    blocks_per_channel: List[int] = field(default_factory=list)
    datagrams_sent: int = 0
    datagrams_injected_loss: int = 0  # dropped by DGT_UDP_DROP before reaching the socket
    datagrams_send_errors: int = 0
    udp_expected: int = 0  # datagrams the servers waited for
    udp_merged: int = 0
    udp_lost: int = 0  # expected - merged
    udp_late: int = 0  # late datagrams (merged into the next step in diff mode, else dropped)
    feedback_elems: int = 0  # values carried into the next step by error feedback
    grace_ms_max: float = 0.0
    latency_ms: float = 0.0  # first push of the step -> last reply of the step
    reply_bytes: int = 0  # payload bytes of the replies (sparse ones hold touched blocks only)
    # dgt's own CPU time (thread CPU, waits excluded): the pushes' scoring, classification,
    # casting and framing (datagram socket calls excluded) and the replies' decoding and
    # copying into the result.  Compare with the step time for dgt's overhead.
    cpu_ms: float = 0.0
    keys: int = 0
    # Bookkeeping, not written: pushes and replies of this step still to be counted.
    _inflight: int = 0

    def __post_init__(self):
        if not self.bytes_per_channel:
            self.bytes_per_channel = [0] * (self.channels + 1)
            self.blocks_per_channel = [0] * (self.channels + 1)

    def to_json(self) -> str:
        record = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        return json.dumps(record, separators=(",", ":"))


class JsonLinesSink:
    """Appends records to a file, one JSON object per line; thread-safe."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._file: Optional[object] = open(path, "a", encoding="utf-8")

    def write(self, record: StepStats) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(record.to_json() + "\n")
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
