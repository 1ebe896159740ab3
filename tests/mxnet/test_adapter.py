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


def _owed_per_key(kv, sizes):
    """Everything the store's worker owes, laid out as the concatenation of the keys 0, 1, ...
    of ``sizes`` (a fused bucket's residual covers its members, in order)."""
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    owed = np.zeros(offsets[-1])
    buckets = {b.key: b for b in kv._planner.buckets}  # kept when fusion stops
    for ident in list(kv._worker._memory._owed):
        key, residual = ident[0], kv._worker._memory.owed(ident)
        if key in buckets:
            first = buckets[key].members[0].key
            owed[offsets[first]:offsets[first] + residual.size] += residual
        else:
            owed[offsets[key]:offsets[key + 1]] += residual
    return owed


def _lossy_store_with_error_feedback(make_job, grace_ms, fusion_elems):
    """A one-worker store with error feedback under 30 % seeded UDP loss."""
    settings = dict(threshold=0.3, threshold_min=0.1, adaptive=False, grace_ms=grace_ms,
                    udp_drop=0.3, seed=5, error_feedback=True, receive_mode="drop",
                    block_elems=256)
    config, _ = make_job(1, **settings)
    dgt.configure(**settings, server_addrs=config.server_addrs, num_workers=1,
                  job_id=config.job_id, timeout_s=config.timeout_s, wire_dtype="native",
                  fusion_elems=fusion_elems, rank=0)
    return mx.kv.create("dgt")


@pytest.mark.parametrize("break_by", ["reorder", "partial_round"])
def test_error_feedback_hands_the_buckets_residual_back_when_fusion_stops(make_job, break_by):
    """Fused steps under seeded loss leave the bucket owing; when fusion stops (the keys come
    in another order, or a round is sealed with one member) the members, pushed on their own
    again, take back their slices of it: nothing stays owed under a key no longer pushed, and
    what came back plus what is owed is exactly what was pushed."""
    kv = _lossy_store_with_error_feedback(make_job, grace_ms=300, fusion_elems=1 << 16)
    try:
        sizes, rng = (20_000, 3_000), np.random.default_rng(4)
        pushed, merged = np.zeros(sum(sizes)), np.zeros(sum(sizes))

        def step(keys):
            grads = {k: rng.integers(-20, 21, sizes[k]).astype(np.float32) for k in keys}
            outs = [mx.nd.array(grads[k]) for k in keys]
            kv.pushpull(list(keys), outs)
            return grads, outs

        def account(grads, outs):
            for (k, g), out in zip(grads.items(), outs):
                first = sum(sizes[:k])
                pushed[first:first + sizes[k]] += g
                merged[first:first + sizes[k]] += out.asnumpy()

        for _ in range(3):
            account(*step((0, 1)))
        bucket_keys = {bucket.key for bucket in kv._planner.buckets}
        assert kv.fused_keys == 2
        assert {ident[0] for ident in kv._worker._memory._owed} == bucket_keys
        if break_by == "reorder":
            account(*step((1, 0)))
        else:  # key 0 alone opens a round; the next step's key 0 seals it with one member
            alone = step((0,))
            account(*step((0, 1)))
            account(*alone)
        assert kv.fused_keys == 0
        for _ in range(2):
            account(*step((0, 1)))
        owing = {ident[0] for ident in kv._worker._memory._owed}
        assert owing and not owing & bucket_keys, owing
        np.testing.assert_array_equal(merged + _owed_per_key(kv, sizes), pushed)
    finally:
        kv.close()
        dgt._overrides.clear()


@pytest.mark.parametrize("fusion_elems", [0, 1 << 16])
def test_error_feedback_through_the_store_loses_nothing_and_adds_in_its_send_buffer(
        make_job, fusion_elems):
    """Under seeded loss with error feedback, what the store's pushpulls returned plus what the
    worker still owes is exactly what was pushed, with and without fusion (where the bucket
    takes over what its members owed from the first step, pushed on their own); the owed
    values are added in the store's own send buffer (no copy of the gradient), which ends as
    the compensated gradient."""
    kv = _lossy_store_with_error_feedback(make_job, grace_ms=2000, fusion_elems=fusion_elems)
    try:
        sizes, rng = (20_000, 3_000), np.random.default_rng(3)
        pushed, merged = np.zeros(sum(sizes)), np.zeros(sum(sizes))
        for step in range(5):
            grads = [rng.integers(-20, 21, n).astype(np.float32) for n in sizes]
            owed = _owed_per_key(kv, sizes)
            outs = [mx.nd.array(g) for g in grads]
            kv.pushpull([0, 1], outs)
            merged += np.concatenate([o.asnumpy() for o in outs])
            pushed += np.concatenate(grads)
            if not fusion_elems and step:
                sent = np.concatenate([kv._buffers[k].send_host for k in (0, 1)])
                np.testing.assert_array_equal(sent, np.concatenate(grads) + owed)
        residual = _owed_per_key(kv, sizes)
        assert np.abs(residual).sum() > 0, "the seeded loss should leave something owed"
        np.testing.assert_array_equal(merged + residual, pushed)
        assert kv.fused_keys == (2 if fusion_elems else 0)
        if fusion_elems:  # the members' losses of the first (learning) step went out in the bucket
            owing = {ident[0] for ident in kv._worker._memory._owed}
            assert owing == {bucket.key for bucket in kv._planner.buckets}, owing
    finally:
        kv.close()
        dgt._overrides.clear()
