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


def test_a_summing_servers_reply_lands_in_the_workers_result_dense_and_sparse():
    """Without --server-optimizer the worker's timed part ends with the sum in its float32
    result: twice the bfloat16 gradient (both workers push the same one), and where every
    datagram was lost (a sparse reply) zero in the blocks that travelled over UDP only."""
    from dgt.policy import assign_channels
    from dgt.partition import BlockLayout
    from dgt.scoring import score_blocks

    config = Config(wire_dtype="bfloat16")
    shapes = [(40_000,)]
    grad = np.random.default_rng(3).standard_normal(40_000).astype(np.float32)
    expected = 2 * grad.astype(ml_dtypes.bfloat16).astype(np.float32)
    for udp_loss in (0.0, 1.0):
        states = [(ResidualMemory(), ContributionState(config.score_alpha), {})
                  for _ in range(2)]
        merger = StepMerger(2, config.receive_mode, grace_s=0.0)
        one_step(config, shapes, [grad], states, merger, 0, 2, udp_loss,
                 np.random.default_rng(1))
        result = states[0][2][("reply", 0, 0)]
        if udp_loss:
            blocks = BlockLayout(grad.size, config.block_elems)
            scores = score_blocks(ContributionState(config.score_alpha), (0, 0), blocks, grad)
            channels = assign_channels(scores, config.threshold, config.udp_channels)
            assert 0 < np.count_nonzero(channels) < blocks.n_blocks
            lost = np.repeat(channels > 0, config.block_elems)[:grad.size]
            expected = np.where(lost, 0, expected)
        np.testing.assert_array_equal(result, expected)
