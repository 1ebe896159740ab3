import numpy as np
import pytest

from dgt.errors import RemoteProtocolError
from dgt.partition import BlockLayout, FragmentLayout
from dgt.wire import (BFLOAT16, CHUNK_BYTES, HEADER_BYTES, Header, MsgType, data_headers,
                      decode_blocks, decode_datagram, decode_header, decode_scores, dtype_code,
                      encode_header, expected_fragment_bytes, frame_datagrams,
                      split_blocks, sum_reply_frames)

from .wire_oracles import check_datagrams, header_runs


def data_header(**kw):
    base = dict(job=9, rank=1, channel=2, dtype=1, key=5, part=0, step=3, n_elems=2500,
                block_elems=1024, frag_elems=350, block=2, frag=1)
    base.update(kw)
    return Header(MsgType.DATA, **base)


def datagram(header, nbytes=None):
    size = expected_fragment_bytes(header) if nbytes is None else nbytes
    return encode_header(header) + np.arange(size, dtype=np.uint8).tobytes()


def test_header_round_trip_every_type():
    for mtype in MsgType:
        header = Header(mtype, job=2**32 - 1, rank=65535, channel=7, dtype=2, key=2**31,
                        part=3, flags=5, step=123456, n_elems=10**9, block_elems=1024,
                        frag_elems=700, block=17, frag=2, udp_expected=9, udp_merged=8,
                        udp_late=1, grace_us=5000)
        assert decode_header(encode_header(header)) == header
    assert len(encode_header(Header(MsgType.ACK))) == HEADER_BYTES


def test_datagram_round_trip_gives_a_payload_view():
    header = data_header()
    buf = datagram(header)
    decoded, payload = decode_datagram(buf)
    assert decoded == header
    assert len(payload) == (452 - 350) * 4  # last block has 452 elems, frag 1 holds 102
    assert bytes(payload) == buf[HEADER_BYTES:]


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b[:10], "shorter than a header"),
    (lambda b: b"XX" + b[2:], "bad magic"),
    (lambda b: b[:2] + bytes([99]) + b[3:], "unsupported protocol version"),
    (lambda b: b[:3] + bytes([200]) + b[4:], "unknown message type"),
    (lambda b: b[:-4], "payload of"),
    (lambda b: b + b"\0", "payload of"),
])
def test_corrupted_datagrams_are_rejected(mutate, message):
    with pytest.raises(RemoteProtocolError, match=message):
        decode_datagram(mutate(datagram(data_header())))


@pytest.mark.parametrize("fields, message", [
    (dict(block=3), "block 3 out of range"),
    (dict(frag=2), "fragment 2 out of range"),
    (dict(dtype=3), "may not travel over UDP"),
    (dict(dtype=77), "may not travel over UDP"),
    (dict(channel=0), "channel 0"),
    (dict(n_elems=0), "bad sizes"),
    (dict(frag_elems=0), "bad sizes"),
])
def test_out_of_range_fields_are_rejected(fields, message):
    header = data_header(**fields)
    with pytest.raises(RemoteProtocolError, match=message):
        decode_datagram(encode_header(header) + bytes(400))


def test_non_data_type_is_rejected_on_udp():
    with pytest.raises(RemoteProtocolError, match="expected DATA"):
        decode_datagram(encode_header(Header(MsgType.PUSH)))


def test_random_bytes_only_ever_raise_remote_protocol_error(rng):
    valid = datagram(data_header())
    for _ in range(3000):
        buf = bytearray(valid)
        for pos in rng.integers(0, len(buf), size=rng.integers(1, 6)):
            buf[pos] = rng.integers(0, 256)
        buf = bytes(buf[:rng.integers(0, len(buf) + 1)])
        try:
            decode_datagram(buf)
        except RemoteProtocolError:
            pass


def test_vectorised_checks_agree_with_the_decoder(rng):
    """check_datagrams (the scan's numpy reference) accepts exactly what decode_datagram does."""
    from dgt.wire import HEADER_DTYPE

    valid = datagram(data_header())
    samples = [valid, datagram(data_header(block=0, frag=0)), datagram(data_header(dtype=2)),
               datagram(data_header(dtype=10))]
    for _ in range(3000):
        buf = bytearray(valid)
        for pos in rng.integers(0, HEADER_BYTES, size=rng.integers(1, 4)):
            buf[pos] = rng.integers(0, 256)
        samples.append(bytes(buf[:rng.integers(HEADER_BYTES, len(buf) + 1)]))
    width = max(len(b) for b in samples)
    rows = np.zeros((len(samples), width), np.uint8)
    for i, b in enumerate(samples):
        rows[i, :len(b)] = np.frombuffer(b, np.uint8)
    headers = np.ascontiguousarray(rows[:, :HEADER_BYTES]).view(HEADER_DTYPE).reshape(-1)
    batch = check_datagrams(headers, np.array([len(b) for b in samples]))
    for ok, b in zip(batch, samples):
        try:
            decode_datagram(b)
            expected = True
        except RemoteProtocolError:
            expected = False
        assert ok == expected, b[:HEADER_BYTES].hex()
    assert batch[:4].all() and not batch.all()


