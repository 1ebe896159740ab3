"""dgt's own per-step CPU cost, without the network: scoring, classification, framing, merging.

    python benchmarks/overhead.py [--model alexnet] [--workers 2] [--repeat 5]

Takes the parameter shapes of a model, makes random gradients, and times the pure steps a
worker runs per push (error feedback: the residual added before the push and the unmerged
values kept from the reply; block scores, channel choice, gathering the reliable blocks,
building the datagram rows) and the ones the server runs per step (merging the reliable
parts and the datagrams of every worker, closing the step, and framing the reply of a summing
server: the touched blocks gathered when the reply is sparse), and each worker putting that
reply in place (the sum widened from the wire dtype into float32, a sparse one expanded).
``--server-optimizer`` times the replies of a server that runs the optimizer instead (the
update itself left out, as MXNet's own work): the server's ``DGT_WEIGHTS_REPLY`` payload (whole
weights, or the bfloat16 step from the held copy) and the worker putting it in place (a copy,
or the widening add).  Sockets
are left out: this is the part of a step that dgt adds on top of moving the bytes, to compare
with the measured step time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dgt.config import Config  # noqa: E402
from dgt.kernels import add_bfloat16_, cast  # noqa: E402
from dgt.memory import ResidualMemory  # noqa: E402
from dgt.merge import StepMerger, merge_datagram_batch  # noqa: E402
from dgt.partition import BlockLayout, FragmentLayout, fragment_elems, plan_parts  # noqa: E402
from dgt.policy import assign_channels  # noqa: E402
from dgt.scoring import ContributionState, score_blocks  # noqa: E402
from dgt.wire import (BFLOAT16, HEADER_BYTES, Header, MsgType, chunk_elems,  # noqa: E402
                      decode_blocks, dtype_code, frame_datagrams, sum_reply_frames)
from dgt.weights import HeldWeights  # noqa: E402


def model_shapes(name: str):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "examples"))
    import mxnet as mx
    from models import INPUT_SIZE, get_model

    net = get_model(name)
    net.initialize()
    size = INPUT_SIZE[name]
    net(mx.nd.zeros((1, 1, size, size)))
    return [p.shape for _, p in sorted(net.collect_params().items())]


class WeightsReplies:
    """A server-side optimizer's weights per part, the server's held copy and every worker's
    weights: the state the replies of ``--server-optimizer`` run on."""

    def __init__(self, config, rank_count):
        self.held = HeldWeights(config.weights_reply == "delta")
        self.rank_count = rank_count
        self.weights, self.workers = {}, {}
        self.rng = np.random.default_rng(2)

    def server_reply(self, ident, n_elems, gradient_dtype):
        """The reply's payload after an (untimed) optimizer step; ``(payload, is_delta,
        seconds)``."""
        weights = self.weights.get(ident)
        if weights is None:
            weights = self.weights[ident] = self.rng.uniform(-1, 1, n_elems).astype(np.float32)
            self.workers[ident] = [weights.copy() for _ in range(self.rank_count)]
        weights -= np.float32(1e-3) * weights  # stands for the optimizer: a small step
        began = time.perf_counter()
        payload, is_delta = self.held.reply(ident, weights, gradient_dtype)
        return payload, is_delta, time.perf_counter() - began

    def worker_apply(self, ident, payload, is_delta):
        """Every worker puts the reply in place, as ``Worker._fill`` / ``_fill_delta`` do;
        returns the seconds per worker."""
        began = time.perf_counter()
        for held in self.workers[ident]:
            if is_delta:
                add_bfloat16_(held, payload)
            else:
                held[:] = payload
        return (time.perf_counter() - began) / self.rank_count


def one_step(config, shapes, grads, states, merger, step, rank_count, udp_loss=0.0, rng=None,
             batch_datagrams=60, replies=None):
    worker_s = server_s = 0.0
    # DGT_WIRE_DTYPE=bfloat16: what travels is rounded on the way (timed with the worker).
    wire = BFLOAT16 if config.wire_dtype == "bfloat16" else np.dtype(np.float32)
    code, itemsize = dtype_code(wire), wire.itemsize
    for key, grad in enumerate(grads):
        for part in plan_parts(grad.size, key, 1, config.bigarray_elems, config.part_elems):
            values = grad[part.start:part.stop]
            blocks = BlockLayout(part.n_elems, config.block_elems)
            fe = fragment_elems(config.block_elems, itemsize, config.udp_payload_bytes)
            layout = FragmentLayout(blocks, fe)
            pushes = []
            began = time.perf_counter()
            for rank in range(rank_count):
                memory, scores, scratch = states[rank]
                # The worker's per-part buffers, reused every step as it reuses them.
                gathered, into = scratch.setdefault(
                    (key, part.index), (np.empty(part.n_elems, wire), np.empty_like(values)))
                compensated = (memory.compensate((key, part.index), values, out=into)
                               if config.error_feedback else values)
                if blocks.n_blocks > 1:
                    s = score_blocks(scores, (key, part.index), blocks, compensated)
                    channels = assign_channels(s, config.threshold, config.udp_channels)
                else:
                    channels = np.zeros(1, dtype=np.uint8)
                reliable = np.flatnonzero(channels == 0)
                # As the worker does: the cast to the wire dtype happens on the way into the
                # payload (`gathered` is in the wire dtype) and into the datagram rows.
                payload = blocks.gather(compensated, reliable, out=gathered)
                udp = np.flatnonzero(channels)
                udp = udp[np.argsort(channels[udp], kind="stable")]
                slots = layout.slots_of_blocks(udp)
                base = Header(MsgType.DATA, rank=rank, dtype=code, key=key, part=part.index,
                              step=step, n_elems=part.n_elems, block_elems=config.block_elems,
                              frag_elems=fe)
                datagrams = frame_datagrams(base, layout, compensated, channels, slots, wire)
                pushes.append((reliable, payload, compensated, slots, datagrams))
            worker_s += (time.perf_counter() - began) / rank_count
            # What the server receives: the datagrams as its receive buffer holds them, one
            # row each, with their sizes (built here, untimed, as the socket layer fills it).
            received = [(reliable, payload, *receive_buffer(datagrams, len(slots)))
                        for reliable, payload, _, slots, datagrams in pushes]
            known = np.ones(rank_count, dtype=bool)
            began = time.perf_counter()
            for rank, (reliable, payload, rows, sizes) in enumerate(received):
                header = Header(MsgType.PUSH, rank=rank, dtype=code, key=key, part=part.index,
                                step=step, n_elems=part.n_elems, block_elems=config.block_elems,
                                frag_elems=fe, block=len(reliable), udp_expected=len(sizes))
                groups = blocks.chunk_blocks(reliable, chunk_elems(itemsize))
                chunks, offset = [], 0
                for group in groups:
                    size = blocks.payload_elems(group)
                    chunks.append(payload[offset:offset + size])
                    offset += size
                merger.add_push(header, reliable, chunks, 0.0)
                if len(sizes):
                    if udp_loss:
                        arrived = np.flatnonzero(rng.random(len(sizes)) >= udp_loss)
                        rows, sizes = rows[arrived], sizes[arrived]
                    # Batch by batch, through the server's own path (checks, runs, merge).
                    for lo in range(0, len(sizes), batch_datagrams):
                        merge_datagram_batch(merger, rows[lo:lo + batch_datagrams],
                                             sizes[lo:lo + batch_datagrams], 0, known)
                    merger.add_push_end(header._replace(type=MsgType.PUSH_END), 0.0)
            closed = merger.poll(0.0)
            assert closed, "the step should close once everything arrived"
            frames = []
            if replies is None:
                for step_closed in closed:  # the reply of a summing server (optimizer on workers)
                    frames.append(sum_reply_frames(step_closed.merged, step_closed.touched_blocks,
                                                   step_closed.block_elems))
            server_s += time.perf_counter() - began
            if frames:
                # Each worker widens the sum into its float32 result, as Worker._fill (dense)
                # or Worker._fill_sparse does; one worker's time, all do the same.
                result = states[0][2].setdefault(("reply", key, part.index),
                                                 np.empty(part.n_elems, np.float32))
                began = time.perf_counter()
                for index_frames, n_blocks, chunks in frames:
                    sum_reply_into(result, blocks, index_frames, n_blocks, chunks, wire)
                worker_s += time.perf_counter() - began
            if replies is not None:
                payload, is_delta, seconds = replies.server_reply((key, part.index),
                                                                  part.n_elems, wire)
                server_s += seconds
                worker_s += replies.worker_apply((key, part.index), payload, is_delta)
            if config.error_feedback:
                # The reply's half of error feedback: each worker keeps the values of its
                # datagrams that were not merged, for the next step's compensate above.
                began = time.perf_counter()
                for step_closed in closed:
                    for rank, (_, _, compensated, _, _) in enumerate(pushes):
                        missing = np.flatnonzero(step_closed.missing[rank])
                        states[rank][0].remember((key, part.index), compensated,
                                                 *layout.slot_ranges(missing))
                worker_s += (time.perf_counter() - began) / rank_count
    return worker_s, server_s


def sum_reply_into(result, blocks, index_frames, n_blocks, chunks, wire):
    """A summing server's reply (:func:`dgt.wire.sum_reply_frames`) put into the float32
    ``result`` of its part: the worker's dense or sparse fill, without the socket."""
    if index_frames:
        found, payloads = decode_blocks(blocks, n_blocks, index_frames[0], chunks, wire)
        payload = payloads[0] if len(payloads) == 1 else np.concatenate(payloads)
        blocks.expand_(result, found, payload)
        return
    offset = 0
    for chunk in chunks:
        data = chunk.view(wire)  # bfloat16 frames travel as their uint16 view
        result[offset:offset + data.size] = data
        offset += data.size
    assert offset == result.size, "the dense reply covers the part"


