import numpy as np

from dgt.lossmodel import dropped_slots
from dgt.memory import ResidualMemory


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
