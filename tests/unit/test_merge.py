"""StepMerger against hand-computed oracles (no sockets)."""
import numpy as np
import pytest

from dgt.errors import RemoteProtocolError
from dgt.merge import Outcome, StepMerger
from dgt.partition import BlockLayout, FragmentLayout
from dgt.wire import Header, MsgType

N, B, FE = 2500, 1024, 350  # 3 blocks (1024, 1024, 452), 3 fragment slots per block
LAYOUT = FragmentLayout(BlockLayout(N, B), FE)


def push(merger, rank, step, values, blocks, udp=0, now=0.0, key=1):
    header = Header(MsgType.PUSH, rank=rank, dtype=1, key=key, step=step, n_elems=N,
                    block_elems=B, frag_elems=FE, block=len(blocks), udp_expected=udp)
    blocks = np.asarray(blocks, dtype=np.int64)
    merger.add_push(header, blocks, [LAYOUT.blocks.gather(values, blocks)] if len(blocks) else [], now)
    return header


def end(merger, header, now=0.0):
    merger.add_push_end(header._replace(type=MsgType.PUSH_END), now)


def frag(merger, rank, step, values, block, f, now=0.0, key=1):
    start, stop = LAYOUT.frag_range(block, f)
    header = Header(MsgType.DATA, rank=rank, channel=1, dtype=1, key=key, step=step,
                    n_elems=N, block_elems=B, frag_elems=FE, block=block, frag=f)
    return merger.add_fragment(header, values[start:stop].tobytes(), now)


def data(rank):
    return np.arange(N, dtype=np.float32) * (rank + 1)


def test_all_reliable_step_is_the_exact_sum():
    merger = StepMerger(3)
    for r in range(3):
        push(merger, r, 0, data(r), [0, 1, 2])
    closed, = merger.poll(0.0)
    np.testing.assert_array_equal(closed.merged, data(0) * 6)
    assert closed.step == 0 and not closed.missing.any()


def test_step_waits_for_every_worker_and_every_announced_datagram():
    merger = StepMerger(2, grace_s=1.0)
    h0 = push(merger, 0, 0, data(0), [0, 2], udp=3)
    push(merger, 1, 0, data(1), [0, 1, 2])
    end(merger, h0, now=0.0)
    assert merger.poll(0.0) == []
    for f in range(3):
        assert frag(merger, 0, 0, data(0), 1, f) == Outcome.MERGED
    closed, = merger.poll(0.001)
    np.testing.assert_array_equal(closed.merged, data(0) * 3)
    assert closed.udp_merged.tolist() == [3, 0] and closed.udp_expected.tolist() == [3, 0]


def test_grace_window_starts_at_the_end_marker_and_bounds_the_wait():
    merger = StepMerger(1, grace_s=0.5)
    header = push(merger, 0, 0, data(0), [0], udp=6, now=0.0)
    assert merger.poll(100.0) == []  # no end marker yet: datagrams may still be leaving
    end(merger, header, now=100.0)
    frag(merger, 0, 0, data(0), 1, 0)
    assert merger.poll(100.4) == []
    assert merger.next_deadline() == pytest.approx(100.5)
    closed, = merger.poll(100.5)
    expected = np.zeros(N, np.float32)
    expected[:B] = data(0)[:B]
    expected[B:B + FE] = data(0)[B:B + FE]
    np.testing.assert_array_equal(closed.merged, expected)
    assert closed.grace_s == pytest.approx(0.5)
    missing = np.flatnonzero(closed.missing[0]).tolist()
    assert missing == [4, 5, 6, 7]  # block 1 frags 1-2, block 2 frags 0-1 (slot 8 absent)


def test_drop_mode_discards_late_datagrams_and_reports_them():
    merger = StepMerger(1, grace_s=0.0)
    h = push(merger, 0, 0, data(0), [0, 2], udp=3)
    end(merger, h)
    merger.poll(1.0)
    assert frag(merger, 0, 0, data(0), 1, 0) == Outcome.LATE_DROPPED
    h = push(merger, 0, 1, data(0), [0, 1, 2])
    closed, = merger.poll(2.0)
    np.testing.assert_array_equal(closed.merged, data(0))  # nothing stale added
    assert closed.udp_late.tolist() == [1]


