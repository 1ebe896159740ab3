"""The DGT kvstore in-process: registration, capabilities, clear errors, fp16."""
import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

import dgt  # noqa: E402
from dgt.errors import LocalProtocolError  # noqa: E402


@pytest.fixture
def store(make_job):
    config, _ = make_job(1, threshold=0.3, adaptive=False, grace_ms=2000)
    dgt.configure(**{k: getattr(config, k) for k in
                     ("server_addrs", "num_workers", "job_id", "threshold", "adaptive", "grace_ms",
                      "timeout_s")}, rank=0)
    kv = mx.kv.create("dgt")
    yield kv
    kv.close()
    dgt._overrides.clear()


def test_registry_name_is_dgt_and_type_is_distributed(store):
    from dgt.mxnet import DGT

    assert isinstance(store, DGT) and "dgt" in mx.kv.KVStoreBase.kv_registry
    assert store.type == "dist_sync_dgt" and store.rank == 0 and store.num_workers == 1
    assert store.is_capable("optimizer") is True
    with pytest.raises(ValueError, match="unknown capability"):
        store.is_capable("teleport")


def test_pushpull_broadcast_and_lists(store):
    a = mx.nd.ones((3, 4)) * 2
    store.pushpull(0, a)
    np.testing.assert_array_equal(a.asnumpy(), 2)
    out = [mx.nd.zeros((5,)), mx.nd.zeros((5,))]
    store.broadcast(1, mx.nd.arange(5), out)
    for o in out:
        np.testing.assert_array_equal(o.asnumpy(), np.arange(5))
    vals = [mx.nd.ones(2000) * 3, mx.nd.ones(7)]
    store.pushpull([2, 3], vals)
    np.testing.assert_array_equal(vals[0].asnumpy(), 3)


def test_float16_and_other_dtypes_travel(store):
    h = mx.nd.ones(5000, dtype="float16") * 1.5
    store.pushpull(4, h)
    assert h.dtype == np.float16 and (h.asnumpy() == 1.5).all()
    i = mx.nd.array([1, 2, 3], dtype="int32")
    store.pushpull(5, i)
    np.testing.assert_array_equal(i.asnumpy(), [1, 2, 3])


def test_string_keys_push_pull_init(store):
    w = mx.nd.ones(10) * 4
    store.init("fc1_weight", w)
    out = mx.nd.zeros(10)
    store.pull("fc1_weight", out=out)
    np.testing.assert_array_equal(out.asnumpy(), 4)
    store.push("fc1_weight", mx.nd.ones(10))
    store.pull("fc1_weight", out=out)
    np.testing.assert_array_equal(out.asnumpy(), 1)


def test_unsupported_features_fail_clearly(store):
    with pytest.raises(LocalProtocolError, match="gradient compression"):
        store.set_gradient_compression({"type": "2bit"})
    with pytest.raises(dgt.RemoteProtocolError, match="no optimizer runs on this server"):
        store.save_optimizer_states("x")


def test_string_kvstore_survives_mxnets_single_device_check():
    from mxnet.gluon import trainer

    kv, _ = trainer._create_kvstore("local", 1, {})
    assert kv is None  # other strings keep MXNet's behaviour
    assert getattr(trainer._create_kvstore, "_dgt_wrapped", False)


def test_server_side_update_survives_mkldnn_weights(store):
    """After an inference forward, MKLDNN keeps conv weights in its own layout, which a custom
    operator cannot write: the weights must still receive the server's update (found by
    `make demo`, which evaluates between steps)."""
    from mxnet import autograd, gluon

    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(8, 3, in_channels=3), gluon.nn.Conv2D(8, 3, in_channels=8),
            gluon.nn.Dense(4))
    net.initialize()
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=store)
    x = mx.nd.random.uniform(shape=(2, 3, 12, 12))
    for _ in range(3):
        with autograd.record():
            loss = net(x).sum()
        loss.backward()
        trainer.step(2)
        before = {n: p.data().asnumpy().copy() for n, p in net.collect_params().items()}
        net(x).wait_to_read()  # inference forward: MKLDNN layouts
    assert trainer._update_on_kvstore
    with autograd.record():
        loss = net(x).sum()
    loss.backward()
    trainer.step(2)
    after = {n: p.data().asnumpy() for n, p in net.collect_params().items()}
    assert all(np.isfinite(a).all() for a in after.values())
    assert any(not np.array_equal(before[n], after[n]) for n in after)
