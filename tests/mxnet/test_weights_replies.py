"""A server-side optimizer's replies over real sockets: float32 weights, or bfloat16 steps from
what the workers hold (``DGT_WEIGHTS_REPLY``), checked against a numpy replay of the rule."""
import pickle

import ml_dtypes
import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

from ..conftest import run_workers  # noqa: E402

N_ELEMS, STEPS, KEY = 5000, 12, 3


def gradients(rank: int) -> list:
    rng = np.random.default_rng(100 + rank)
    # Small steps next to weights of about 1: a bfloat16 copy of the weights could not
    # follow them (its spacing near 1 is 2**-7, the steps are about 2**-10).
    return [rng.standard_normal(N_ELEMS).astype(np.float32) * 0.01 for _ in range(STEPS)]


def train(make_job, weights_reply: str):
    """Every worker's result after each step, and the servers' reply bytes."""
    config, servers = make_job(2, num_servers=2, enable=False, wire_dtype="bfloat16",
                               weights_reply=weights_reply, bigarray_elems=1024)
    initial = np.random.default_rng(7).uniform(0.5, 1.5, N_ELEMS).astype(np.float32)
    blob = pickle.dumps(mx.optimizer.SGD(learning_rate=0.1, rescale_grad=1.0), 0)

    def body(worker):
        worker.init(KEY, initial).wait()
        worker.set_optimizer(blob)
        return [worker.pushpull(KEY, grad).wait().copy() for grad in gradients(worker.rank)]

    results = run_workers(config, body, 2)
    reply_bytes = sum(s.server.counters["reply_bytes"] for s in servers)
    return results, reply_bytes


def test_delta_replies_keep_workers_one_rounding_from_the_servers_weights(make_job):
    full, full_bytes = train(make_job, "full")
    delta, delta_bytes = train(make_job, "delta")
    # The gradients do not depend on the weights here, so the servers' weights (what the
    # full replies carry, to the bit) are the same in both runs.
    servers_weights = full[0]
    np.testing.assert_array_equal(np.array(full[0]), np.array(full[1]))
    np.testing.assert_array_equal(np.array(delta[0]), np.array(delta[1]))
    held = servers_weights[0].copy()  # the first reply is whole
    np.testing.assert_array_equal(delta[0][0], held)
    for step in range(1, STEPS):
        change = servers_weights[step] - held
        held = held + change.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(delta[0][step], held)
        # One rounding of this step's change (half a bfloat16 spacing of it, 2**-8 relative)
        # and one float32 rounding of the sum: the remainder of earlier steps is in `change`.
        error = np.abs(servers_weights[step] - held)
        assert (error <= 2.0 ** -8 * np.abs(change) + np.spacing(np.abs(held))).all()
        assert error.max() < 2e-5  # never accumulates: a step moves a weight ~1e-3
    # The first reply carries float32, every later one bfloat16.
    assert delta_bytes == pytest.approx(full_bytes * (1 + (STEPS - 1) / 2) / STEPS, rel=1e-6)


def test_float32_gradients_get_float32_weights_whatever_the_setting(make_job):
    config, _ = make_job(1, enable=False, wire_dtype="native", weights_reply="delta")
    initial = np.linspace(0.5, 1.5, N_ELEMS, dtype=np.float32)
    blob = pickle.dumps(mx.optimizer.SGD(learning_rate=0.1, rescale_grad=1.0), 0)

    def body(worker):
        worker.init(KEY, initial).wait()
        worker.set_optimizer(blob)
        grads = gradients(0)[:3]
        got = [worker.pushpull(KEY, grad).wait().copy() for grad in grads]
        return got, worker.pull(KEY, initial).wait().copy()

    (got, pulled), = run_workers(config, body, 1).values()
    np.testing.assert_array_equal(got[-1], pulled)  # exactly the server's weights