def test_diff_mode_adds_a_one_step_late_block_to_the_next_step():
    merger = StepMerger(1, receive_mode="diff", grace_s=0.0, error_feedback=False)
    h = push(merger, 0, 0, data(0), [0, 2], udp=3)
    end(merger, h)
    closed, = merger.poll(1.0)
    assert not closed.merged[B:2 * B].any()  # lost = zero
    assert frag(merger, 0, 0, data(0), 1, 0) == Outcome.LATE_MERGED
    assert frag(merger, 0, 0, data(0), 1, 0) == Outcome.DUPLICATE
    assert frag(merger, 0, 0, data(0), 0, 0) == Outcome.DUPLICATE  # was reliable
    push(merger, 0, 1, data(1), [0, 1, 2])
    closed, = merger.poll(2.0)
    expected = data(1).copy()
    expected[B:B + FE] += data(0)[B:B + FE]
    np.testing.assert_array_equal(closed.merged, expected)
    assert closed.udp_late.tolist() == [1]
    assert frag(merger, 0, 0, data(0), 1, 1) == Outcome.LATE_DROPPED  # two steps late


def test_rescale_mode_scales_blocks_by_workers_over_deliverers():
    merger = StepMerger(3, receive_mode="rescale", grace_s=0.0, error_feedback=False)
    headers = [push(merger, 0, 0, data(0), [0, 1, 2]), push(merger, 1, 0, data(1), [0, 2], udp=3),
               push(merger, 2, 0, data(2), [0, 2], udp=3)]
    for f in range(3):
        frag(merger, 1, 0, data(1), 1, f)
    frag(merger, 2, 0, data(2), 1, 0)
    for h in headers[1:]:
        end(merger, h)
    closed, = merger.poll(1.0)
    expected = data(0) * 6
    s1 = slice(B + FE, 2 * B)  # block 1, fragments 1-2: delivered by ranks 0 and 1
    expected[s1] = (data(0)[s1] + data(1)[s1]) * 3 / 2
    np.testing.assert_allclose(closed.merged, expected, rtol=1e-6)


def test_duplicates_stale_and_foreign_steps_are_dropped():
    merger = StepMerger(2, grace_s=10.0)
    h = push(merger, 0, 0, data(0), [0], udp=6)
    assert frag(merger, 0, 0, data(0), 1, 0) == Outcome.MERGED
    assert frag(merger, 0, 0, data(0), 1, 0) == Outcome.DUPLICATE
    assert frag(merger, 0, 0, data(0), 0, 0) == Outcome.DUPLICATE  # block 0 came reliably
    assert frag(merger, 0, 7, data(0), 1, 0) == Outcome.STALE
    assert frag(merger, 5, 0, data(0), 1, 0) == Outcome.STALE
    assert frag(merger, 0, 3, data(0), 1, 0, key=99) == Outcome.STALE  # unknown part, not step 0
    assert merger.counters[Outcome.DUPLICATE] == 2
    end(merger, h)


def test_a_first_step_datagram_in_another_layout_is_counted_not_raised():
    # A datagram may open a part's step 0, so the layout check there used to raise out of
    # the server's receive loop; it is a mismatch like any other malformed datagram.
    merger = StepMerger(2, grace_s=10.0)
    push(merger, 0, 0, data(0), [0], udp=6)
    header = Header(MsgType.DATA, rank=1, channel=1, dtype=10, key=1, step=0, n_elems=N,
                    block_elems=B, frag_elems=2 * FE, block=1, frag=0)
    assert merger.add_fragment(header, np.zeros(2 * FE, np.uint16).tobytes(), 0.0) \
        == Outcome.MISMATCH
    assert merger.counters[Outcome.MISMATCH] == 1


