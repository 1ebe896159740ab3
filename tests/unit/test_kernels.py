"""The compiled kernels against the numpy expressions they replace."""
import numpy as np
import pytest

from dgt.kernels import (add_bfloat16_, block_abs_sums, blocks_into_, cast, datagram_rows_,
                         datagram_rows_bfloat16_, gather_bfloat16_, gather_rows_, merge_rows_,
                         rows_add_, scale_ranges_, to_bfloat16, weights_delta_bfloat16_)
from dgt.partition import BlockLayout
from dgt.wire import BFLOAT16


def _numpy_block_abs_sums(flat, block_elems):
    return np.add.reduceat(np.abs(flat.astype(np.float64)), np.arange(0, flat.size, block_elems))


@pytest.mark.parametrize("n_elems,block_elems", [(1, 64), (64, 64), (2500, 1024), (3 * 1024, 1024),
                                                 (100_003, 256)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_block_abs_sums_match_numpy(rng, n_elems, block_elems, dtype):
    flat = rng.standard_normal(n_elems).astype(dtype)
    sums = block_abs_sums(flat, block_elems)
    assert sums.dtype == np.float32 and sums.shape == (-(-n_elems // block_elems),)
    np.testing.assert_allclose(sums, _numpy_block_abs_sums(flat, block_elems), rtol=1e-5)


def test_block_abs_sums_of_a_strided_view_take_the_numpy_path(rng):
    flat = rng.standard_normal(4096).astype(np.float32)[::2]
    np.testing.assert_allclose(block_abs_sums(flat, 512), _numpy_block_abs_sums(flat, 512),
                               rtol=1e-5)


def test_a_nan_or_infinity_spoils_only_its_own_block():
    flat = np.ones(4 * 1024, np.float32)
    flat[5] = np.nan
    flat[2 * 1024 + 7] = -np.inf
    sums = block_abs_sums(flat, 1024)
    assert np.isnan(sums[0]) and sums[2] == np.inf
    assert sums[1] == 1024 and sums[3] == 1024


def _bits_to_round():
    special = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                        0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x00000001, 0x80000001, 0x007FFFFF,
                        0x7F7FFFFF, 0xFF7FFFFF, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF,
                        0x7F7F8000, 0x7F7F7FFF], np.uint32)
    randoms = np.random.default_rng(3).integers(0, 2 ** 32, 200_000, dtype=np.uint32)
    return np.concatenate([special, randoms]).view(np.float32)


def test_bfloat16_rounding_has_ml_dtypes_bits_everywhere():
    values = _bits_to_round()  # every class: zeros, subnormals, ties, overflow, NaNs
    ours = to_bfloat16(values, np.empty(values.size, BFLOAT16))
    theirs = np.empty(values.size, BFLOAT16)
    np.copyto(theirs, values, casting="unsafe")
    np.testing.assert_array_equal(ours.view(np.uint16), theirs.view(np.uint16))


def test_bfloat16_of_other_dtypes_and_strides_takes_the_numpy_path(rng):
    values = rng.standard_normal(1000)
    out = to_bfloat16(values, np.empty(1000, BFLOAT16))
    np.testing.assert_array_equal(out.view(np.uint16),
                                  values.astype(BFLOAT16).view(np.uint16))
    strided = values.astype(np.float32)[::2]
    out = to_bfloat16(strided, np.empty(500, BFLOAT16))
    np.testing.assert_array_equal(out.view(np.uint16), strided.astype(BFLOAT16).view(np.uint16))


@pytest.mark.parametrize("wire", [np.float32, BFLOAT16])
@pytest.mark.parametrize("add", [False, True])
def test_blocks_into_equals_numpy_block_writes(rng, wire, add):
    layout = BlockLayout(10 * 256 + 100, 256)  # a short last block
    blocks = np.array([0, 1, 4, 7, 8, 10], dtype=np.uint32)
    payload = layout.gather(rng.standard_normal(layout.n_elems).astype(wire), blocks)
    start = rng.standard_normal(layout.padded_elems).astype(np.float32)
    expected = start.copy()
    offset = 0
    for block in blocks.tolist():
        lo, hi = layout.block_range(block)
        widened = payload[offset:offset + hi - lo].astype(np.float32)
        expected[lo:hi] = expected[lo:hi] + widened if add else widened
        offset += hi - lo
    padded = start.copy()
    assert blocks_into_(padded, blocks, layout.block_elems, layout.n_elems, payload, add)
    np.testing.assert_array_equal(padded, expected)


@pytest.mark.parametrize("wire", [np.float32, BFLOAT16])
def test_blocks_into_with_marks_writes_unfilled_blocks_adds_to_filled_ones(rng, wire):
    """A server's accumulator is not zeroed: a block that holds no data yet is written, one
    that does is added to, and every pushed block is marked afterwards."""
    layout = BlockLayout(10 * 256 + 100, 256)
    blocks = np.array([0, 1, 4, 7, 8, 10], dtype=np.int64)
    filled = np.zeros(layout.n_blocks, bool)
    filled[[1, 7, 9]] = True
    payload = layout.gather(rng.standard_normal(layout.n_elems).astype(wire), blocks)
    start = rng.standard_normal(layout.padded_elems).astype(np.float32)  # stale values
    expected, offset = start.copy(), 0
    for block in blocks.tolist():
        lo, hi = layout.block_range(block)
        widened = payload[offset:offset + hi - lo].astype(np.float32)
        expected[lo:hi] = expected[lo:hi] + widened if filled[block] else widened
        offset += hi - lo
    want_filled = filled.copy()
    want_filled[blocks] = True
    padded = start.copy()
    assert blocks_into_(padded, blocks, layout.block_elems, layout.n_elems, payload, filled)
    np.testing.assert_array_equal(padded, expected)
    np.testing.assert_array_equal(filled, want_filled)
    # The same through the layout, and its numpy path (float64) agrees.
    padded64, marks = start.astype(np.float64), want_filled & False
    marks[[1, 7, 9]] = True
    layout.scatter_into_(padded64, blocks, payload.astype(np.float64), marks)
    np.testing.assert_allclose(padded64, expected, rtol=1e-6)
    np.testing.assert_array_equal(marks, want_filled)
    with pytest.raises(ValueError, match="a bool per block"):
        blocks_into_(padded, blocks, layout.block_elems, layout.n_elems, payload, filled[:5])


def test_blocks_into_leaves_other_dtypes_to_numpy():
    padded = np.zeros(512, np.float64)
    assert not blocks_into_(padded, np.array([0]), 256, 512, np.ones(256), add=True)
    assert not padded.any()
    padded32 = np.zeros(512, np.float32)
    assert not blocks_into_(padded32, np.array([0]), 256, 512, np.ones(256, np.float16), add=True)
    assert not padded32.any()


def test_datagram_rows_copy_each_header_and_payload_once(rng):
    headers = rng.integers(0, 256, (5, 7), dtype=np.uint8)
    source = rng.integers(0, 256, 100, dtype=np.uint8)
    starts = np.array([0, 90, 13, 13, 40])
    out = np.full((5, 7 + 10), 0xAA, dtype=np.uint8)
    assert datagram_rows_(out, headers, source, starts) is out
    expected = np.stack([np.concatenate([headers[r], source[s:s + 10]])
                         for r, s in enumerate(starts)])
    np.testing.assert_array_equal(out, expected)


def test_datagram_rows_refuse_a_payload_past_the_source():
    out = np.zeros((1, 4 + 8), np.uint8)
    with pytest.raises(ValueError, match="outside the source"):
        datagram_rows_(out, np.zeros((1, 4), np.uint8), np.zeros(20, np.uint8), np.array([13]))
    with pytest.raises(ValueError, match="uint8 header rows"):
        datagram_rows_(out, np.zeros((2, 4), np.uint8), np.zeros(20, np.uint8), np.array([0]))


@pytest.mark.parametrize("n_elems", [1, 1024, 5 * 1024 + 17])
def test_gather_rounds_float32_blocks_into_bfloat16_as_cast_then_gather(rng, n_elems):
    layout = BlockLayout(n_elems, 1024)
    values = (rng.standard_normal(n_elems) * 10.0 ** rng.integers(-40, 39, n_elems)
              ).astype(np.float32)
    values[0] = np.nan
    blocks = np.flatnonzero(rng.random(layout.n_blocks) < 0.7)
    blocks = np.append(blocks[blocks < layout.n_blocks - 1], layout.n_blocks - 1)
    out = np.full(n_elems + 5, 7, BFLOAT16)
    gathered = layout.gather(values, blocks, out=out)
    expected = layout.gather(values.astype(BFLOAT16), blocks)
    assert gathered.dtype == BFLOAT16 and np.shares_memory(gathered, out)
    assert np.array_equal(gathered.view(np.uint16), expected.view(np.uint16))


def test_gather_into_another_dtype_without_a_kernel_casts_after_gathering(rng):
    layout = BlockLayout(3000, 1024)
    values = rng.standard_normal(3000)  # float64: no compiled path
    out = np.empty(3000, np.float32)
    assert not gather_bfloat16_(out, values, np.array([0, 2]), 1024)
    gathered = layout.gather(values, np.array([0, 2]), out=out)
    np.testing.assert_array_equal(gathered, np.concatenate([values[:1024], values[2048:]])
                                  .astype(np.float32))


def test_datagram_rows_bfloat16_round_each_payload(rng):
    values = rng.standard_normal(64).astype(np.float32)
    headers = rng.integers(0, 256, (3, 5), dtype=np.uint8)
    starts = np.array([0, 40, 7])
    out = np.empty((3, 5 + 2 * 16), np.uint8)
    datagram_rows_bfloat16_(out, headers, values, starts)
    for r, start in enumerate(starts):
        assert out[r, :5].tobytes() == headers[r].tobytes()
        assert out[r, 5:].tobytes() == values[start:start + 16].astype(BFLOAT16).tobytes()
    with pytest.raises(ValueError, match="outside the source"):
        datagram_rows_bfloat16_(out, headers, values, np.array([0, 49, 7]))


def test_warm_up_compiles_every_signature_a_push_and_a_merge_use(rng):
    """After warm_up, a worker's push path and a server's merge of read-only frames (float32
    and bfloat16) compile nothing more: no step pays for compiling."""
    from dgt import kernels
    from dgt.memory import ResidualMemory
    from dgt.partition import FragmentLayout
    from dgt.scoring import ContributionState, score_blocks
    from dgt.wire import Header, MsgType, frame_datagrams

    kernels.warm_up()
    dispatchers = {name: getattr(kernels, name) for name in dir(kernels)
                   if hasattr(getattr(kernels, name), "signatures")}
    assert len(dispatchers) >= 8
    before = {name: set(d.signatures) for name, d in dispatchers.items()}
    layout = FragmentLayout(BlockLayout(5000, 1024), 256)
    values = rng.standard_normal(5000).astype(np.float32)
    score_blocks(ContributionState(0.3), 0, layout.blocks, values)
    reliable = np.array([0, 2, 4], dtype=np.uint32)
    slots = layout.slots_of_blocks(np.array([1, 3]))
    base = Header(MsgType.DATA, dtype=1, n_elems=5000, block_elems=1024, frag_elems=256)
    channels = np.array([0, 1, 0, 2, 0], np.uint8)
    for wire in (np.dtype(np.float32), BFLOAT16):
        payload = layout.blocks.gather(values, reliable, out=np.empty(5000, wire))
        frame_datagrams(base, layout, values, channels, slots, wire)
        frame = np.frombuffer(payload.tobytes(), dtype=wire)  # read-only, as from ZeroMQ
        padded = np.zeros(layout.blocks.padded_elems, np.float32)
        layout.blocks.scatter_into_(padded, reliable, frame,
                                    np.zeros(layout.blocks.n_blocks, bool))
        layout.blocks.scatter_add_(padded, reliable, frame)
        to_bfloat16(padded, np.empty(padded.size, BFLOAT16))
        # A server's batch: rows are strided views of its receive buffer.
        buffer = np.zeros((4, 2048), np.uint8)
        width = (2048 - 64) // wire.itemsize
        received = buffer[1:3, 64:64 + width * wire.itemsize].view(wire)
        rows_add_(padded, np.array([0, 256]), np.array([256, 512]), received)
        marks = np.zeros((2, layout.n_slots), bool)  # rows of a merger's (W, n) masks
        sent = np.zeros((2, layout.blocks.n_blocks), bool)
        run_blocks = np.array([1, 1, 3], np.int64)[:2]  # a sliced column, as the server's
        merge_rows_(padded, marks[1], sent[1], run_blocks, np.array([0, 1], np.int64),
                    layout.frags_per_block, 1024, 5000, 256, received)
        counts = np.array([1, 2, 1], np.int64)  # rescale: a few slots' workers of two
        scale_ranges_(padded, *layout.slot_ranges(np.array([0, 5, 9])), 2 / counts)
    # Error feedback: the worker keeps its lost fragments and adds them to the next push.
    memory = ResidualMemory()
    memory.remember(0, values, *layout.slot_ranges(slots[::3]))
    memory.compensate(0, values, out=np.empty_like(values))
    # A server-side optimizer's delta reply, and a worker adding a read-only frame of it.
    held = values + 1e-3
    delta = weights_delta_bfloat16_(values, held, np.empty(5000, BFLOAT16))
    frame = np.frombuffer(delta.tobytes(), dtype=BFLOAT16)
    add_bfloat16_(held[1000:], frame[1000:])
    compiled = {name: set(d.signatures) - before[name] for name, d in dispatchers.items()}
    assert not any(compiled.values()), compiled


@pytest.mark.parametrize("wire", [np.dtype(np.float32), BFLOAT16])
@pytest.mark.parametrize("strided", [False, True])
def test_rows_add_adds_each_row_over_its_range(rng, wire, strided):
    acc = rng.standard_normal(1000).astype(np.float32)
    expected = acc.astype(np.float64)
    starts = np.array([0, 300, 700, 996])
    stops = np.array([256, 556, 956, 1000])  # the last row is short: a tensor's last block
    buffer = np.zeros((4, 8 + 256 * wire.itemsize), np.uint8)
    rows = buffer[:, 8:].view(wire) if strided else np.zeros((4, 256), wire)
    rows[...] = rng.standard_normal((4, 256)).astype(np.float32).astype(wire)
    for r in range(4):
        expected[starts[r]:stops[r]] += rows[r, :stops[r] - starts[r]].astype(np.float64)
    assert rows_add_(acc, starts, stops, rows)
    np.testing.assert_allclose(acc, expected, rtol=1e-6, atol=1e-6)


def test_rows_add_refuses_ranges_outside_and_leaves_other_dtypes_to_numpy():
    acc = np.zeros(100, np.float32)
    rows = np.ones((1, 10), np.float32)
    with pytest.raises(ValueError, match="outside"):
        rows_add_(acc, np.array([95]), np.array([105]), rows)
    with pytest.raises(ValueError, match="outside"):
        rows_add_(acc, np.array([0]), np.array([20]), rows)  # longer than the row
    assert not rows_add_(acc, np.array([0]), np.array([10]), rows.astype(np.float16))
    assert not rows_add_(acc.astype(np.float64), np.array([0]), np.array([10]), rows)
    assert (acc == 0).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_gather_rows_is_the_inverse_of_rows_add(rng, dtype):
    """Rows gathered from ranges and added into zeros give back the source on those ranges
    and zeros elsewhere; the compiled float32 pass and numpy's loop give the same rows."""
    source = rng.standard_normal(1000).astype(dtype)
    starts = np.array([0, 300, 700, 996])
    stops = np.array([256, 556, 956, 1000])  # the last range is short
    rows = gather_rows_(np.full((4, 256), 7.0, np.float32), source, starts, stops)
    for r in range(4):
        length = stops[r] - starts[r]
        np.testing.assert_array_equal(rows[r, :length],
                                      source[starts[r]:stops[r]].astype(np.float32))
        assert (rows[r, length:] == 7.0).all()  # the tail is left as it was
    acc = np.zeros(1000, np.float32)
    rows[3, 4:] = 0.0
    assert rows_add_(acc, starts, stops, rows)
    mask = np.zeros(1000, bool)
    for start, stop in zip(starts, stops):
        mask[start:stop] = True
    np.testing.assert_array_equal(acc[mask], source[mask].astype(np.float32))
    assert (acc[~mask] == 0).all()


def test_gather_rows_refuses_ranges_outside_the_source_or_the_rows():
    source = np.arange(100, dtype=np.float32)
    rows = np.zeros((1, 10), np.float32)
    with pytest.raises(ValueError, match="outside"):
        gather_rows_(rows, source, np.array([95]), np.array([105]))
    with pytest.raises(ValueError, match="outside"):
        gather_rows_(rows, source, np.array([0]), np.array([20]))  # longer than the row
    with pytest.raises(ValueError, match="2 ranges for rows of shape"):
        gather_rows_(rows, source, np.array([0, 10]), np.array([10, 20]))
    assert (rows == 0).all()


def test_cast_is_the_one_cast_of_every_wire_dtype(rng):
    values = (rng.standard_normal(3000) * 1e3).astype(np.float32)
    assert cast(values, np.float32) is values  # nothing to do: the same array
    rounded = cast(values, BFLOAT16)
    assert np.array_equal(rounded.view(np.uint16), values.astype(BFLOAT16).view(np.uint16))
    out = np.empty(3000, np.float16)
    assert cast(values, np.float16, out=out) is out
    np.testing.assert_array_equal(out, values.astype(np.float16))
    widened = cast(rounded, np.float32)  # bfloat16 back to float32: numpy's (exact) cast
    np.testing.assert_array_equal(widened, rounded.astype(np.float32))


def _numpy_merge_rows(acc, received, reliable, blocks, frags, layout, rows):
    """The merger's numpy path: dedupe the run, mask, mark, add; returns how many merged."""
    slots = blocks * layout.frags_per_block + frags
    _, first = np.unique(slots, return_index=True)
    fresh = np.zeros(len(slots), bool)
    fresh[first] = True
    fresh &= ~received[slots] & ~reliable[blocks]
    received[slots[fresh]] = True
    starts, stops = layout.slot_ranges(slots[fresh])
    for row, start, stop in zip(rows[fresh], starts, stops):
        acc[start:stop] += row[:stop - start].astype(acc.dtype)
    return int(fresh.sum())


@pytest.mark.parametrize("wire", [np.dtype(np.float32), BFLOAT16])
@pytest.mark.parametrize("strided", [False, True])
def test_merge_rows_claims_fresh_slots_and_adds_them_as_the_numpy_path(rng, wire, strided):
    """A run with a slot repeated inside it, slots already merged, a block that came
    reliably and the part's short last fragment: the same sum, marks and count as numpy's."""
    from dgt.partition import FragmentLayout
    layout = FragmentLayout(BlockLayout(5000, 1024), 256)  # last block: 904 elements
    blocks = np.array([0, 0, 1, 2, 2, 4, 4, 3, 0], np.int64)
    frags = np.array([0, 1, 3, 2, 0, 3, 0, 1, 1], np.int64)  # (0, 1) twice; (4, 3) is short
    received = np.zeros(layout.n_slots, bool)
    received[2 * layout.frags_per_block + 2] = True  # (2, 2) already merged
    reliable = np.zeros(layout.blocks.n_blocks, bool)
    reliable[3] = True
    buffer = np.zeros((len(blocks), 16 + 256 * wire.itemsize), np.uint8)
    rows = buffer[:, 16:].view(wire) if strided else np.zeros((len(blocks), 256), wire)
    rows[...] = rng.standard_normal(rows.shape).astype(np.float32).astype(wire)
    acc = rng.standard_normal(layout.blocks.padded_elems).astype(np.float32)
    want_acc, want_received = acc.astype(np.float64), received.copy()
    want = _numpy_merge_rows(want_acc, want_received, reliable, blocks, frags, layout, rows)
    got = merge_rows_(acc, received, reliable, blocks, frags, layout.frags_per_block, 1024,
                      5000, 256, rows)
    assert got == want == 6
    np.testing.assert_array_equal(received, want_received)
    np.testing.assert_allclose(acc, want_acc, rtol=1e-6, atol=1e-6)


def test_merge_rows_with_marks_zeroes_each_blocks_first_data_before_adding(rng):
    """With ``filled``, the accumulator holds stale values outside the filled blocks: a
    block's first fresh row zeroes the block, so the block ends as the sum of its rows; a
    filled block is added to; a duplicate marks nothing."""
    from dgt.partition import FragmentLayout
    layout = FragmentLayout(BlockLayout(5000, 1024), 256)
    blocks = np.array([0, 0, 1, 2, 4, 4, 0], np.int64)
    frags = np.array([0, 1, 3, 2, 3, 0, 1], np.int64)  # (0, 1) twice; (4, 3) is short
    received = np.zeros(layout.n_slots, bool)
    reliable = np.zeros(layout.blocks.n_blocks, bool)
    filled = np.zeros(layout.blocks.n_blocks, bool)
    filled[1] = True  # block 1 holds a push's data
    rows = rng.standard_normal((len(blocks), 256)).astype(np.float32)
    acc = rng.standard_normal(layout.blocks.padded_elems).astype(np.float32)
    want = acc.astype(np.float64)
    for block in (0, 2, 4):  # what zeroing the first data's blocks leaves
        lo, hi = layout.blocks.block_range(block)
        want[lo:hi] = 0
    _numpy_merge_rows(want, received.copy(), reliable, blocks, frags, layout, rows)
    got = merge_rows_(acc, received, reliable, blocks, frags, layout.frags_per_block, 1024,
                      5000, 256, rows, filled=filled)
    assert got == 6
    np.testing.assert_allclose(acc, want, rtol=1e-6, atol=1e-6)
    assert filled.tolist() == [True, True, True, False, True]
    assert merge_rows_(acc, received, reliable, blocks, frags, layout.frags_per_block, 1024,
                       5000, 256, rows, filled=filled[:3]) == -1  # marks of another layout


def test_merge_rows_refuses_indices_outside_the_layout_and_changes_nothing():
    acc = np.zeros(2048, np.float32)
    received, reliable = np.zeros(8, bool), np.zeros(2, bool)
    rows = np.ones((2, 256), np.float32)
    good = np.array([0, 0], np.int64)
    for blocks, frags in ((np.array([0, 2], np.int64), good),  # block 2 of 2
                          (good, np.array([1, 4], np.int64)),  # fragment 4 of 4
                          (good, np.array([0, -1], np.int64))):
        with pytest.raises(ValueError, match="outside"):
            merge_rows_(acc, received, reliable, blocks, frags, 4, 1024, 2048, 256, rows)
    with pytest.raises(ValueError, match="outside"):  # a fragment longer than its row
        merge_rows_(acc, received, reliable, good, np.array([0, 1], np.int64), 4, 1024, 2048,
                    256, rows[:, :100])
    assert not received.any() and not acc.any()


def test_merge_rows_leaves_other_dtypes_to_numpy():
    acc = np.zeros(2048, np.float32)
    received, reliable = np.zeros(8, bool), np.zeros(2, bool)
    blocks = frags = np.array([0], np.int64)
    rows = np.ones((1, 256), np.float32)
    args = (4, 1024, 2048, 256)
    assert merge_rows_(acc, received, reliable, blocks, frags, *args,
                       rows.astype(np.float16)) == -1
    assert merge_rows_(acc.astype(np.float64), received, reliable, blocks, frags, *args,
                       rows) == -1
    assert merge_rows_(acc, received, reliable, blocks.astype(np.int32), frags, *args,
                       rows) == -1
    assert not received.any() and not acc.any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scale_ranges_equals_numpy_multiplying_by_a_factor_per_element(rng, dtype):
    """rescale mode's scaling of a few ranges against the whole-part factor array it
    replaced (cast to the accumulator's dtype, as that one was): the same bits."""
    acc = rng.standard_normal(5000).astype(dtype)
    starts, stops = np.array([0, 1024, 4096, 4900]), np.array([256, 1280, 4352, 5000])
    factors = 3 / np.array([1, 2, 2, 1])
    per_elem = np.ones(acc.size)
    for start, stop, factor in zip(starts, stops, factors):
        per_elem[start:stop] = factor
    expected = acc * per_elem.astype(dtype)
    out = scale_ranges_(acc, starts, stops, factors)
    assert out is acc and np.array_equal(acc, expected)


def test_scale_ranges_refuses_ranges_outside_and_mismatched_lengths():
    acc = np.ones(100, np.float32)
    with pytest.raises(ValueError, match="outside"):
        scale_ranges_(acc, np.array([90]), np.array([101]), np.array([2.0]))
    with pytest.raises(ValueError, match="1 starts, 1 stops and 2 factors"):
        scale_ranges_(acc, np.array([0]), np.array([10]), np.array([2.0, 3.0]))
    assert (acc == 1).all()


@pytest.mark.parametrize("n_elems", [1, 1024, 5 * 1024 + 17])
def test_weights_delta_is_the_rounded_step_and_moves_the_held_copy_by_it(rng, n_elems):
    weights = rng.uniform(0.5, 1.5, n_elems).astype(np.float32)
    held = weights + rng.standard_normal(n_elems).astype(np.float32) * 1e-3
    expected_delta = (weights - held).astype(BFLOAT16)
    expected_held = held + expected_delta.astype(np.float32)
    out = weights_delta_bfloat16_(weights, held, np.empty(n_elems, BFLOAT16))
    np.testing.assert_array_equal(out.view(np.uint16), expected_delta.view(np.uint16))
    np.testing.assert_array_equal(held, expected_held)


def test_weights_delta_of_other_dtypes_takes_the_numpy_path(rng):
    weights = rng.standard_normal(300)
    held = np.zeros(300)
    out = weights_delta_bfloat16_(weights, held, np.empty(300, BFLOAT16))
    np.testing.assert_array_equal(out.view(np.uint16),
                                  weights.astype(np.float32).astype(BFLOAT16).view(np.uint16))
    np.testing.assert_array_equal(held, out.astype(np.float64))
    with pytest.raises(ValueError, match="shapes"):
        weights_delta_bfloat16_(weights, held[:10], out)


@pytest.mark.parametrize("n_elems", [1, 1024, 5 * 1024 + 17])
def test_add_bfloat16_widens_and_adds_as_numpy(rng, n_elems):
    target = rng.standard_normal(n_elems).astype(np.float32)
    delta = rng.standard_normal(n_elems).astype(BFLOAT16)
    expected = target + delta.astype(np.float32)
    frozen = np.frombuffer(delta.tobytes(), dtype=BFLOAT16)  # read-only, as from ZeroMQ
    np.testing.assert_array_equal(add_bfloat16_(target, frozen), expected)
    other = target.astype(np.float64)
    np.testing.assert_array_equal(add_bfloat16_(other, delta), target + delta.astype(np.float64))
    with pytest.raises(ValueError, match="shapes"):
        add_bfloat16_(target, delta[:-1] if n_elems > 1 else delta[:0])