def test_batch_scan_gives_the_verdicts_and_runs_of_the_numpy_checks(rng):
    """scan_datagram_batch (one compiled pass) refuses and cuts a batch exactly as
    check_datagrams, the job and sender tests and header_runs do: fuzzed headers, another
    job's datagrams, an unknown sender, pushes interleaved, float32 and bfloat16."""
    from dgt.wire import HEADER_DTYPE, scan_datagram_batch

    pushes = [data_header(job=job, rank=rank, key=key, step=step, dtype=dtype)
              for job in (9, 8) for rank in (0, 1, 2) for key in (5, 6) for step in (3, 4)
              for dtype in (1, 10)]
    owner = np.repeat(rng.integers(0, len(pushes), 300), rng.integers(1, 6, 300))
    samples = []
    for p in owner.tolist():
        header = pushes[p]._replace(block=int(rng.integers(0, 3)), frag=int(rng.integers(0, 3)))
        try:
            nbytes = expected_fragment_bytes(header)
        except RemoteProtocolError:  # a fragment past its block's end: malformed
            nbytes = 64
        buf = bytearray(datagram(header, nbytes=nbytes))
        if rng.random() < 0.2:  # a corrupted header byte, or a cut datagram
            buf[rng.integers(0, HEADER_BYTES)] = rng.integers(0, 256)
        if rng.random() < 0.05:
            buf = buf[:rng.integers(0, len(buf) + 1)]
        samples.append(bytes(buf))
    width = max(len(b) for b in samples)
    buffer = np.zeros((len(samples) + 3, width + 8), np.uint8)  # as a receiver's, reused
    buffer[:, :HEADER_BYTES] = rng.integers(0, 256, (len(samples) + 3, HEADER_BYTES))
    for i, b in enumerate(samples):
        buffer[i, :len(b)] = np.frombuffer(b, np.uint8)
    sizes = np.array([len(b) for b in samples], np.int64)
    known = np.array([True, True, False])
    rows = buffer[:len(samples)]

    batch = scan_datagram_batch(rows, sizes, 9, known)

    headers = np.ascontiguousarray(rows[:, :HEADER_BYTES]).view(HEADER_DTYPE).reshape(-1)
    valid = check_datagrams(headers, sizes)
    foreign = valid & (headers["job"] != 9)
    ranks = headers["rank"].astype(np.int64)
    unknown = valid & ~foreign & ~known[np.minimum(ranks, 2)] | (valid & ~foreign & (ranks > 2))
    good = valid & ~foreign & ~unknown
    assert batch.refused == {"malformed": int((~valid).sum()), "foreign": int(foreign.sum()),
                             "unknown_sender": int(unknown.sum())}
    assert 0 < good.sum() < len(samples) and batch.refused["foreign"] > 0
    assert batch.refused["unknown_sender"] > 0 and batch.refused["malformed"] > 0
    expected = header_runs(headers, np.flatnonzero(good))
    assert len(batch.runs) == len(expected) > 20
    for (members, fields), want in zip(batch.runs, expected):
        assert np.array_equal(members, want)
        first = headers[want[0]]
        assert fields == tuple(int(first[name]) for name in
                               ("job", "rank", "dtype", "key", "part", "step", "n_elems",
                                "block_elems", "frag_elems"))
    assert np.array_equal(batch.blocks[good], headers["block"][good])
    assert np.array_equal(batch.frags[good], headers["frag"][good])
    empty = scan_datagram_batch(rows[:0], sizes[:0], 9, known)
    assert empty.runs == [] and sum(empty.refused.values()) == 0


def test_batch_scan_refuses_rows_shorter_than_a_header():
    from dgt.wire import scan_datagram_batch

    with pytest.raises(ValueError, match="rows must be uint8"):
        scan_datagram_batch(np.zeros((2, HEADER_BYTES - 1), np.uint8), np.zeros(2, np.int64),
                            9, np.ones(2, bool))


