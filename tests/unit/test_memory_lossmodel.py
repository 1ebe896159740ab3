import numpy as np
import pytest

from dgt.lossmodel import dropped_slots
from dgt.memory import ResidualMemory
from dgt.partition import BlockLayout, FragmentLayout


def test_residual_memory_carries_exactly_the_missing_values():
    memory = ResidualMemory()
    sent = np.arange(6, dtype=np.float32)
    assert memory.remember("k", sent, np.array([1, 4]), np.array([2, 5])) == 2
    nxt = memory.compensate("k", np.ones(6, np.float32))
    np.testing.assert_array_equal(nxt, [1, 2, 1, 1, 5, 1])
    assert memory.owed("k") is None  # consumed
    assert memory.remember("k", sent, np.array([], int), np.array([], int)) == 0
    out = np.empty(6, np.float16)
    memory.remember("h", sent, np.array([0]), np.array([6]))
    assert memory.compensate("h", np.ones(6, np.float16), out=out) is out
    np.testing.assert_array_equal(out, np.arange(6) + 1)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_residual_memory_against_a_dense_ledger_over_steps(dtype, in_place):
    """Seeded lost fragments over several steps: what compensate returns is the gradient plus
    a dense numpy residual kept by hand, and owed() is that residual, so at every step
    ``sum(merged) + owed == sum(pushed)`` (exact: integer values).  ``in_place``: the owed
    values are added into the gradient itself (``out=grad``)."""
    rng = np.random.default_rng(11)
    layout = FragmentLayout(BlockLayout(10_000, 1024), 300)  # short last fragments and block
    memory, residual = ResidualMemory(), np.zeros(10_000)
    pushed_total, merged_total = np.zeros(10_000), np.zeros(10_000)
    out = np.empty(10_000, dtype)
    for step in range(6):
        grad = rng.integers(-8, 9, 10_000).astype(dtype)
        pushed_total += grad
        expected = (grad + residual).astype(dtype)
        sent = memory.compensate("k", grad, out=grad if in_place else out)
        np.testing.assert_array_equal(sent, expected)
        if in_place and step:
            assert sent is grad
        lost = (rng.random(layout.n_slots) < 0.3) & layout.valid_slots
        starts, stops = layout.slot_ranges(np.flatnonzero(lost))
        mask = layout.element_mask(lost)  # the lost elements, computed another way
        residual = np.where(mask, sent, 0.0)
        merged_total += np.where(mask, 0.0, sent)
        assert memory.remember("k", sent, starts, stops) == mask.sum()
        np.testing.assert_array_equal(memory.owed("k"), residual)
        np.testing.assert_array_equal(merged_total + memory.owed("k"), pushed_total)


def test_residual_memory_refuses_a_gradient_of_another_length():
    memory = ResidualMemory()
    memory.remember("k", np.ones(10, np.float32), np.array([2]), np.array([5]))
    with pytest.raises(ValueError, match="owes values for 10 elements, got a gradient of 12"):
        memory.compensate("k", np.ones(12, np.float32))


def test_dropped_slots_is_deterministic_and_order_free():
    slots = np.arange(10000)
    a = dropped_slots(0.2, 7, 1, 3, 0, 5, slots)
    b = dropped_slots(0.2, 7, 1, 3, 0, 5, slots[::-1])[::-1]
    np.testing.assert_array_equal(a, b)
    assert 0.18 < a.mean() < 0.22
    assert (a != dropped_slots(0.2, 7, 1, 3, 0, 6, slots)).any()  # new step, new draw
    assert (a != dropped_slots(0.2, 8, 1, 3, 0, 5, slots)).any()  # new seed, new draw
    assert not dropped_slots(0.0, 7, 1, 3, 0, 5, slots).any()
    assert dropped_slots(1.0, 7, 1, 3, 0, 5, slots).all()


def test_absorb_makes_the_members_residuals_the_buckets_at_their_offsets():
    memory = ResidualMemory()
    a, b = np.arange(1, 7, dtype=np.float32), np.arange(10, 14, dtype=np.float32)
    memory.remember("a", a, np.array([0, 4]), np.array([2, 6]))   # owes a[0:2], a[4:6]
    memory.remember("b", b, np.array([1]), np.array([4]))          # owes b[1:4]
    memory.remember("bucket", np.full(10, 7, np.float32), np.array([2]), np.array([3]))
    assert memory.absorb("bucket", 10, [("b", 6), ("a", 0), ("never", 3)]) == 7
    assert memory.owed("a") is None and memory.owed("b") is None
    np.testing.assert_array_equal(memory.owed("bucket"), [1, 2, 7, 0, 5, 6, 0, 11, 12, 13])
    nxt = memory.compensate("bucket", np.ones(10, np.float32))
    np.testing.assert_array_equal(nxt, [2, 3, 8, 1, 6, 7, 1, 12, 13, 14])
    assert memory.absorb("bucket", 10, [("a", 0)]) == 0  # nothing left to move
    memory.remember("c", a, np.array([0]), np.array([6]))
    with pytest.raises(ValueError, match="6 elements at offset 6 do not fit"):
        memory.absorb("bucket", 10, [("c", 6)])
    np.testing.assert_array_equal(memory.owed("c"), a)  # refused: still owed where it was


def test_split_gives_each_member_its_slice_of_the_buckets_residual():
    memory = ResidualMemory()
    bucket = np.arange(1, 11, dtype=np.float32)
    memory.remember("bucket", bucket, np.array([1, 5]), np.array([3, 9]))  # 2 3 | 6 7 8 9
    memory.remember("b", np.full(4, 100, np.float32), np.array([3]), np.array([4]))
    # a: [0, 6), b: [6, 10); the range [5, 9) crosses from a into b and is cut there
    assert memory.split("bucket", [("a", 0, 6), ("b", 6, 4), ("nothing", 6, 0)]) == 6
    assert not memory.owes("bucket") and not memory.owes("nothing")
    np.testing.assert_array_equal(memory.owed("a"), [0, 2, 3, 0, 0, 6])
    np.testing.assert_array_equal(memory.owed("b"), [7, 8, 9, 100])  # its own kept, added to
    assert memory.split("bucket", [("a", 0, 6)]) == 0  # nothing left to move
    memory.remember("bucket", bucket, np.array([0]), np.array([10]))
    with pytest.raises(ValueError, match="4 elements at offset 8 do not fit"):
        memory.split("bucket", [("a", 0, 6), ("c", 8, 4)])
    np.testing.assert_array_equal(memory.owed("bucket"), bucket)  # refused: still owed there
    np.testing.assert_array_equal(memory.owed("a"), [0, 2, 3, 0, 0, 6])
