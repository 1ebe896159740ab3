"""Workers and servers over real localhost sockets (threads in this process)."""
import json
import logging
import socket
import time

import numpy as np
import pytest

from dgt.errors import RemoteProtocolError, StepTimeout
from dgt.lossmodel import dropped_slots
from dgt.partition import BlockLayout, FragmentLayout, fragment_elems
from dgt.policy import assign_channels
from dgt.scoring import block_mean_abs
from dgt.server import own_cpu_from_log
from dgt.wire import Header, MsgType, encode_header
from dgt.worker import Worker

from ..conftest import run_workers, wait_until

SIZES = (1, 1023, 1024, 1025, 100_000)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_pushpull_of_rank_plus_one_sums_to_six_without_loss(make_job, dtype):
    config, _ = make_job(3, threshold=0.3, threshold_min=0.1, adaptive=False, grace_ms=5000)

    def body(worker):
        pendings = [worker.pushpull(i, np.ones(n, dtype) * (worker.rank + 1))
                    for i, n in enumerate(SIZES)]  # all keys in flight at once
        return [p.wait().copy() for p in pendings], None

    results = run_workers(config, body, 3)
    for rank in range(3):
        for n, result in zip(SIZES, results[rank][0]):
            assert result.dtype == dtype and result.shape == (n,)
            assert (result == 6).all(), f"size {n}"


def delivered_slots(config, rank, key, step, values, k, wire_itemsize=None):
    """Which fragment slots of this worker's push reach the merge: the test's own oracle.
    ``wire_itemsize``: bytes per element on the wire, when the push is cast (bfloat16: 2)."""
    itemsize = wire_itemsize or values.dtype.itemsize
    layout = FragmentLayout(BlockLayout(values.size, config.block_elems),
                            fragment_elems(config.block_elems, itemsize,
                                           config.udp_payload_bytes))
    channels = assign_channels(block_mean_abs(layout.blocks, values), k, config.udp_channels)
    reliable = np.repeat(channels == 0, layout.frags_per_block)
    udp = layout.slots_of_blocks(np.flatnonzero(channels))
    lost = np.zeros(layout.n_slots, dtype=bool)
    lost[udp] = dropped_slots(config.udp_drop, config.seed, rank, key, 0, step, udp)
    return layout, layout.valid_slots & (reliable | ~lost)


def expected_merge(config, key, data, k, mode, wire_dtype=None):
    """The server's merged step 0 of ``key``, computed from the seeded loss: (sum, element
    mask of the blocks some worker's data reached, whether any slot lost a worker).  With
    ``wire_dtype`` (bfloat16) each worker's values are rounded to it before they are summed;
    rounding the sum for the reply is the caller's."""
    n = next(iter(data.values())).size
    expected = np.zeros(n, dtype=np.float64)
    touched = np.zeros(n, dtype=bool)
    counts = 0
    for rank, values in data.items():
        layout, slots = delivered_slots(config, rank, key, 0, values, k,
                                        wire_dtype and np.dtype(wire_dtype).itemsize)
        mask = layout.element_mask(slots)
        sent = values if wire_dtype is None else values.astype(wire_dtype).astype(values.dtype)
        expected[mask] += sent[mask]
        blocks = slots.reshape(layout.blocks.n_blocks, -1).any(axis=1)
        touched |= np.repeat(blocks, config.block_elems)[:n]
        counts = counts + slots
    if mode == "rescale":
        scale = np.where(counts > 0, len(data) / np.maximum(counts, 1), 1.0)
        expected *= np.repeat(scale.reshape(layout.blocks.n_blocks, -1), layout.frag_elems,
                              axis=1)[:, :config.block_elems].reshape(-1)[:n]
    return expected, touched, bool((counts < len(data)).any())


def run_seeded_loss(make_job, workers, n, key, k, mode, feedback, **settings):
    """One pushpull of seeded integer data under seeded loss: (servers, results by rank, and
    :func:`expected_merge`'s oracle).  The grace window is long so that on a loaded machine no
    surviving datagram arrives after its step closed (the oracle assumes none does)."""
    config, servers = make_job(workers, threshold=k, threshold_min=0.1, adaptive=False,
                               grace_ms=1000, receive_mode=mode, error_feedback=feedback,
                               **settings)
    data = {r: np.random.default_rng(r).integers(-8, 9, n).astype(np.float32)
            for r in range(workers)}
    results = run_workers(config, lambda w: w.pushpull(key, data[w.rank]).wait(), workers)
    return servers, results, expected_merge(config, key, data, k, mode)


