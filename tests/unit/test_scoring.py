import numpy as np

from dgt.partition import BlockLayout
from dgt.scoring import ContributionState, block_mean_abs, score_blocks


def naive_mean_abs(flat, block):
    return np.array([np.mean(np.abs(flat[i:i + block].astype(np.float64)))
                     for i in range(0, len(flat), block)])


def test_block_mean_abs_matches_a_loop(rng):
    flat = rng.standard_normal(2500).astype(np.float32)
    np.testing.assert_allclose(block_mean_abs(BlockLayout(2500, 1024), flat),
                               naive_mean_abs(flat, 1024), rtol=1e-6)


def test_scores_are_an_ema_weighting_history_by_alpha(rng):
    layout = BlockLayout(3000, 500)
    state = ContributionState(alpha=0.3)
    expected = np.zeros(6)
    for _ in range(4):
        flat = rng.standard_normal(3000).astype(np.float32)
        expected = 0.3 * expected + 0.7 * naive_mean_abs(flat, 500)
        scores = score_blocks(state, ("k", 0), layout, flat)
    np.testing.assert_allclose(scores, expected, rtol=1e-5)


def test_float16_scores_do_not_overflow():
    flat = np.full(2048, 60000, dtype=np.float16)
    scores = score_blocks(ContributionState(0.3), 0, BlockLayout(2048, 1024), flat)
    np.testing.assert_allclose(scores, 0.7 * 60000, rtol=1e-3)


def test_scores_are_kept_per_key():
    state = ContributionState(0.5)
    layout = BlockLayout(4, 2)
    score_blocks(state, "a", layout, np.ones(4, np.float32))
    score_blocks(state, "b", layout, np.full(4, 3, np.float32))
    np.testing.assert_allclose(state.get("a"), [0.5, 0.5])
    np.testing.assert_allclose(state.get("b"), [1.5, 1.5])