def test_datagram_may_arrive_before_its_push():
    merger = StepMerger(1, grace_s=10.0)
    assert frag(merger, 0, 0, data(0), 1, 0) == Outcome.MERGED
    h = push(merger, 0, 0, data(0), [0, 2], udp=3)
    end(merger, h)
    for f in (1, 2):
        frag(merger, 0, 0, data(0), 1, f)
    closed, = merger.poll(0.0)
    np.testing.assert_array_equal(closed.merged, data(0))


@pytest.mark.parametrize("case, message", [
    ("wrong_step", "expected step 0"),
    ("twice", "second PUSH"),
    ("unsorted", "not ascending"),
    ("short", "payload frames"),
    ("rank", "from rank 9"),
    ("too_many_udp", "announces"),
])
def test_inconsistent_pushes_are_refused_without_merging(case, message):
    merger = StepMerger(2)
    header = Header(MsgType.PUSH, rank=0, dtype=1, key=1, step=0, n_elems=N, block_elems=B,
                    frag_elems=FE)
    blocks, payload = np.array([0, 1]), data(0)[:2 * B]
    if case == "wrong_step":
        header = header._replace(step=1)
    elif case == "twice":
        merger.add_push(header, blocks, [payload], 0.0)
    elif case == "unsorted":
        blocks = np.array([1, 0])
    elif case == "short":
        payload = payload[:-1]
    elif case == "rank":
        header = header._replace(rank=9)
    elif case == "too_many_udp":
        header = header._replace(udp_expected=100)
    with pytest.raises(RemoteProtocolError, match=message):
        merger.add_push(header, blocks, [payload], 0.0)


def test_float16_parts_accumulate_in_float32():
    merger = StepMerger(3)
    for r, value in enumerate((2048, 1, 1)):  # in float16, 2048 + 1 + 1 == 2048
        header = Header(MsgType.PUSH, rank=r, dtype=2, key=1, step=0, n_elems=4, block_elems=B,
                        frag_elems=700, block=1)
        merger.add_push(header, np.array([0]), [np.full(4, value, np.float16)], 0.0)
    closed, = merger.poll(0.0)
    assert closed.merged.dtype == np.float16 and closed.merged[0] == 2050


def test_bfloat16_parts_sum_in_float32_and_keep_the_exact_total():
    from dgt.wire import BFLOAT16

    merger = StepMerger(3)
    # Summed in bfloat16 (8 significant bits), 256 + 1 rounds back to 256 and the total is
    # 256; summed in float32 it is 258, which bfloat16 holds exactly.
    values = [np.float32(256), np.float32(1), np.float32(1)]
    for r, value in enumerate(values):
        header = Header(MsgType.PUSH, rank=r, dtype=10, key=1, step=0, n_elems=N,
                        block_elems=B, frag_elems=700, block=1)
        payload = np.full(B, value, np.float32).astype(BFLOAT16)
        merger.add_push(header, np.array([1]), [payload], 0.0)
    closed, = merger.poll(0.0)
    assert closed.total.dtype == np.float32 and closed.merged.dtype == BFLOAT16
    np.testing.assert_array_equal(closed.total[B:2 * B], 258)
    assert (closed.total[:B] == 0).all() and (closed.total[2 * B:] == 0).all()
    np.testing.assert_array_equal(closed.merged.astype(np.float32)[B:2 * B], 258)


def test_the_wire_dtype_sum_is_cast_when_read_and_once():
    """A server that runs the optimizer applies ``total`` and never reads ``merged``: the
    close must not pay the cast, and a summing server that reads it twice casts once."""
    from dgt.wire import BFLOAT16

    merger = StepMerger(2)
    for r in range(2):
        header = Header(MsgType.PUSH, rank=r, dtype=10, key=1, step=0, n_elems=N,
                        block_elems=B, frag_elems=700, block=1)
        merger.add_push(header, np.array([0]), [np.full(B, r + 1.5, np.float32).astype(BFLOAT16)],
                        0.0)
    closed, = merger.poll(0.0)
    assert closed.wire_dtype == BFLOAT16 and closed._merged is None
    first = closed.merged
    assert first is closed.merged and first.dtype == BFLOAT16
    np.testing.assert_array_equal(first.astype(np.float32)[:B], 4.0)


