import numpy as np

from dgt.lossmodel import dropped_slots
from dgt.memory import ResidualMemory


def test_residual_memory_carries_exactly_the_missing_values():
    memory = ResidualMemory()
    sent = np.arange(6, dtype=np.float32)
    missing = np.array([0, 1, 0, 0, 1, 0], dtype=bool)
    assert memory.remember("k", sent, missing) == 2
    nxt = memory.compensate("k", np.ones(6, np.float32))
    np.testing.assert_array_equal(nxt, [1, 2, 1, 1, 5, 1])
    assert memory.owed("k") is None  # consumed
    assert memory.compensate("k", np.ones(2, np.float32)) is not None


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
