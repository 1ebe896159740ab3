import numpy as np
import pytest

from dgt.partition import BlockLayout, FragmentLayout, fragment_elems, home_server, plan_parts


@pytest.mark.parametrize("n, b, blocks, last", [(1, 1024, 1, 1), (1023, 1024, 1, 1023),
                                                 (1024, 1024, 1, 1024), (1025, 1024, 2, 1),
                                                 (100000, 1024, 98, 672)])
def test_block_layout_counts(n, b, blocks, last):
    layout = BlockLayout(n, b)
    assert layout.n_blocks == blocks and layout.last_block_elems == last
    assert layout.block_lengths.sum() == n


def test_gather_then_scatter_restores_the_chosen_blocks(rng):
    layout = BlockLayout(5000, 64)
    flat = rng.standard_normal(5000).astype(np.float32)
    chosen = np.array([0, 3, 7, layout.n_blocks - 1])
    payload = layout.gather(flat, chosen)
    expected = np.concatenate([flat[b * 64:(b + 1) * 64] for b in chosen])
    np.testing.assert_array_equal(payload, expected)
    assert payload.size == layout.payload_elems(chosen)
    padded = np.zeros(layout.padded_elems, dtype=np.float32)
    layout.scatter_add_(padded, chosen, payload)
    mask = np.zeros(5000, dtype=bool)
    for b in chosen:
        mask[b * 64:(b + 1) * 64] = True
    np.testing.assert_array_equal(padded[:5000][mask], flat[mask])
    assert not padded[:5000][~mask].any()


@pytest.mark.parametrize("n", [5000, 4992])  # last block short / full
def test_scatter_into_fresh_blocks_in_chunks_equals_zeroing_then_adding(rng, n):
    layout = BlockLayout(n, 64)
    flat = rng.standard_normal(n).astype(np.float32)
    for chosen in (np.sort(rng.choice(layout.n_blocks, 40, replace=False)),
                   np.arange(layout.n_blocks), np.array([], dtype=np.int64),
                   np.array([layout.n_blocks - 1]), np.arange(10, 30)):
        payload = layout.gather(flat, chosen)
        expected = np.zeros(layout.padded_elems, np.float32)
        for b in chosen:  # the oracle: block by block
            lo, hi = layout.block_range(int(b))
            expected[lo:hi] = flat[lo:hi]
        padded = np.full(layout.padded_elems, np.nan, np.float32)  # garbage to overwrite
        groups = layout.chunk_blocks(chosen, 64 * 7) if len(chosen) else [chosen]
        filled = np.zeros(layout.n_blocks, dtype=bool)
        offset = 0
        for group in groups:
            size = layout.payload_elems(group)
            layout.scatter_into_(padded, group, payload[offset:offset + size], filled)
            offset += size
        layout.zero_except_(padded, chosen)
        np.testing.assert_array_equal(padded, expected)
        assert np.array_equal(np.flatnonzero(filled), chosen)


@pytest.mark.parametrize("chosen", ["scattered", "runs", "all", "last only"])
def test_scatter_add_by_runs_or_by_rows_equals_block_by_block(rng, chosen):
    layout = BlockLayout(5000, 64)  # last block short
    blocks = {"scattered": np.sort(rng.choice(layout.n_blocks, 30, replace=False)),
              "runs": np.concatenate([np.arange(3, 20), np.arange(40, layout.n_blocks)]),
              "all": np.arange(layout.n_blocks),
              "last only": np.array([layout.n_blocks - 1])}[chosen]
    flat = rng.standard_normal(5000).astype(np.float32)
    payload = layout.gather(flat, blocks)
    start = rng.standard_normal(layout.padded_elems).astype(np.float32)
    expected = start.copy()
    for b in blocks:
        lo, hi = layout.block_range(int(b))
        expected[lo:hi] += flat[lo:hi]
    padded = start.copy()
    layout.scatter_add_(padded, blocks, payload)
    np.testing.assert_array_equal(padded, expected)


def test_gather_without_last_block_and_empty(rng):
    layout = BlockLayout(300, 100)
    flat = np.arange(300, dtype=np.float32)
    np.testing.assert_array_equal(layout.gather(flat, np.array([1])), flat[100:200])
    assert layout.gather(flat, np.array([], dtype=np.int64)).size == 0