@pytest.mark.parametrize("mode, feedback", [("drop", False), ("drop", True), ("diff", False),
                                            ("rescale", False)])
def test_seeded_loss_merges_exactly_the_surviving_blocks(make_job, mode, feedback):
    servers, results, (expected, _, some_lost) = run_seeded_loss(
        make_job, 3, 20_000, 7, 0.3, mode, feedback, udp_drop=0.2, seed=11)
    assert some_lost, "the seeded loss should have hit some block"
    for rank in range(3):
        np.testing.assert_allclose(results[rank], expected, rtol=1e-6)
    assert servers[0].server.merger.counters.get("merged", 0) > 0


@pytest.mark.parametrize("may_overwrite", [False, True])
def test_error_feedback_loses_nothing_for_good(make_job, may_overwrite):
    config, _ = make_job(3, threshold=0.3, threshold_min=0.1, adaptive=False, udp_drop=0.3,
                         seed=3, grace_ms=50, error_feedback=True)
    n, steps = 30_000, 6

    def body(worker):
        rng = np.random.default_rng(100 + worker.rank)
        pushed = np.zeros(n)
        merged = np.zeros(n)
        for _ in range(steps):
            grad = rng.integers(-20, 21, n).astype(np.float32)
            pushed += grad
            owed = worker._memory.owed((0, 0))
            lent = grad.copy()
            merged += worker.pushpull(0, lent, may_overwrite=may_overwrite).wait()
            # Lent, the buffer ends as what was pushed: the gradient plus what was owed.
            expected = grad + owed if may_overwrite and owed is not None else grad
            np.testing.assert_array_equal(lent, expected)
        residual = worker._memory.owed((0, 0))
        return pushed, merged, np.zeros(n) if residual is None else residual

    results = run_workers(config, body, 3)
    total_pushed = sum(results[r][0] for r in range(3))
    total_owed = sum(results[r][2] for r in range(3))
    merged = results[0][1]
    assert np.abs(total_owed).sum() > 0, "loss should leave something owed"
    np.testing.assert_array_equal(merged + total_owed, total_pushed)
    np.testing.assert_array_equal(results[1][1], merged)


def test_two_servers_slice_big_tensors_and_shard_small_ones(make_job):
    config, servers = make_job(2, num_servers=2, bigarray_elems=4096, threshold=0.5,
                               adaptive=False, grace_ms=5000)

    def body(worker):
        out = []
        for key, n in enumerate((10, 4095, 4096, 50_001)):
            out.append(worker.pushpull(key, np.full(n, worker.rank + 1, np.float32)).wait())
        return out

    results = run_workers(config, body, 2)
    for result in results[0] + results[1]:
        assert (result == 3).all()
    assert all(s.server.counters["steps_closed"] > 0 for s in servers)


def test_big_tensors_cut_into_parts_on_one_server_sum_exactly(make_job):
    config, servers = make_job(3, part_elems=4096, threshold=0.3, adaptive=False, grace_ms=5000)

    def body(worker):
        return [worker.pushpull(0, np.full(50_001, worker.rank + 1, np.float16)).wait().copy()
                for _ in range(2)]

    results = run_workers(config, body, 3)
    for rank in range(3):
        assert all((r == 6).all() for r in results[rank])
    assert servers[0].server.counters["steps_closed"] == 2 * 13  # 13 parts, 2 steps


def test_broadcast_init_and_pull(make_job):
    config, _ = make_job(2, grace_ms=1000)

    def body(worker):
        mine = np.full(5, 10.0 * (worker.rank + 1), np.float32)
        got = worker.broadcast(0, mine).wait().copy()
        worker.init(1, mine).wait()
        initial = worker.pull(1, mine).wait().copy()
        worker.pushpull(1, mine).wait()
        worker.barrier()
        after = worker.pull(1, mine).wait().copy()
        return got, initial, after

    results = run_workers(config, body, 2)
    for rank in range(2):
        got, initial, after = results[rank]
        assert (got == 10).all() and (initial == 10).all() and (after == 30).all()


