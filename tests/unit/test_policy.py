import math

import numpy as np
import pytest

from dgt.policy import AdaptiveThreshold, assign_channels, reliable_count


def naive_channels(scores, k, C):
    """Straight transcription of the classification rule, one block at a time."""
    n = len(scores)
    order = sorted(range(n), key=lambda b: (-scores[b], b))
    m = n if n <= 1 else min(n, math.floor(k * n + 0.5))
    out = [0] * n
    rest = n - m
    for rank, block in enumerate(order):
        out[block] = 0 if rank < m else 1 + ((rank - m) * C) // rest
    return out


@pytest.mark.parametrize("n", [1, 2, 7, 10, 98, 1000])
@pytest.mark.parametrize("k", [0.0, 0.3, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("C", [1, 3, 7])
def test_assign_channels_matches_the_rule(n, k, C, rng):
    scores = rng.random(n)
    assert assign_channels(scores, k, C).tolist() == naive_channels(scores, k, C)


def test_top_k_reliable_and_bands_in_importance_order():
    scores = np.arange(10, dtype=float)  # block 9 most important
    channels = assign_channels(scores, 0.4, 3)
    assert set(np.flatnonzero(channels == 0)) == {6, 7, 8, 9}
    assert channels[[5, 4]].tolist() == [1, 1] and channels[[3, 2]].tolist() == [2, 2]
    assert channels[[1, 0]].tolist() == [3, 3]


def test_single_block_is_always_reliable():
    assert assign_channels(np.array([0.1]), 0.0, 3).tolist() == [0]
    assert reliable_count(0.0, 1) == 1 and reliable_count(0.25, 10) == 3  # half-up: 2.5 -> 3


def test_random_order_is_seeded_and_changes_per_step():
    scores = np.ones(50)
    a = assign_channels(scores, 0.5, 3, np.random.default_rng([1, 0, 0, 0, 1]))
    b = assign_channels(scores, 0.5, 3, np.random.default_rng([1, 0, 0, 0, 1]))
    c = assign_channels(scores, 0.5, 3, np.random.default_rng([1, 0, 0, 0, 2]))
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()
    assert (a == 0).sum() == 25


def test_adaptive_threshold_starts_at_k0_and_ignores_invalid_signals():
    t = AdaptiveThreshold(0.8, 0.2, smoothing=0.0)
    assert t.k == 0.8
    for bad in (float("nan"), 0.0, -1.0, float("inf")):
        t.observe(bad)
    assert t.k == 0.8 and t.reference is None


def test_adaptive_threshold_follows_loss_and_is_clamped():
    t = AdaptiveThreshold(0.8, 0.2, smoothing=0.0)
    t.observe(2.0)
    t.observe(1.0)
    assert t.k == pytest.approx(0.4)
    t.observe(0.1)
    assert t.k == 0.2  # floor
    t.observe(10.0)
    assert t.k == 1.0  # ceiling (the reference had none)


def test_adaptive_threshold_smooths_the_signal():
    t = AdaptiveThreshold(0.8, 0.0, smoothing=0.9)
    t.observe(1.0)
    t.observe(0.0001)  # one noisy batch barely moves k
    assert t.k == pytest.approx(0.8 * (0.9 + 0.1 * 0.0001))


def test_adaptive_threshold_disabled_or_new_source():
    t = AdaptiveThreshold(0.8, 0.2, 0.0, enabled=False)
    t.observe(1.0)
    t.observe(0.1)
    assert t.k == 0.8
    t = AdaptiveThreshold(0.8, 0.2, 0.0)
    t.observe(100.0, "gradient norm")
    t.observe(50.0, "gradient norm")
    t.observe(3.0, "loss")  # a reported loss restarts L_0
    assert t.k == pytest.approx(0.8) and t.source == "loss"