def test_fragment_layout_matches_a_naive_enumeration():
    layout = FragmentLayout(BlockLayout(2500, 1024), 350)
    assert layout.frags_per_block == 3
    naive = []
    for b in range(layout.blocks.n_blocks):
        start, stop = layout.blocks.block_range(b)
        for j, f in enumerate(range(start, stop, 350)):
            naive.append((b * 3 + j, f, min(f + 350, stop)))
    valid = np.flatnonzero(layout.valid_slots)
    assert valid.tolist() == [s for s, _, _ in naive]
    for slot, start, stop in naive:
        assert layout.frag_range(slot // 3, slot % 3) == (start, stop)
    assert layout.slots_of_blocks(np.array([2])).tolist() == [6, 7]  # last block: 452 elems


def test_element_mask_expands_slots():
    layout = FragmentLayout(BlockLayout(2500, 1024), 350)
    slots = np.zeros(layout.n_slots, dtype=bool)
    slots[[1, 7]] = True
    mask = layout.element_mask(slots)
    expected = np.zeros(2500, dtype=bool)
    expected[350:700] = True
    expected[2048 + 350:2500] = True
    np.testing.assert_array_equal(mask, expected)


def test_plan_parts_shards_small_and_slices_big_tensors():
    assert [p.server for p in plan_parts(10, key_id=3, num_servers=4, bigarray_elems=100)] == [
        home_server(3, 4)]
    parts = plan_parts(1001, key_id=0, num_servers=3, bigarray_elems=100)
    assert [(p.server, p.start, p.stop) for p in parts] == [(0, 0, 333), (1, 333, 667),
                                                           (2, 667, 1001)]
    assert plan_parts(5, 0, 1, 1)[0].n_elems == 5
    # part_elems cuts big tensors for pipelining; with one server every part stays home
    cut = plan_parts(2500, key_id=1, num_servers=1, bigarray_elems=10**6, part_elems=1000)
    assert [(p.server, p.index, p.start, p.stop) for p in cut] == [
        (0, 0, 0, 833), (0, 1, 833, 1666), (0, 2, 1666, 2500)]
    spread = plan_parts(5000, key_id=1, num_servers=2, bigarray_elems=1000, part_elems=1000)
    assert [p.server for p in spread] == [0, 1, 0, 1, 0]
    assert sum(p.n_elems for p in spread) == 5000


def test_slot_ranges_match_frag_range():
    layout = FragmentLayout(BlockLayout(2500, 1024), 350)
    slots = np.flatnonzero(layout.valid_slots)
    starts, stops = layout.slot_ranges(slots)
    assert list(zip(starts.tolist(), stops.tolist())) == [
        layout.frag_range(s // 3, s % 3) for s in slots]


@pytest.mark.parametrize("block, itemsize, payload, expected", [
    (1024, 4, 1400, 256), (1024, 2, 1400, 512), (1000, 4, 1400, 250), (300, 4, 1400, 300),
    (1021, 4, 1400, 350),  # prime: no divisor near, plain maximum
])
def test_fragment_elems_prefers_equal_fragments(block, itemsize, payload, expected):
    fe = fragment_elems(block, itemsize, payload)
    assert fe == expected and fe * itemsize <= payload


@pytest.mark.parametrize("n, chosen", [(5000, [0, 3, 7, 78]), (5000, [2, 5]), (4992, [77]),
                                       (5000, []), (64, [0]), (5000, list(range(79)))])
def test_expand_writes_the_blocks_and_zeroes_the_rest_of_an_unpadded_array(rng, n, chosen):
    layout = BlockLayout(n, 64)
    chosen = np.array(chosen, dtype=np.int64)
    source = rng.standard_normal(n).astype(np.float32)
    out = rng.standard_normal(n).astype(np.float32)  # stale values: all must be replaced
    layout.expand_(out, chosen, layout.gather(source, chosen))
    expected = np.zeros(n, np.float32)
    for b in chosen.tolist():  # block by block, the oracle
        expected[b * 64:(b + 1) * 64] = source[b * 64:(b + 1) * 64]
    np.testing.assert_array_equal(out, expected)


def test_home_server_spreads_alternating_weights_and_biases():
    # Gluon's key order: weight, bias, weight, bias...  MXNet's (key * 9973) % 2 is the
    # parity, which put every weight on one server.
    sizes = [100_000 if key % 2 == 0 else 100 for key in range(116)]
    for servers in (2, 3, 4):
        load = [0] * servers
        for key, size in enumerate(sizes):
            load[home_server(key, servers)] += size
        assert max(load) < 1.5 * sum(load) / servers, (servers, load)
    parity = [0, 0]
    for key, size in enumerate(sizes):
        parity[(key * 9973) % 2] += size
    assert min(parity) < 0.01 * sum(parity)  # the old rule, for contrast


def _splitmix64(key):  # the published algorithm in plain integers, the oracle
    mask = (1 << 64) - 1
    x = (key + 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def test_home_server_is_splitmix64_of_the_key_alone():
    # Workers place keys without talking, so the rule must not drift between versions.
    for servers in (1, 2, 3, 7):
        assert [home_server(k, servers) for k in [*range(200), 2 ** 32 - 1]] == [
            _splitmix64(k) % servers for k in [*range(200), 2 ** 32 - 1]]