def test_garbage_and_foreign_datagrams_are_counted_and_harmless(make_job):
    config, servers = make_job(2, threshold=0.3, adaptive=False, grace_ms=2000)
    server = servers[0]
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    foreign = encode_header(Header(MsgType.DATA, job=1, rank=0, channel=1, dtype=1, n_elems=8,
                                   block_elems=8, frag_elems=8)) + bytes(32)
    for payload in (b"", b"garbage" * 10, bytes(60), foreign):
        sock.sendto(payload, ("127.0.0.1", server.port))
    sock.close()

    def body(worker):
        return worker.pushpull(0, np.full(10_000, worker.rank + 1, np.float32)).wait()

    results = run_workers(config, body, 2)
    assert (results[0] == 3).all() and (results[1] == 3).all()
    assert server.server.counters["udp_malformed"] == 3
    assert server.server.counters["udp_foreign"] == 1


def test_a_missing_server_fails_within_the_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from dgt.config import Config

    start = time.monotonic()
    with pytest.raises(StepTimeout, match="DGT_TIMEOUT_S"):
        Worker(Config(server_addrs=f"127.0.0.1:{port}", timeout_s=1.0, rank=0))
    assert time.monotonic() - start < 5


def test_stats_are_written_as_json_lines(make_job, tmp_path):
    config, _ = make_job(2, threshold=0.3, adaptive=False, udp_drop=0.2, grace_ms=30,
                         stats=str(tmp_path / "stats-{rank}.jsonl"))

    def body(worker):
        for _ in range(3):
            for key in range(2):
                worker.pushpull(key, np.ones(8192, np.float32)).wait()

    run_workers(config, body, 2)
    lines = (tmp_path / "stats-1.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [0, 1, 2]
    first = records[0]
    assert first["keys"] == 2 and first["k"] == 0.3 and len(first["bytes_per_channel"]) == 4
    assert first["bytes_per_channel"][0] > 0 and sum(first["bytes_per_channel"][1:]) > 0
    assert first["udp_expected"] == first["udp_merged"] + first["udp_lost"]
    assert first["datagrams_injected_loss"] > 0 and first["udp_lost"] >= first["datagrams_injected_loss"]


def test_a_step_keeps_the_counts_of_pushes_made_after_the_next_step_began(make_job, tmp_path):
    """MXNet's engine lets the training loop run ahead: the next step's first key is begun
    (in program order) while this step's pushes are still to run.  Their bytes, CPU and
    replies still belong to this step, which is recorded once all of them are answered."""
    n_elems, keys, steps = 8192, 2, 3
    config, _ = make_job(2, threshold=0.5, adaptive=False, grace_ms=30,
                         stats=str(tmp_path / "stats-{rank}.jsonl"))

    def body(worker):
        values = np.ones(n_elems, np.float32)
        held = [(key, worker.begin(key)) for key in range(keys)]
        for step in range(steps):
            following = worker.begin(0) if step + 1 < steps else None  # seals `step`
            for pending in [worker.pushpull(key, values, stats) for key, stats in held]:
                pending.wait()
            if following is not None:
                held = [(0, following)] + [(key, worker.begin(key)) for key in range(1, keys)]
        return worker

    workers = run_workers(config, body, 2)
    for rank in range(2):
        records = [json.loads(line) for line in
                   (tmp_path / f"stats-{rank}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(steps))
        for record in records:  # every block travels on exactly one channel
            assert sum(record["bytes_per_channel"]) == keys * n_elems * 4, record
            assert record["keys"] == keys and record["cpu_ms"] > 0, record
            assert record["bytes_per_channel"][1:] != [0, 0, 0], record  # k = 0.5: UDP too
        totals = workers[rank].totals
        assert totals["steps"] == steps
        assert sum(totals["bytes_per_channel"]) == steps * keys * n_elems * 4
        assert totals["udp_expected"] == sum(r["udp_expected"] for r in records) > 0


def test_dgt_own_cpu_time_is_counted_per_step_on_workers_and_servers(make_job, tmp_path,
                                                                      caplog):
    caplog.set_level(logging.INFO, logger="dgt.server")
    config, servers = make_job(2, threshold=0.3, adaptive=False, udp_drop=0.2, grace_ms=30,
                               stats=str(tmp_path / "stats-{rank}.jsonl"))
    values = np.random.default_rng(0).standard_normal(200_000).astype(np.float32)

    def body(worker):
        walls = []
        for _ in range(3):
            began = time.perf_counter()
            worker.pushpull(0, values).wait()
            walls.append(time.perf_counter() - began)
        return walls, dict(worker.totals)

    results = run_workers(config, body, 2)
    for rank in range(2):
        walls, totals = results[rank]
        records = [json.loads(line) for line in
                   (tmp_path / f"stats-{rank}.jsonl").read_text().splitlines()]
        # Scoring 196 blocks and framing their datagrams takes some CPU every step; the
        # push thread and the I/O thread cannot together spend more than twice the wall time.
        for record, wall_s in zip(records, walls):
            assert 0 < record["cpu_ms"] <= 2 * wall_s * 1000
        # The totals hold the finished steps; the last one finishes when the worker closes.
        assert totals["cpu_ms"] == pytest.approx(sum(r["cpu_ms"] for r in records[:-1]))
    server = servers[0].server
    assert server.own_cpu_s > 0
    servers[0].stop()  # it stopped when both workers left; its exit line is logged by then
    # The benchmarks read it back from the server's exit line.
    assert own_cpu_from_log(caplog.text) == {0: pytest.approx(server.own_cpu_s, abs=1e-6)}


def test_pushes_from_many_short_lived_threads_leak_nothing(make_job):
    """MXNet runs each push on an operator thread, often a new one: nothing may be kept per
    thread (a socket per thread once exhausted ZeroMQ's 1024 sockets after a few hundred
    steps)."""
    import os
    import threading

    config, _ = make_job(1, grace_ms=1000)
    with Worker(config.replace(rank=0)) as worker:
        fds_before = len(os.listdir("/proc/self/fd"))
        for step in range(1500):
            box = {}
            thread = threading.Thread(target=lambda: box.update(
                out=worker.pushpull(0, np.full(64, step, np.float32)).wait().copy()))
            thread.start()
            thread.join()
            assert box["out"][0] == step
        assert len(os.listdir("/proc/self/fd")) <= fds_before + 5


def test_server_zero_assigns_ranks_when_none_is_given(make_job):
    import threading

    config, _ = make_job(2, grace_ms=1000)
    ranks, errors = [], []

    def join():
        try:
            with Worker(config.replace(rank=-1)) as worker:
                ranks.append(worker.rank)
                worker.pushpull(0, np.ones(10, np.float32)).wait()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=join) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and sorted(ranks) == [0, 1]


def test_a_bucket_sums_as_one_key_and_its_members_stay_pullable(make_job):
    from dgt.fusion import FUSED_KEY_BASE

    config, servers = make_job(2, threshold=0.3, adaptive=False, block_elems=256)
    bucket = FUSED_KEY_BASE + 7
    sizes = {3: 1000, 4: 5, 5: 700}  # several blocks: the bucket is scored like any key

    def body(worker):
        members = list(sizes.items())
        worker.define_bucket(bucket, 0, members, np.float32).wait()
        flat = np.concatenate([np.full(n, (worker.rank + 1) * (key + 1), np.float32)
                               for key, n in members])
        merged = worker.pushpull(bucket, flat).wait().copy()
        worker.barrier()
        return merged, worker.pull(4, np.zeros(5, np.float32)).wait().copy()

    results = run_workers(config, body, 2)
    expected = np.concatenate([np.full(n, 3 * (key + 1), np.float32) for key, n in sizes.items()])
    for merged, pulled in results.values():
        np.testing.assert_array_equal(merged, expected)  # 1*(k+1) + 2*(k+1)
        np.testing.assert_array_equal(pulled, np.full(5, 15, np.float32))


def test_workers_that_disagree_on_a_bucket_are_refused(make_job):
    from dgt.fusion import FUSED_KEY_BASE

    config, _ = make_job(2)

    def body(worker):
        members = [(0, 10), (1, 20 + worker.rank)]
        try:
            worker.define_bucket(FUSED_KEY_BASE, 0, members, np.float32).wait()
            return "accepted"
        except RemoteProtocolError as exc:
            return str(exc)

    results = run_workers(config, body, 2)
    assert sorted(results.values())[0] == "accepted"
    assert "disagree" in sorted(results.values())[1]


@pytest.mark.parametrize("mode, feedback", [("drop", False), ("drop", True), ("diff", False),
                                            ("rescale", False)])
def test_heavy_loss_replies_carry_only_touched_blocks_and_still_sum_exactly(make_job, mode,
                                                                             feedback):
    # Few reliable blocks and 90 % UDP loss leave blocks that no worker's data reached; the
    # server then answers with the others only, and the workers must rebuild the same sum.
    servers, results, (expected, touched, _) = run_seeded_loss(
        make_job, 2, 50_000, 3, 0.1, mode, feedback, udp_drop=0.9, seed=5)
    assert touched.mean() < 0.9, "the seeded loss should leave blocks nobody delivered"
    for rank in range(2):
        np.testing.assert_allclose(results[rank], expected, rtol=1e-6)
    counters = servers[0].server.counters
    assert counters["replies_sparse"] == 1
    # Both workers got the touched blocks only, not the whole tensor.
    assert counters["reply_bytes"] == 2 * 4 * int(touched.sum())


@pytest.mark.parametrize("by_priority", [True, False])
def test_urgent_message_passes_queued_big_ones(by_priority):
    """ServerLinks hands its socket only a few messages at a time, so that a message of higher
    priority queued after 40 big ones of lower priority reaches the peer before most of them
    (with DGT_PRIORITY_ORDER=0 it comes last, which shows the test can fail)."""
    import zmq

    from dgt.transport.links import ServerLinks

    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 1)  # back-pressure as a slow link would give
    router.setsockopt(zmq.RCVBUF, 1 << 16)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    links = ServerLinks(context, [("127.0.0.1", port)], 3, lambda *a: None, lambda now: None,
                        lambda exc: None, by_priority)
    try:
        big = np.zeros(1 << 18, dtype=np.float32)  # 1 MB
        for index in range(40):
            links.send(0, [b"big%d" % index, big], priority=-7)
        time.sleep(0.5)  # the socket and the kernel fill up; the rest waits in the outbox
        links.send(0, [b"urgent", b""], priority=0)
        time.sleep(0.2)
        order = []
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while len(order) < 41 and poller.poll(5000):
            order.append(router.recv_multipart()[1])
        assert len(order) == 41, "messages were lost"
        position = order.index(b"urgent")
        assert [m for m in order if m != b"urgent"] == [b"big%d" % i for i in range(40)]
        if by_priority:
            assert position < 30, f"the urgent message came {position + 1}th of 41"
        else:
            assert position == 40
    finally:
        links.close()
        router.close(linger=0)


def test_shared_ranking_makes_every_worker_send_the_same_blocks(make_job):
    # Every UDP datagram is dropped, so each step's sum is exactly the reliable blocks.  The
    # workers' block magnitudes differ, so their own rankings disagree; from step 1 on they
    # rank by the sum of both workers' scores of the step before, pick the same blocks, and
    # the reply carries only those.
    k, n, steps, workers = 0.5, 40 * 1024, 4, 2
    config, servers = make_job(workers, threshold=k, adaptive=False, udp_drop=1.0,
                               grace_ms=5, shared_ranking=True, receive_mode="drop")
    grads = {r: [(np.random.default_rng([r, s]).integers(-8, 9, n) * np.repeat(
        np.random.default_rng([r, s, 1]).integers(1, 5, n // 1024), 1024)).astype(np.float32)
                 for s in range(steps)] for r in range(workers)}
    results = run_workers(config, lambda w: [w.pushpull(0, g).wait().copy()
                                             for g in grads[w.rank]], workers)

    layout = BlockLayout(n, config.block_elems)
    alpha = config.score_alpha
    scores = {r: np.zeros(layout.n_blocks, np.float32) for r in range(workers)}
    shared = None
    reply_elems = 0
    for step in range(steps):
        expected = np.zeros(n, np.float32)
        sets = []
        for rank in range(workers):
            values = grads[rank][step]
            scores[rank] = alpha * scores[rank] + (1 - alpha) * block_mean_abs(layout, values)
            ranking = scores[rank] if shared is None else shared
            reliable = assign_channels(ranking, k, config.udp_channels) == 0
            mask = np.repeat(reliable, config.block_elems)
            expected[mask] += values[mask]
            sets.append(reliable)
        if step > 0:
            assert (sets[0] == sets[1]).all()
        else:
            assert (sets[0] != sets[1]).any(), "the workers' own rankings should disagree"
        reply_elems += int((sets[0] | sets[1]).sum()) * config.block_elems
        shared = scores[0] + scores[1]
        for rank in range(workers):
            np.testing.assert_array_equal(results[rank][step], expected, f"step {step}")
    assert servers[0].server.counters["reply_bytes"] == workers * 4 * reply_elems


def test_a_push_with_a_malformed_scores_frame_is_refused(make_job, monkeypatch):
    from dgt.wire import FLAG_SCORES, decode_header

    config, servers = make_job(1, threshold=0.5, shared_ranking=True)
    with Worker(config.replace(rank=0)) as worker:
        send = worker._send

        def truncate_scores(server, frames, *args):
            header = decode_header(frames[0])
            if header.type is MsgType.PUSH and header.flags & FLAG_SCORES:
                frames = frames[:2] + [frames[2][:-1]] + frames[3:]
            send(server, frames, *args)

        monkeypatch.setattr(worker, "_send", truncate_scores)
        with pytest.raises(RemoteProtocolError, match="scores frame of 16 bytes, the part has 5"):
            worker.pushpull(0, np.ones(5000, np.float32)).wait()
    # The push, then its end-of-datagrams marker (a marker without its push).  The refusal of
    # the push can reach the worker before the server has read the marker: wait for it.
    counters = servers[0].server.counters
    wait_until(lambda: counters["tcp_refused"] >= 2, "the end marker's refusal")
    assert counters["tcp_refused"] == 2
    assert counters["steps_closed"] == 0


@pytest.mark.parametrize("wire_dtype, k, drop", [("bfloat16", 0.3, 0.2), ("bfloat16", 0.1, 0.9),
                                                 ("native", 0.3, 0.2)],
                         ids=["bfloat16", "bfloat16-sparse-reply", "native"])
def test_bfloat16_wire_sums_the_rounded_survivors_in_float32_on_half_the_bytes(make_job,
                                                                               wire_dtype, k,
                                                                               drop):
    # Two workers, so the server's float32 sum a + b does not depend on arrival order.  The
    # oracle rounds each worker's values to bfloat16, sums the surviving blocks in float32 and
    # rounds the sum once more for the reply; with DGT_WIRE_DTYPE=native it must not match.
    # Under 90 % loss the reply leaves out the blocks nobody delivered (a sparse reply).
    from dgt.wire import BFLOAT16

    n, key = 30_000, 5
    config, servers = make_job(2, threshold=k, threshold_min=0.1, adaptive=False,
                               grace_ms=1000, udp_drop=drop, seed=7, wire_dtype=wire_dtype,
                               receive_mode="drop")
    data = {r: np.random.default_rng([r, 9]).normal(0, 1e-3, n).astype(np.float32)
            for r in range(2)}

    def body(worker):
        result = worker.pushpull(key, data[worker.rank]).wait().copy()
        pulled = worker.pull(key, data[worker.rank]).wait().copy()
        return result, pulled, list(worker._stats.bytes_per_channel)  # this step's

    results = run_workers(config, body, 2)
    expected = np.zeros(n, np.float32)
    for rank, values in data.items():
        layout, slots = delivered_slots(config, rank, key, 0, values, k, wire_itemsize=2)
        mask = layout.element_mask(slots)
        expected[mask] += values.astype(BFLOAT16).astype(np.float32)[mask]
        # Every pushed byte is 2 per element: reliable and UDP blocks alike.
        assert sum(results[rank][2]) == (2 if wire_dtype == "bfloat16" else 4) * n
    expected = expected.astype(BFLOAT16).astype(np.float32)
    for rank in range(2):
        result, pulled = results[rank][0], results[rank][1]
        assert result.dtype == np.float32 and pulled.dtype == np.float32
        np.testing.assert_array_equal(pulled, result)  # the stored sum, as float32
        if wire_dtype == "bfloat16":
            np.testing.assert_array_equal(result, expected)
        else:
            assert not np.array_equal(result, expected)
    assert servers[0].server.merger.counters.get("merged", 0) > 0
    assert servers[0].server.counters["replies_sparse"] == (1 if drop > 0.5 else 0)


def test_a_default_job_sums_bfloat16_survivors_and_rescales_what_one_worker_lost(make_job):
    # The defaults (wire dtype and receive mode "auto") under seeded loss: each worker's blocks
    # travel as bfloat16, the server sums the survivors in float32, scales a fragment that only
    # one of the two workers delivered by 2 (exact), and rounds the sum once for the reply.
    from dgt.wire import BFLOAT16

    n, key, k = 30_000, 3, 0.3
    config, servers = make_job(2, wire_dtype="auto", threshold=k, threshold_min=0.1,
                               adaptive=False, grace_ms=1000, udp_drop=0.3, seed=5)
    assert (config.wire_dtype, config.receive_mode) == ("bfloat16", "rescale")
    data = {r: np.random.default_rng([r, 4]).normal(0, 1e-3, n).astype(np.float32)
            for r in range(2)}
    results = run_workers(config, lambda w: w.pushpull(key, data[w.rank]).wait().copy(), 2)
    # Two workers: the float32 sum of two bfloat16 values is the exact sum rounded once, as
    # the oracle's float64 sum cast to float32 is; the scale (1 or 2) is exact.
    total, _, some_lost = expected_merge(config, key, data, k, "rescale", wire_dtype=BFLOAT16)
    assert some_lost, "the seeded loss should have hit some fragment"
    expected = total.astype(np.float32).astype(BFLOAT16).astype(np.float32)
    unscaled, _, _ = expected_merge(config, key, data, k, "drop", wire_dtype=BFLOAT16)
    assert not np.array_equal(expected, unscaled.astype(np.float32).astype(BFLOAT16)
                              .astype(np.float32)), "some fragment should lose one worker only"
    for rank in range(2):
        np.testing.assert_array_equal(results[rank], expected)
    assert servers[0].server.merger.counters.get("merged", 0) > 0


def test_workers_with_different_wire_dtypes_are_refused(make_job):
    # The server keeps one layout per part; a second worker pushing the same part in another
    # dtype is refused with a message that names both, and nothing is merged.
    config, servers = make_job(2, threshold=0.5, timeout_s=3.0)
    values = np.ones(5000, np.float32)
    with Worker(config.replace(rank=0)) as first, \
            Worker(config.replace(rank=1, wire_dtype="bfloat16")) as second:
        waiting = first.pushpull(0, values)
        merger = servers[0].server.merger  # the native push opens the part first
        # Its datagrams may overtake its PUSH and open the part provisionally, which a PUSH
        # in another layout would replace: wait for the PUSH itself.
        wait_until(lambda: (0, 0) in merger._parts and merger._parts[(0, 0)].pushed,
                   "the first push to reach the server")
        with pytest.raises(RemoteProtocolError, match="dtype_code=10.*differs.*dtype_code=1"):
            second.pushpull(0, values).wait()
        with pytest.raises(StepTimeout):
            waiting.wait()
    assert servers[0].server.counters["steps_closed"] == 0


def test_traced_job_records_every_part_once_per_worker_in_causal_order(make_job, tmp_path):
    """DGT_TRACE: each (key, part, step) has one push and one reply per worker, one arrival
    per worker and one close and reply at its server, stamped push <= arrive <= queued <=
    reply in (one clock: every process here shares it); the timeline reads them back."""
    from benchmarks.timeline import load_events, part_times, step_summary

    template = str(tmp_path / "{role}{index}.jsonl")
    config, servers = make_job(2, num_servers=2, threshold=0.5, threshold_min=0.1,
                               adaptive=False, grace_ms=50, part_elems=4096, trace=template)
    sizes = (3000, 10_000)  # 1 part; 3 parts of 4096 over both servers
    steps = 3

    def body(worker):
        for _ in range(steps):
            pendings = [worker.pushpull(key, np.full(n, worker.rank + 1, np.float32))
                        for key, n in enumerate(sizes)]
            results = [p.wait().copy() for p in pendings]
            assert all((r == 3).all() for r in results)
        return None

    run_workers(config, body, 2)
    for server in servers:
        server.stop()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["server0.jsonl", "server1.jsonl", "worker0.jsonl", "worker1.jsonl"]
    parts = part_times(load_events([str(tmp_path)]))
    expected = {(0, 0, s) for s in range(steps)} | {(1, p, s) for p in range(3)
                                                    for s in range(steps)}
    assert set(parts) == expected
    for ident, times in parts.items():
        assert times.complete(2), ident
        assert times.closed is not None and times.closed <= times.queued
        for rank in (0, 1):
            assert times.pushed[rank] <= times.arrived[rank] <= times.queued \
                <= times.received[rank], (ident, rank)
    summary = step_summary(parts)
    assert summary["steps"] == steps and summary["span_ms"] > 0