def receive_buffer(datagrams, count):
    """``(rows, sizes)``: ``count`` datagrams as a server's receive buffer holds them, one
    uint8 row each (the full-size fragments, then the short ones zero-padded)."""
    width = max([datagrams.rows.shape[1]]
                + [HEADER_BYTES + len(body) for body in datagrams.odd_payloads])
    rows = np.zeros((count, width), np.uint8)
    sizes = np.full(count, width, np.int64)
    rows[:len(datagrams.rows)] = datagrams.rows
    heads = np.frombuffer(datagrams.odd_headers, np.uint8).reshape(-1, HEADER_BYTES)
    for i, (head, body) in enumerate(zip(heads, datagrams.odd_payloads),
                                     start=len(datagrams.rows)):
        rows[i, :HEADER_BYTES], rows[i, HEADER_BYTES:HEADER_BYTES + len(body)] = head, body
        sizes[i] = HEADER_BYTES + len(body)
    return rows, sizes


def plain_sum_step(grads, accumulators, rank_count):
    """What any parameter server does for the same bytes (MXNet's dist_sync server included):
    the first worker's gradient copied into the accumulator, the others added to it."""
    began = time.perf_counter()
    for grad, accumulator in zip(grads, accumulators):
        np.copyto(accumulator, grad)
        for _ in range(rank_count - 1):
            np.add(accumulator, grad, out=accumulator)
    return time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="alexnet", choices=("alexnet", "vgg11", "googlenet"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--udp-loss", type=float, default=0.0,
                        help="share of datagrams lost (seeded), 0..1: at the testbed's 90 %% "
                             "the summing server's replies become sparse")
    parser.add_argument("--batch-datagrams", "--run-datagrams", type=int, default=60,
                        help="datagrams per receive batch, each merged by the server's "
                             "merge_datagram_batch (default 60, the most a batch holds; a "
                             "server under a rate limit drains fewer per turn of its loop: "
                             "udp_merged / udp_batches in its counters line)")
    parser.add_argument("--server-optimizer", action="store_true",
                        help="the replies of a server that runs the optimizer: weights, as "
                             "DGT_WEIGHTS_REPLY says, instead of the sum")
    args = parser.parse_args()
    if not 0.0 <= args.udp_loss <= 1.0:
        parser.error(f"--udp-loss must be within 0..1 (got {args.udp_loss})")
    if args.batch_datagrams < 1:
        parser.error(f"--batch-datagrams must be at least 1 (got {args.batch_datagrams})")
    config = Config.from_env()
    shapes = model_shapes(args.model)
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(int(np.prod(s))).astype(np.float32) for s in shapes]
    states = [(ResidualMemory(), ContributionState(config.score_alpha), {})
              for _ in range(args.workers)]
    merger = StepMerger(args.workers, config.receive_mode, grace_s=0.0,
                        error_feedback=config.error_feedback)
    loss_rng = np.random.default_rng(1)
    replies = WeightsReplies(config, args.workers) if args.server_optimizer else None
    times = [one_step(config, shapes, grads, states, merger, step, args.workers, args.udp_loss,
                      loss_rng, args.batch_datagrams, replies)
             for step in range(args.repeat + 1)][1:]
    accumulators = [np.empty_like(g) for g in grads]
    plain_ms = statistics.median(plain_sum_step(grads, accumulators, args.workers)
                                 for _ in range(args.repeat + 1)) * 1000
    worker_ms = statistics.median(t[0] for t in times) * 1000
    server_ms = statistics.median(t[1] for t in times) * 1000
    params = sum(g.size for g in grads)
    print(f"{args.model}: {params / 1e6:.1f} M parameters, k={config.threshold}, "
          f"{args.workers} workers, error feedback {'on' if config.error_feedback else 'off'}, "
          f"UDP loss {args.udp_loss:.0%}, wire dtype {config.wire_dtype}, "
          f"{args.batch_datagrams} datagrams per receive batch, "
          + (f"optimizer on the servers, weights replies {config.weights_reply} "
             if args.server_optimizer else "optimizer on the workers ")
          + "(the defaults; DGT_* variables change them)")
    worker_work = "feedback, score, classify, frame, put the reply in place"
    print(f"worker CPU per step ({worker_work}): {worker_ms:7.1f} ms")
    print(f"server CPU per step (merge {args.workers} workers, close, frame the reply): "
          f"{server_ms:7.1f} ms")
    print(f"  of which a plain dense sum of {args.workers} gradients (any PS server): "
          f"{plain_ms:7.1f} ms; dgt's own server work: {server_ms - plain_ms:7.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