def test_header_runs_cut_at_every_change_of_push_and_cover_each_row_once():
    rng = np.random.default_rng(7)
    pushes = [Header(MsgType.DATA, job=9, rank=r, key=k, step=s, dtype=1, n_elems=4096,
                     block_elems=1024, frag_elems=256)
              for r in (0, 1) for k in (3, 4) for s in (0, 1)]
    # Runs of random length, pushes interleaved and revisited, as from two senders.
    owner = np.repeat(rng.integers(0, len(pushes), 40), rng.integers(1, 9, 40))
    headers = np.concatenate([data_headers(pushes[p], np.array([1]), np.array([0]),
                                           np.array([0])) for p in owner])
    index = np.flatnonzero(rng.random(len(owner)) < 0.8)  # some rows invalid, skipped
    runs = header_runs(headers, index)
    assert np.array_equal(np.concatenate(runs), index)
    for run in runs:
        assert len(set(owner[run].tolist())) == 1  # one push per run
    for left, right in zip(runs, runs[1:]):
        assert owner[left[-1]] != owner[right[0]]  # maximal runs
    assert header_runs(headers, index[:0]) == []
    every = np.arange(len(owner))  # every row valid: the columns are compared unindexed
    whole = header_runs(headers, every)
    assert np.array_equal(np.concatenate(whole), every)
    assert [owner[r[0]] for r in whole] == [owner[i] for i in range(len(owner))
                                            if i == 0 or owner[i] != owner[i - 1]]


def test_split_blocks_then_decode_blocks_round_trips_across_frames(rng):
    layout = BlockLayout(3 * CHUNK_BYTES // 4 + 100, 1024)  # spans several frames
    blocks = np.sort(rng.choice(layout.n_blocks, 500, replace=False))
    blocks[-1] = layout.n_blocks - 1  # with the short last block
    blocks = np.unique(blocks)
    flat = rng.standard_normal(layout.n_elems).astype(np.float32)
    frames = [memoryview(f) for f in split_blocks(layout, blocks,
                                                   layout.gather(flat, blocks))]
    assert len(frames) > 1
    index = memoryview(blocks.astype(np.uint32))
    got, chunks = decode_blocks(layout, len(blocks), index, frames, np.dtype(np.float32))
    np.testing.assert_array_equal(got, blocks)
    np.testing.assert_array_equal(np.concatenate(chunks), layout.gather(flat, blocks))


@pytest.mark.parametrize("index, count, payload, message", [
    ([0, 2], 3, 2048, "does not hold 3"),
    ([2, 0], 2, 2048, "ascending"),
    ([0, 9], 2, 2048, "in range"),
    ([0, 2], 2, 2000, "do not match"),
])
def test_decode_blocks_refuses_inconsistent_frames(index, count, payload, message):
    layout = BlockLayout(5000, 1024)
    with pytest.raises(RemoteProtocolError, match=message):
        decode_blocks(layout, count, memoryview(np.array(index, np.uint32)),
                      [memoryview(np.zeros(payload, np.float32))], np.dtype(np.float32))


def test_a_sum_reply_is_sparse_only_when_it_leaves_out_a_tenth_of_the_blocks_or_more(rng):
    layout = BlockLayout(12 * 1024 - 300, 1024)  # 12 blocks, the last one short
    merged = rng.standard_normal(layout.n_elems).astype(np.float32)
    touched = np.ones(12, bool)
    touched[[3, 11]] = False
    merged[3 * 1024:4 * 1024] = 0
    merged[11 * 1024:] = 0
    index_frames, n_blocks, frames = sum_reply_frames(merged, touched, 1024)
    assert n_blocks == 10 and len(index_frames) == 1
    blocks, chunks = decode_blocks(layout, n_blocks, memoryview(index_frames[0]),
                                   [memoryview(f) for f in frames], np.dtype(np.float32))
    rebuilt = np.full(layout.n_elems, np.nan, np.float32)
    layout.expand_(rebuilt, blocks, np.concatenate(chunks))
    np.testing.assert_array_equal(rebuilt, merged)  # the gaps were zeros: nothing lost
    # One untouched block of 12 is not worth an index frame; no block information, no gaps.
    touched[3] = True
    for dense in (sum_reply_frames(merged, touched, 1024), sum_reply_frames(merged, None, 1024)):
        assert dense[:2] == ([], 0)
        np.testing.assert_array_equal(np.concatenate(dense[2]), merged)


def test_scores_frame_round_trips_and_a_wrong_length_is_refused():
    scores = np.array([0.5, 2.0, 1e-9], np.float32)
    frame = bytearray(scores.tobytes())
    decoded = decode_scores(frame, 3)
    np.testing.assert_array_equal(decoded, scores)
    frame[:4] = b"\0\0\0\0"  # a copy: the frame's buffer may be reused once it is decoded
    assert decoded[0] == 0.5
    with pytest.raises(RemoteProtocolError, match="scores frame of 12 bytes, the part has 4"):
        decode_scores(frame, 4)


def test_bfloat16_travels_in_two_bytes_and_rounds_to_nearest():
    from dgt.wire import BFLOAT16, code_dtype, dtype_code, is_float_dtype

    assert code_dtype(dtype_code(BFLOAT16)) == BFLOAT16 and is_float_dtype(BFLOAT16)
    header = data_header(dtype=dtype_code(BFLOAT16))
    _, payload = decode_datagram(datagram(header))
    assert len(payload) == (452 - 350) * 2
    # float32's range, 8 significant bits: 1 + 2**-8 is a tie and rounds to even (1.0),
    # 1 + 3 * 2**-8, also a tie, to 1 + 2**-6 (even); 1e38 stays finite, as float16 would not.
    values = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1e38, -3.0], np.float32)
    wire = values.astype(BFLOAT16)
    assert wire.nbytes == 8
    back = wire.astype(np.float32)
    assert back[0] == 1.0 and back[1] == 1 + 2.0 ** -6 and back[3] == -3.0
    assert np.isfinite(back[2]) and abs(back[2] / 1e38 - 1) < 2 ** -8