@pytest.mark.parametrize("mode", ["drop", "diff"])
def test_batched_fragments_match_one_by_one(mode, rng):
    """add_fragments (what the server uses) == add_fragment per datagram, late ones included."""
    feedback = mode == "drop"
    merged = []
    for batched in (False, True):
        merger = StepMerger(2, receive_mode=mode, grace_s=0.0, error_feedback=feedback)
        picks = np.random.default_rng(5).integers(0, 8, size=(3, 12))  # slots, with repeats
        for step in range(3):
            heads = [push(merger, r, step, data(r) + step, [0], udp=6) for r in range(2)]
            for r in range(2):
                slots = picks[step] + 3  # blocks 1..2 (slot 8 does not exist: skip it)
                slots = slots[slots < 8]
                blocks, frags = np.divmod(slots, 3)
                values = data(r) + step
                if batched:
                    starts = [LAYOUT.frag_range(b, f) for b, f in zip(blocks, frags)]
                    lengths = np.array([b - a for a, b in starts])
                    rows = np.zeros((len(slots), FE), np.float32)
                    for i, (a, b) in enumerate(starts):
                        rows[i, :b - a] = values[a:b]
                    header = Header(MsgType.DATA, rank=r, channel=1, dtype=1, key=1, step=step,
                                    n_elems=N, block_elems=B, frag_elems=FE)
                    merger.add_fragments(header, blocks, frags, rows, lengths)
                else:
                    for b, f in zip(blocks, frags):
                        frag(merger, r, step, values, b, f)
                end(merger, heads[r])
            closed, = merger.poll(float(step + 1))
            if step < 2:  # a late datagram of this step, after its close
                for r in range(2):
                    frag(merger, r, step, data(r) + step, 2, 1)
            merged.append((closed.merged.copy(), dict(merger.counters)))
    half = len(merged) // 2
    for (a, ca), (b, cb) in zip(merged[:half], merged[half:]):
        np.testing.assert_array_equal(a, b)
    assert merged[half - 1][1] == merged[-1][1]


@pytest.mark.parametrize("mode", ["drop", "diff", "rescale"])
def test_touched_blocks_are_exactly_those_some_data_reached(mode):
    merger = StepMerger(2, receive_mode=mode, grace_s=0.0, error_feedback=False)
    headers = [push(merger, 0, 0, data(0), [0], udp=3), push(merger, 1, 0, data(1), [], udp=6)]
    frag(merger, 1, 0, data(1), 2, 1)  # one fragment of block 2; block 1 gets nothing
    for h in headers:
        end(merger, h)
    closed, = merger.poll(1.0)
    assert closed.touched_blocks.tolist() == [True, False, True]
    assert closed.block_elems == B
    untouched = np.repeat(~closed.touched_blocks, B)[:N]
    assert not closed.merged[untouched].any()  # the oracle: untouched blocks are zero
    if mode != "diff":
        return
    # A late fragment of block 1 joins step 1, which touches block 1 although step 1's own
    # pushes carry block 0 only.
    assert frag(merger, 1, 0, data(1), 1, 0) == Outcome.LATE_MERGED
    for r in range(2):
        push(merger, r, 1, data(r), [0])
    closed, = merger.poll(2.0)
    assert closed.touched_blocks.tolist() == [True, True, False]


