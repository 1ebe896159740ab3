"""A server's datagram path without the network: reading a batch, checking it, merging it.

    python benchmarks/receive.py [--wire bfloat16] [--rows-per-batch 512] [--repeat 5]

Frames the datagrams of AlexNet-sized parts (1 M elements, 70 % of the fragment slots over
UDP, as a worker's `frame_datagrams` writes them), interleaves 2 workers' pushes in runs of 60
(one GSO call each) and cuts them into batches of ``--rows-per-batch`` rows, as a server's
receive buffer holds them.  Then times, best of ``--repeat`` rounds:

* the batch merge (`dgt.merge.merge_datagram_batch`: checks, runs, the merger's adds) per
  step of 4 parts, with the accumulators recycled as the merger does between steps;
* reading datagrams off a loopback socket, with one `recvmmsg` per batch and with one
  `recv_into` per datagram (the fallback), side by side.

CPU time of this thread only; compare checkouts by running this file in each, alternating.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dgt.merge import StepMerger, merge_datagram_batch  # noqa: E402
from dgt.partition import BlockLayout, FragmentLayout, fragment_elems  # noqa: E402
from dgt.transport.udp import UdpReceiver, UdpSender  # noqa: E402
from dgt.wire import (BFLOAT16, HEADER_BYTES, Header, MsgType, dtype_code,  # noqa: E402
                      frame_datagrams)

WORKERS, PARTS, RUN = 2, 4, 60
N_ELEMS, BLOCK_ELEMS, UDP_SHARE, JOB = 1 << 20, 1024, 0.7, 7


def step_batches(wire, layout, step, rows_per_batch, rng):
    """One step's datagrams of every (worker, part), in runs of RUN, cut into batches, and
    how many each (part, rank) sent."""
    pushes, sent = [], {}
    for part in range(PARTS):
        for rank in range(WORKERS):
            base = Header(MsgType.DATA, job=JOB, rank=rank, dtype=dtype_code(wire), key=part,
                          step=step, n_elems=N_ELEMS, block_elems=BLOCK_ELEMS,
                          frag_elems=layout.frag_elems)
            slots = np.flatnonzero(rng.random(layout.n_slots) < UDP_SHARE)
            values = rng.standard_normal(N_ELEMS, dtype=np.float32)
            channels = np.ones(layout.blocks.n_blocks, np.uint8)
            pushes.append(frame_datagrams(base, layout, values, channels, slots, wire).rows)
            sent[(part, rank)] = len(pushes[-1])
    runs = [rows[lo:lo + RUN] for lo in range(0, max(len(r) for r in pushes), RUN)
            for rows in pushes if lo < len(rows)]
    stream = np.concatenate(runs)
    return [stream[lo:lo + rows_per_batch] for lo in range(0, len(stream), rows_per_batch)], sent


def time_merge(wire, rows_per_batch, steps, seed):
    fe = fragment_elems(BLOCK_ELEMS, wire.itemsize, 1400)
    layout = FragmentLayout(BlockLayout(N_ELEMS, BLOCK_ELEMS), fe)
    rng = np.random.default_rng(seed)
    merger = StepMerger(WORKERS, grace_s=0.0)
    known = np.ones(WORKERS, bool)
    buffer = np.zeros((rows_per_batch, 2048), np.uint8)  # a receiver's rows
    spent, datagrams = 0.0, 0
    for step in range(steps):
        batches, sent = step_batches(wire, layout, step, rows_per_batch, rng)
        for batch in batches:
            buffer[:len(batch), :batch.shape[1]] = batch
            sizes = np.full(len(batch), batch.shape[1], np.int64)
            began = time.thread_time()
            merge_datagram_batch(merger, buffer[:len(batch)], sizes, JOB, known)
            spent += time.thread_time() - began
            datagrams += len(batch)
        for part in range(PARTS):  # every datagram came: each step closes at once
            for rank in range(WORKERS):
                push = Header(MsgType.PUSH, job=JOB, rank=rank, dtype=dtype_code(wire),
                              key=part, step=step, n_elems=N_ELEMS, block_elems=BLOCK_ELEMS,
                              frag_elems=fe, udp_expected=sent[(part, rank)])
                merger.add_push(push, np.empty(0, np.int64), [], 0.0)
                merger.add_push_end(push._replace(type=MsgType.PUSH_END), 0.0)
        closed = merger.poll(1.0)
        assert len(closed) == PARTS, "every part's step should close"
    return spent / steps * 1e3, spent / datagrams * 1e6


def time_receive(batched, datagram_bytes, count, rows_per_batch):
    receiver = UdpReceiver("127.0.0.1", 0, 1 << 26, row_bytes=2048, batch_rows=rows_per_batch)
    sender = UdpSender(1, 1 << 26)
    try:
        if not batched:
            receiver._recvmmsg = None
        elif receiver._recvmmsg is None:
            return None
        sent, _ = sender.send_rows(1, receiver.sock.getsockname(),
                                   np.zeros((count, datagram_bytes), np.uint8))
        time.sleep(0.05)
        began, got = time.thread_time(), 0
        while True:
            n = receiver.receive_batch()
            got += n
            if not n:
                break
        return (time.thread_time() - began) / max(got, 1) * 1e6
    finally:
        sender.close()
        receiver.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wire", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rows-per-batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    for name in ("rows_per_batch", "steps", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    wire = BFLOAT16 if args.wire == "bfloat16" else np.dtype(np.float32)
    merges = [time_merge(wire, args.rows_per_batch, args.steps, seed)
              for seed in range(args.repeat)]
    per_step, per_datagram = min(merges)
    print(f"batch merge, {args.wire}, {args.rows_per_batch} rows per batch, {PARTS} parts of "
          f"{N_ELEMS} elements x {WORKERS} workers: {per_step:.1f} ms per step, "
          f"{per_datagram:.2f} us per datagram (best of {args.repeat})")
    datagram_bytes = HEADER_BYTES + 1400
    for batched, label in ((True, "recvmmsg per batch"), (False, "recv_into per datagram")):
        times = [time_receive(batched, datagram_bytes, 3000, args.rows_per_batch)
                 for _ in range(args.repeat)]
        if times[0] is None:
            print(f"receive, {label}: not available on this system")
        else:
            print(f"receive, {label}: {min(times):.2f} us per datagram (best of {args.repeat})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