@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16])
@pytest.mark.parametrize("n_elems,frag_elems", [(4 * 1024 + 300, 256), (3 * 1024, 350)])
def test_frame_datagrams_decode_to_their_fragments(rng, dtype, n_elems, frag_elems):
    """Every datagram, row or odd one, decodes to its slot's header and the slot's values;
    rows keep the sending order and carry the full-size fragments only."""
    layout = FragmentLayout(BlockLayout(n_elems, 1024), frag_elems)
    values = rng.standard_normal(n_elems).astype(np.float32).astype(dtype)
    channels = rng.integers(1, 4, layout.blocks.n_blocks).astype(np.uint8)
    blocks = np.flatnonzero(channels)
    blocks = blocks[np.argsort(channels[blocks], kind="stable")]
    slots = layout.slots_of_blocks(blocks)
    base = Header(MsgType.DATA, job=9, rank=1, dtype=dtype_code(np.dtype(dtype)), key=5, part=2,
                  step=7, n_elems=n_elems, block_elems=1024, frag_elems=frag_elems)
    datagrams = frame_datagrams(base, layout, values, channels, slots)
    size = values.dtype.itemsize
    sent = [bytes(row) for row in datagrams.rows]
    for i, payload in enumerate(datagrams.odd_payloads):
        sent.append(datagrams.odd_headers[i * HEADER_BYTES:(i + 1) * HEADER_BYTES]
                    + payload.tobytes())
    assert len(sent) == len(slots)
    starts, stops = layout.slot_ranges(slots)
    full = (stops - starts) == frag_elems
    seen = {}
    for datagram in sent:
        header, payload = decode_datagram(datagram)
        seen[header.block * layout.frags_per_block + header.frag] = (header, bytes(payload))
    for slot, start, stop in zip(slots.tolist(), starts.tolist(), stops.tolist()):
        header, payload = seen[slot]
        assert header._replace(channel=0, block=0, frag=0) == base
        assert header.channel == channels[slot // layout.frags_per_block]
        assert payload == values[start:stop].tobytes()
    row_slots = [decode_datagram(bytes(r))[0] for r in datagrams.rows]
    assert [h.block * layout.frags_per_block + h.frag for h in row_slots] == \
        slots[full].tolist()
    assert datagrams.rows.shape == (full.sum(), HEADER_BYTES + frag_elems * size)
    assert np.array_equal(datagrams.row_channels, [h.channel for h in row_slots])


@pytest.mark.parametrize("n_elems,frag_elems", [(4 * 1024 + 300, 256), (3 * 1024, 350)])
def test_frame_datagrams_round_float32_to_bfloat16_on_the_way(rng, n_elems, frag_elems):
    """Framing float32 values for a bfloat16 wire gives, byte for byte, the datagrams of the
    values cast first (ml_dtypes' rounding), odd fragments included."""
    layout = FragmentLayout(BlockLayout(n_elems, 1024), frag_elems)
    values = (rng.standard_normal(n_elems) * 10.0 ** rng.integers(-30, 30, n_elems)
              ).astype(np.float32)
    values[:4] = [np.nan, -np.inf, 3.4e38, -0.0]
    channels = rng.integers(0, 4, layout.blocks.n_blocks).astype(np.uint8)
    slots = layout.slots_of_blocks(np.flatnonzero(channels))
    base = Header(MsgType.DATA, job=9, rank=1, dtype=dtype_code(BFLOAT16), key=5, part=2,
                  step=7, n_elems=n_elems, block_elems=1024, frag_elems=frag_elems)
    rounded = frame_datagrams(base, layout, values, channels, slots, BFLOAT16)
    cast_first = frame_datagrams(base, layout, values.astype(BFLOAT16), channels, slots)
    assert np.array_equal(rounded.rows, cast_first.rows)
    assert np.array_equal(rounded.row_channels, cast_first.row_channels)
    assert rounded.odd_headers == cast_first.odd_headers
    assert [p.tobytes() for p in rounded.odd_payloads] == \
        [p.tobytes() for p in cast_first.odd_payloads]
    assert rounded.rows.shape[1] == HEADER_BYTES + 2 * frag_elems