def test_block_scores_are_summed_only_when_every_worker_sent_them():
    merger = StepMerger(2)
    blocks = np.array([0, 1, 2])
    chunks = [LAYOUT.blocks.gather(data(0), blocks)]

    def push_scored(rank, step, scores):
        header = Header(MsgType.PUSH, rank=rank, dtype=1, key=1, step=step, n_elems=N,
                        block_elems=B, frag_elems=FE, block=3)
        merger.add_push(header, blocks, chunks, 0.0, scores)

    push_scored(0, 0, np.array([1.0, 2.0, 3.0], np.float32))
    push_scored(1, 0, np.array([0.5, 0.25, 4.0], np.float32))
    closed, = merger.poll(0.0)
    np.testing.assert_array_equal(closed.scores, [1.5, 2.25, 7.0])
    push_scored(0, 1, np.array([1.0, 2.0, 3.0], np.float32))
    push_scored(1, 1, None)  # a worker without shared ranking: no sum for anybody
    closed, = merger.poll(0.0)
    assert closed.scores is None
    with pytest.raises(RemoteProtocolError, match="3 blocks"):
        push_scored(0, 2, np.ones(4, np.float32))


def test_the_first_push_overrules_the_layout_of_datagrams_that_overtook_it():
    """A datagram that opens step 0 fixes the part's layout only until the first PUSH: one in
    another layout (a faulty sender) is dropped then, and counted as a mismatch."""
    merger = StepMerger(2, grace_s=10.0)
    odd = Header(MsgType.DATA, rank=1, channel=1, dtype=1, key=1, step=0, n_elems=N,
                 block_elems=B, frag_elems=2 * FE, block=1, frag=0)
    assert merger.add_fragment(odd, np.ones(2 * FE, np.float32).tobytes(), 0.0) == Outcome.MERGED
    push(merger, 0, 0, data(0), [0, 1, 2])
    push(merger, 1, 0, data(1), [0, 1, 2])
    closed, = merger.poll(0.0)
    np.testing.assert_array_equal(closed.merged, data(0) * 3)  # nothing of the odd datagram
    assert merger.counters[Outcome.MISMATCH] == 1 and merger.counters[Outcome.MERGED] == 0
    # Once a PUSH has fixed the layout, a PUSH in another one is refused, as before.
    with pytest.raises(RemoteProtocolError, match="differs from the layout"):
        merger.add_push(odd._replace(type=MsgType.PUSH, rank=0, step=1, block=0),
                        np.empty(0, np.int64), [], 0.0)


@pytest.mark.parametrize("dtype_code,dtype", [(1, np.float32), (2, np.float16)])
def test_datagram_rows_of_every_dtype_add_up_to_the_sum(dtype_code, dtype):
    """float32 rows take the compiled add, float16 ones numpy's (the only path left to it),
    short last fragments included: both give the exact sum of what was sent."""
    merger = StepMerger(2, receive_mode="drop", grace_s=0.0)
    expected = np.zeros(N)
    slots = LAYOUT.slots_of_blocks(np.array([1, 2]))  # every fragment; block 2 ends short
    blocks, frags = np.divmod(slots, 3)
    starts, stops = LAYOUT.slot_ranges(slots)
    for rank in range(2):
        values = (np.arange(N) % 64 * (rank + 1)).astype(dtype)  # exact in float16
        header = Header(MsgType.PUSH, rank=rank, dtype=dtype_code, key=1, step=0, n_elems=N,
                        block_elems=B, frag_elems=FE, block=1, udp_expected=len(slots))
        merger.add_push(header, np.array([0]), [values[:B]], 0.0)
        rows = np.zeros((len(slots), FE), dtype)
        for i, (a, b) in enumerate(zip(starts, stops)):
            rows[i, :b - a] = values[a:b]
        merger.add_fragments(header._replace(type=MsgType.DATA), blocks, frags, rows,
                             stops - starts)
        merger.add_push_end(header._replace(type=MsgType.PUSH_END), 0.0)
        expected += values.astype(np.float64)
    closed, = merger.poll(1.0)
    np.testing.assert_array_equal(closed.total.astype(np.float64), expected)


