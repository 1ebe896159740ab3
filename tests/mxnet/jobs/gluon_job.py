"""A small Gluon job for the MXNet tests: train N steps, save every parameter per rank."""
import argparse
import os

import numpy as np

import dgt  # noqa: F401  (makes kvstore='dgt' available)
import mxnet as mx
from mxnet import autograd, gluon

parser = argparse.ArgumentParser()
parser.add_argument("--kvstore", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--devices", type=int, default=1)
parser.add_argument("--simulate-workers", type=int, default=0,
                    help="oracle: one process, a local kvstore, and each simulated worker's "
                         "batch on its own devices (the arithmetic of a synchronous N-worker job)")
parser.add_argument("--update-on-kvstore", choices=("auto", "0", "1"), default="auto")
parser.add_argument("--report-loss", action="store_true")
parser.add_argument("--first-step", type=int, default=0, help="resume: load --states first")
parser.add_argument("--states", default="", help="trainer states + parameters file prefix")
parser.add_argument("--read-weights", action="store_true",
                    help="read new weights after every step, before the next store call")
parser.add_argument("--freeze-head-after", type=int, default=0,
                    help="from this step on, the last layer is frozen (fewer keys per step)")
args = parser.parse_args()

mx.random.seed(7)
np.random.seed(7)
simulated_workers = args.simulate_workers or 1
contexts = [mx.cpu(i) for i in range(args.devices * simulated_workers)]
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(300, activation="relu"), gluon.nn.Dense(64, activation="relu"),
        gluon.nn.Dense(10))
net.initialize(mx.init.Xavier(), ctx=contexts)
net.hybridize()
uok = None if args.update_on_kvstore == "auto" else args.update_on_kvstore == "1"
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9},
                        kvstore=args.kvstore, update_on_kvstore=uok)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
rank = int(os.environ.get("DGT_RANK", "0"))
ranks = range(simulated_workers) if args.simulate_workers else [rank]
batch = 16
if args.first_step:
    net.load_parameters(args.states + ".params", ctx=contexts)
    trainer.load_states(args.states + ".states")
fused_keys = []
for step in range(args.first_step, args.steps):
    if args.freeze_head_after and step == args.freeze_head_after:
        for param in net[2].collect_params().values():
            param.grad_req = "null"
    xs_by_rank, ys_by_rank = [], []
    for data_rank in ranks:
        rng = np.random.RandomState(1000 * step + data_rank)  # every worker sees different data
        xs_by_rank.append(rng.randn(batch * args.devices, 200).astype(np.float32))
        ys_by_rank.append(rng.randint(0, 10, batch * args.devices))
    x, y = np.concatenate(xs_by_rank), np.concatenate(ys_by_rank)
    xs = gluon.utils.split_and_load(x, contexts)
    ys = gluon.utils.split_and_load(y, contexts)
    with autograd.record():
        losses = [loss_fn(net(a), b) for a, b in zip(xs, ys)]
    for loss in losses:
        loss.backward()
    trainer.step(batch * args.devices)
    if args.read_weights:
        # Read new weights before the store is called again (as an evaluation would): this
        # waits for the step's replies.
        net[0].weight.data(contexts[0]).asnumpy()
    fused_keys.append(getattr(trainer._kvstore, "fused_keys", 0))
    if args.report_loss:
        trainer._kvstore.report_loss(float(sum(l.mean().asscalar() for l in losses)))

kv = trainer._kvstore
if args.states and not args.first_step and kv.rank == 0:
    net.save_parameters(args.states + ".params")
    trainer.save_states(args.states + ".states")
assert kv is not None, "the kvstore was dropped: training ran without it"
params = net.collect_params()
weights = np.concatenate([params[name].data(contexts[-1]).asnumpy().ravel()
                          for name in sorted(params.keys())])
np.save(os.path.join(args.out, f"{args.kvstore}-{rank}.npy"), weights)
print(f"rank {kv.rank} type {kv.type} update_on_kvstore {trainer._update_on_kvstore} "
      f"workers {kv.num_workers} fused keys per step {fused_keys}", flush=True)
