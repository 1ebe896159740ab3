"""`benchmarks/overhead.py --server-optimizer` times the replies dgt really sends: after its
steps every simulated worker holds what the server's rule says it holds."""
import ml_dtypes
import numpy as np

from benchmarks.overhead import WeightsReplies, one_step
from dgt.config import Config
from dgt.memory import ResidualMemory
from dgt.merge import StepMerger
from dgt.scoring import ContributionState

SHAPES = [(3000,), (40, 50)]


def run(weights_reply: str, steps: int = 4):
    config = Config(weights_reply=weights_reply, wire_dtype="bfloat16")
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(int(np.prod(s))).astype(np.float32) for s in SHAPES]
    states = [(ResidualMemory(), ContributionState(config.score_alpha), {}) for _ in range(2)]
    merger = StepMerger(2, config.receive_mode, grace_s=0.0)
    replies = WeightsReplies(config, 2)
    history = {}
    for step in range(steps):
        worker_s, server_s = one_step(config, SHAPES, grads, states, merger, step, 2,
                                      replies=replies)
        assert worker_s > 0 and server_s > 0
        for ident, weights in replies.weights.items():
            history.setdefault(ident, []).append(weights.copy())
    return replies, history


def test_full_replies_leave_every_worker_with_the_servers_weights():
    replies, _ = run("full")
    assert replies.weights
    for ident, weights in replies.weights.items():
        for held in replies.workers[ident]:
            np.testing.assert_array_equal(held, weights)


def test_delta_replies_leave_every_worker_one_bfloat16_rounding_behind():
    replies, history = run("delta")
    for ident, steps in history.items():
        held = steps[0].copy()  # the first reply is whole
        for weights in steps[1:]:
            held += (weights - held).astype(ml_dtypes.bfloat16).astype(np.float32)
        for worker in replies.workers[ident]:
            np.testing.assert_array_equal(worker, held)
        assert np.abs(held - steps[-1]).max() > 0  # the replies were deltas, not whole weights
        assert np.abs(held - steps[-1]).max() < 2e-5