@pytest.mark.parametrize("dtype_code,dtype", [(1, np.float32), (2, np.float16)])
@pytest.mark.parametrize("bad_block,bad_frag", [(3, 0), (2, 2)])
def test_a_run_with_an_index_outside_the_layout_is_dropped_whole_and_counted(dtype_code, dtype,
                                                                              bad_block, bad_frag):
    """The compiled merge (float32) and numpy's (float16) both refuse a run naming block 3
    of a 3-block part, or fragment 2 of the short last block (452 elements: 2 fragments):
    nothing of it is merged, nothing raises, every datagram is counted."""
    merger = StepMerger(2, grace_s=0.0)
    header = Header(MsgType.PUSH, rank=0, dtype=dtype_code, key=1, step=0, n_elems=N,
                    block_elems=B, frag_elems=FE, udp_expected=2)
    merger.add_push(header, np.array([0]), [np.ones(B, dtype)], 0.0)
    counts = merger.add_fragments(header._replace(type=MsgType.DATA), np.array([1, bad_block]),
                                  np.array([0, bad_frag]), np.ones((2, FE), dtype),
                                  np.array([FE, FE]))
    assert counts == {Outcome.MISMATCH: 2}
    assert Outcome.MERGED not in merger.counters


def test_a_received_batch_is_checked_and_merged_run_by_run():
    """The server's receive path without sockets: two workers' datagrams interleaved in runs,
    plus one malformed, one of another job and one from a rank that never said HELLO.  The
    refused ones are counted by reason; the sum is the exact sum of the rest."""
    from dgt.merge import merge_datagram_batch
    from dgt.wire import HEADER_BYTES, frame_datagrams

    merger = StepMerger(3, grace_s=0.0)
    slots = LAYOUT.slots_of_blocks(np.array([1, 2]))  # block 2's last fragment is short
    channels = np.ones(LAYOUT.blocks.n_blocks, np.uint8)
    row_bytes = HEADER_BYTES + FE * 4
    batch = []
    for rank in (0, 1, 2):
        header = Header(MsgType.PUSH, job=5, rank=rank, dtype=1, key=1, step=0, n_elems=N,
                        block_elems=B, frag_elems=FE, block=1, udp_expected=len(slots))
        merger.add_push(header, np.array([0]), [data(rank)[:B]], 0.0)
        if rank == 2:  # rank 2 is unknown to the batch: its datagrams are refused
            merger.add_push_end(header._replace(type=MsgType.PUSH_END), 0.0)
        framed = frame_datagrams(header._replace(type=MsgType.DATA), LAYOUT, data(rank),
                                 channels, slots)
        datagrams = [bytes(row) for row in framed.rows]
        datagrams += [framed.odd_headers[i * HEADER_BYTES:(i + 1) * HEADER_BYTES]
                      + framed.odd_payloads[i].tobytes() for i in range(len(framed.odd_payloads))]
        batch.append(datagrams)
    expected = data(0).astype(np.float64) + data(1)
    expected[:B] += data(2)[:B]  # rank 2's reliable block 0 is merged, its datagrams are not
    rows = []
    for i in range(max(len(d) for d in batch)):  # runs of 2 rows, alternating workers
        for datagrams in batch:
            rows += datagrams[i:i + 1]
    rows.insert(3, b"XX" + rows[0][2:])  # bad magic
    rows.insert(5, rows[0][:4] + (6).to_bytes(4, "little") + rows[0][8:])  # job 6
    buffer = np.zeros((len(rows), row_bytes), np.uint8)
    for i, datagram in enumerate(rows):
        buffer[i, :len(datagram)] = np.frombuffer(datagram, np.uint8)
    sizes = np.array([len(d) for d in rows])
    refused = merge_datagram_batch(merger, buffer, sizes, 5, np.array([True, True, False]))
    assert refused == {"malformed": 1, "foreign": 1, "unknown_sender": len(slots)}
    assert merger.counters[Outcome.MERGED] == 2 * len(slots)
    for rank in (0, 1):
        merger.add_push_end(Header(MsgType.PUSH_END, job=5, rank=rank, dtype=1, key=1, step=0,
                                   n_elems=N, block_elems=B, frag_elems=FE), 0.0)
    closed, = merger.poll(1.0)
    np.testing.assert_array_equal(closed.total.astype(np.float64), expected)
