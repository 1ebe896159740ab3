"""A small Module.fit job for the MXNet tests: fit, then save every parameter per rank."""
import argparse
import logging
import os

import numpy as np

import dgt  # noqa: F401
import mxnet as mx

parser = argparse.ArgumentParser()
parser.add_argument("--kvstore", required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()
logging.basicConfig(level=logging.WARNING)

mx.random.seed(3)
np.random.seed(3)
rank = int(os.environ.get("DGT_RANK", "0"))
rng = np.random.RandomState(50 + rank)
x = rng.randn(160, 30).astype(np.float32)
y = rng.randint(0, 4, 160).astype(np.float32)
train = mx.io.NDArrayIter(x, y, batch_size=16, shuffle=False)

data = mx.sym.Variable("data")
fc1 = mx.sym.FullyConnected(data, num_hidden=64, name="fc1")
act = mx.sym.Activation(fc1, act_type="relu")
fc2 = mx.sym.FullyConnected(act, num_hidden=4, name="fc2")
net = mx.sym.SoftmaxOutput(fc2, name="softmax")
mod = mx.mod.Module(net, context=mx.cpu())
mod.fit(train, num_epoch=2, kvstore=args.kvstore, optimizer="sgd",
        optimizer_params={"learning_rate": 0.1, "momentum": 0.9},
        initializer=mx.init.Xavier(rnd_type="gaussian", magnitude=2))
assert mod._kvstore is not None, "the kvstore was dropped: training ran locally"
arg_params, _ = mod.get_params()
weights = np.concatenate([arg_params[k].asnumpy().ravel() for k in sorted(arg_params)])
np.save(os.path.join(args.out, f"{args.kvstore}-{rank}.npy"), weights)
print(f"rank {mod._kvstore.rank} type {mod._kvstore.type} update_on_kvstore "
      f"{mod._update_on_kvstore}", flush=True)
