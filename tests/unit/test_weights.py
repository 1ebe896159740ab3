"""HeldWeights: when a server-side optimizer's reply is a delta, and what a worker then holds."""
import numpy as np

from dgt.weights import HeldWeights
from dgt.wire import BFLOAT16

KEY = (3, 0)


def test_first_reply_is_whole_then_deltas_bring_a_worker_to_the_weights(rng):
    held = HeldWeights(enabled=True)
    weights = rng.uniform(0.5, 1.5, 4000).astype(np.float32)
    payload, is_delta = held.reply(KEY, weights, BFLOAT16)
    assert not is_delta and payload is weights
    worker = payload.copy()
    for _ in range(200):
        # Steps far below bfloat16's spacing near 1 (2**-7).
        weights -= np.float32(1e-4) * rng.standard_normal(4000).astype(np.float32)
        payload, is_delta = held.reply(KEY, weights, BFLOAT16)
        assert is_delta and payload.dtype == BFLOAT16
        worker += payload.astype(np.float32)
    naive = weights.astype(BFLOAT16)  # a bfloat16 copy of the weights instead
    drift = np.abs(worker - weights)
    assert drift.max() < 1e-5  # one rounding of one step, not 200 of them
    assert np.abs(naive.astype(np.float32) - weights).max() > 100 * drift.max()


def test_whole_replies_for_float32_gradients_other_dtypes_when_disabled_and_after_forget(rng):
    weights = rng.standard_normal(100).astype(np.float32)
    on, off = HeldWeights(enabled=True), HeldWeights(enabled=False)
    for _ in range(2):
        assert off.reply(KEY, weights, BFLOAT16) == (weights, False)
        assert on.reply(KEY, weights, np.dtype(np.float32)) == (weights, False)
    assert len(on) == 0 and len(off) == 0
    on.reply(KEY, weights, BFLOAT16)
    assert on.reply(KEY, weights, BFLOAT16)[1]
    on.forget(KEY)  # init replaced the value: the next reply starts over
    assert on.reply(KEY, weights, BFLOAT16) == (weights, False)
    halves = weights.astype(np.float16)
    assert on.reply((4, 0), halves, BFLOAT16) == (halves, False)
    on.clear()
    assert len(on) == 0
