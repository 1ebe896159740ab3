"""What the three training scripts share: flags, data, the BSP and FedAvg loops, logging.

Run a script under a launcher, e.g. ``python examples/launch.py -n 2 -- python
examples/train_alexnet.py --kvstore dgt`` (``examples/launch.py`` picks dgt's servers or
MXNet's own for ``dist_sync*``).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Optional

import numpy as np

import dgt  # noqa: F401  (registers kvstore='dgt')
import mxnet as mx
from mxnet import autograd, gluon

from data import DatasetMissing, load, partition
from models import INIT, INPUT_SIZE, get_model

KVSTORES = ("dgt", "dist_sync", "dist_sync_2bit", "dist_sync_p3", "horovod", "horovod_fp16",
            "local")


def int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``, refused with a message that says so."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}: allowed {minimum}..")
        return value
    return parse


def positive_float(text: str) -> float:
    """An argparse type: a float > 0, refused with a message that says so."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value:g} is out of range: allowed > 0")
    return value


def build_parser(model: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=f"Train {model} with data-parallel workers; compare kvstores.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--dataset", default="fashion-mnist",
                        choices=("fashion-mnist", "cifar10", "synthetic"),
                        help="fashion-mnist: Debian package dataset-fashion-mnist (or "
                             "--data-dir); cifar10: python batches in --data-dir; synthetic: "
                             "random images of the right shape, for timing")
    parser.add_argument("--data-dir", default="", help="where the dataset files are")
    parser.add_argument("--partition", default="iid", choices=("iid", "noniid"),
                        help="how the training set is split among workers; noniid is "
                             "label-skewed with Dirichlet(--noniid-alpha) class shares")
    parser.add_argument("--noniid-alpha", type=float, default=0.5,
                        help="Dirichlet concentration for --partition noniid (smaller = more "
                             "skewed)")
    parser.add_argument("--algo", default="bsp", choices=("bsp", "fedavg"),
                        help="bsp: synchronise gradients every step; fedavg: train "
                             "--local-steps locally, then average model deltas")
    parser.add_argument("--local-steps", type=int_at_least(1), default=5,
                        help="local steps between two FedAvg averaging rounds")
    parser.add_argument("--kvstore", default="dgt", choices=KVSTORES,
                        help="gradient transport: dgt, MXNet dist_sync (plain, 2-bit "
                             "compressed, or with the P3 van), Horovod's allreduce (when "
                             "installed), or local (single process)")
    parser.add_argument("--two-bit-threshold", type=positive_float, default=0.5,
                        help="dist_sync_2bit: MXNet's 2-bit threshold (gradient values at or "
                             "beyond +-T travel as +-T, the rest as 0 until their residual "
                             "gets there); 0.5 is MXNet's documented default")
    parser.add_argument("--update-on-kvstore", default="auto", choices=("auto", "1", "0"),
                        help="where the optimizer runs (gluon.Trainer's update_on_kvstore): "
                             "auto lets MXNet choose (the servers, for dgt and dist_sync); 0 "
                             "runs it on every worker, and dgt's servers then answer with the "
                             "blocks that some worker's gradient reached only")
    parser.add_argument("--epochs", type=int_at_least(1), default=1,
                        help="passes over each worker's shard")
    parser.add_argument("--max-steps", type=int_at_least(0), default=0,
                        help="stop after this many steps in all (0: no limit)")
    parser.add_argument("--batch-size", type=int_at_least(1), default=32,
                        help="per-worker batch size")
    parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--seed", type=int, default=0, help="seed of data, partition and init")
    parser.add_argument("--eval-samples", type=int_at_least(0), default=0,
                        help="test samples used for accuracy (0: the whole test set)")
    parser.add_argument("--log", default="",
                        help="JSON-lines curve file ('{model}', '{kvstore}' are filled in); "
                             "`python -m dgt.plot` draws it")
    parser.add_argument("--log-every", type=int_at_least(1), default=10,
                        help="steps between curve points")
    parser.add_argument("--eval-every", type=int_at_least(0), default=0,
                        help="also measure test accuracy every this many steps (0: per epoch)")
    parser.add_argument("--save-params", default="",
                        help="write the final parameters of this worker to this .npy path "
                             "('{rank}' is filled in)")
    return parser


class Curve:
    """The JSON-lines log (rank 0 only)."""

    def __init__(self, path: str, meta: dict):
        self._file = open(path, "w", encoding="utf-8") if path else None
        self.write({"event": "start", **meta})

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()


class HorovodJob:
    """What the training loop needs of a kvstore, for Horovod (which has none in MXNet 1.9)."""

    def __init__(self, fp16: bool = False):
        self.fp16 = fp16  # Horovod's Compression.fp16: gradients travel as float16
        try:
            import horovod.mxnet as hvd
        except ImportError as exc:
            raise SystemExit(f"error: --kvstore horovod needs Horovod built with MXNet "
                             f"(see the README, 'Peers'): {exc}")
        hvd.init()
        self.hvd, self.rank, self.num_workers = hvd, hvd.rank(), hvd.size()

    def trainer(self, params, optimizer_params: dict):
        # Horovod averages gradients where dist_sync sums them: scaling the learning rate by
        # the number of workers gives both the same update.
        scaled = dict(optimizer_params,
                      learning_rate=optimizer_params["learning_rate"] * self.num_workers)
        self.hvd.broadcast_parameters(params, root_rank=0)
        compression = self.hvd.Compression.fp16 if self.fp16 else self.hvd.Compression.none
        return self.hvd.DistributedTrainer(params, "sgd", scaled, compression=compression)


def create_kvstore(name: str, two_bit_threshold: float = 0.5):
    """(kvstore or None, Trainer compression params)."""
    if name == "local":
        return None, None
    if name.startswith("horovod"):
        return HorovodJob(fp16=name == "horovod_fp16"), None
    if name == "dgt":
        return mx.kv.create("dgt"), None
    compression = ({"type": "2bit", "threshold": two_bit_threshold}
                   if name == "dist_sync_2bit" else None)
    return mx.kv.create("dist_sync"), compression


def prepare(images: np.ndarray, size: int, ctx) -> mx.nd.NDArray:
    """uint8 NCHW -> normalised float32 at the model's input size."""
    x = mx.nd.array(images, ctx=ctx, dtype="float32") / 255.0
    x = (x - 0.5) / 0.25
    if x.shape[2] != size:
        x = mx.nd.contrib.BilinearResize2D(x, height=size, width=size)
    return x


def evaluate(net, dataset, size: int, ctx, samples: int, batch: int = 200) -> float:
    count = len(dataset.test_y) if samples <= 0 else min(samples, len(dataset.test_y))
    correct = 0
    for start in range(0, count, batch):
        stop = min(count, start + batch)
        out = net(prepare(dataset.test_x[start:stop], size, ctx))
        correct += int((out.argmax(axis=1).asnumpy().astype(np.int64)
                        == dataset.test_y[start:stop]).sum())
    return correct / count


def machine_cpu_ticks() -> Optional[dict]:
    """The whole machine's CPU time so far, in clock ticks, from the first line of
    ``/proc/stat`` (None where there is none): ``busy`` (user and kernel code, interrupts
    included), ``idle`` (waiting for I/O included) and ``steal`` (time a hypervisor gave the
    virtual CPUs to someone else).  A benchmark reads from it whether a run was CPU-bound."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is already in user)
    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return {"busy": user + nice + system + irq + softirq, "idle": idle + iowait,
            "steal": steal}


def dgt_counters(kv) -> Optional[dict]:
    worker = getattr(kv, "worker", None)
    if worker is None:
        return None
    return {"k": worker.threshold, **worker.totals}


def train(model: str, argv=None) -> dict:
    args = build_parser(model).parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    mx.random.seed(args.seed)
    np.random.seed(args.seed)
    kv, compression = create_kvstore(args.kvstore, args.two_bit_threshold)
    rank = kv.rank if kv is not None else 0
    workers = kv.num_workers if kv is not None else 1
    try:
        dataset = load(args.dataset, args.data_dir, seed=args.seed)
    except DatasetMissing as exc:
        sys.stderr.write(f"error: {exc}\n")
        raise SystemExit(2)
    shards = partition(dataset.train_y, workers, args.partition, args.seed, args.noniid_alpha)
    shard = shards[rank]
    # BSP needs the same number of steps on every worker (uneven shards would hang the last
    # step); every worker computes every shard's size from the same seed, no message needed.
    steps_per_epoch = min(len(s) for s in shards) // args.batch_size
    if steps_per_epoch == 0:
        raise SystemExit(f"error: a shard holds fewer than --batch-size={args.batch_size} samples")
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    ctx = mx.cpu()
    size = INPUT_SIZE[model]
    net = get_model(model, dataset.classes)
    net.initialize(INIT.get(model, mx.init.Xavier()), ctx=ctx)
    net.hybridize()
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    optimizer_params = {"learning_rate": args.lr, "momentum": 0.9}
    # Shapes are inferred at the first forward; run it inside record() (an inference-mode
    # forward before the first step trips MXNet's MKLDNN layout in dist_sync).
    with autograd.record():
        net(prepare(dataset.train_x[shard[:2]], size, ctx))
    manual_push_pull = compression is not None
    if isinstance(kv, HorovodJob):
        if args.algo != "bsp":
            raise SystemExit("error: --kvstore horovod supports --algo bsp only")
        trainer = kv.trainer(net.collect_params(), optimizer_params)
    elif args.algo == "bsp" and not manual_push_pull:
        update_on_kvstore = {"auto": None, "1": True, "0": False}[args.update_on_kvstore]
        trainer = gluon.Trainer(net.collect_params(), "sgd", optimizer_params, kvstore=kv,
                                update_on_kvstore=update_on_kvstore)
    elif args.algo == "bsp":
        # MXNet 1.9.1 refuses compression with pushpull ("Compression not supported with
        # PushPull"), which Trainer uses; push + pull per key work, so sum the gradients that
        # way and update locally (the same arithmetic as dist_sync with update_on_kvstore=0).
        kv.set_gradient_compression(compression)
        trainer = gluon.Trainer(net.collect_params(), "sgd", optimizer_params, kvstore=None)
        grad_params = [p for _, p in sorted(net.collect_params().items())
                       if p.grad_req != "null"]
        for index, param in enumerate(grad_params):
            kv.init(index, mx.nd.zeros(param.shape, ctx=ctx))
    else:
        trainer = gluon.Trainer(net.collect_params(), "sgd", optimizer_params, kvstore=None)
        params = [p for _, p in sorted(net.collect_params().items())]
        if kv is not None:
            for index, param in enumerate(params):  # everyone starts from rank 0's weights
                kv.broadcast(index, param.data(), out=param.data())
        anchors = [p.data().copy() for p in params]

    curve = Curve(args.log.format(model=model, kvstore=args.kvstore) if rank == 0 else "",
                  {"model": model, "kvstore": args.kvstore, "dataset": args.dataset,
                   "workers": workers, "algo": args.algo, "partition": args.partition,
                   "batch_size": args.batch_size, "steps": total_steps,
                   **({"two_bit_threshold": args.two_bit_threshold}
                      if args.kvstore == "dist_sync_2bit" else {})})
    progress = None
    if rank == 0:
        from tqdm import tqdm

        progress = tqdm(total=total_steps, unit="step", dynamic_ncols=True, file=sys.stdout)
    start = time.perf_counter()
    eval_s = 0.0  # time spent evaluating, left out of train_time_s
    step, losses, accuracy = 0, [], None

    def record_eval(epoch):
        nonlocal accuracy, eval_s
        began = time.perf_counter()
        accuracy = evaluate(net, dataset, size, ctx, args.eval_samples)
        eval_s += time.perf_counter() - began
        now = time.perf_counter() - start
        curve.write({"event": "eval", "step": step, "epoch": epoch, "time_s": now,
                     "train_time_s": now - eval_s, "accuracy": accuracy})
        if progress is not None:
            progress.write(f"step {step}: test accuracy {accuracy:.4f}")

    rng = np.random.default_rng(args.seed + 1000 * rank)
    for epoch in range(args.epochs):
        order = rng.permutation(shard)
        for batch_index in range(steps_per_epoch):
            if step >= total_steps:
                break
            picks = np.sort(order[batch_index * args.batch_size:(batch_index + 1) * args.batch_size])
            x = prepare(dataset.train_x[picks], size, ctx)
            y = mx.nd.array(dataset.train_y[picks], ctx=ctx)
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            if args.algo == "bsp" and manual_push_pull:
                for index, param in enumerate(grad_params):
                    kv.push(index, param.grad(), priority=-index)
                    kv.pull(index, out=param.grad(), priority=-index)
            trainer.step(args.batch_size)
            step += 1
            if args.algo == "fedavg" and kv is not None and step % args.local_steps == 0:
                average_models(kv, params, anchors, workers)
            loss_value = float(loss.mean().asscalar())
            losses.append(loss_value)
            if args.kvstore == "dgt":
                kv.report_loss(loss_value)
            if progress is not None:
                counters = dgt_counters(kv)
                postfix = {"loss": f"{np.mean(losses[-20:]):.3f}"}
                if counters:
                    mb = [b / 1e6 for b in counters["bytes_per_channel"]]
                    postfix["MB tcp/udp"] = f"{mb[0]:.0f}/{sum(mb[1:]):.0f}"
                    postfix["k"] = f"{counters['k']:.2f}"
                progress.set_postfix(postfix, refresh=False)
                progress.update(1)
            if rank == 0 and (step % args.log_every == 0 or step == total_steps):
                now = time.perf_counter() - start
                record = {"event": "step", "step": step, "epoch": epoch, "time_s": now,
                          "train_time_s": now - eval_s,
                          "loss": float(np.mean(losses[-args.log_every:]))}
                ticks = machine_cpu_ticks()
                if ticks is not None:
                    record["machine_cpu_ticks"] = ticks
                counters = dgt_counters(kv)
                if counters:
                    # Running totals: a reader takes per-step differences (dgt_cpu_ms: the
                    # median of them leaves out one-time costs such as compiling the kernels).
                    record.update(k=counters["k"], bytes_per_channel=counters["bytes_per_channel"],
                                  udp_expected=counters["udp_expected"],
                                  udp_lost=counters["udp_lost"], dgt_cpu_ms=counters["cpu_ms"],
                                  dgt_steps=counters["steps"])
                curve.write(record)
            if rank == 0 and args.eval_every and step % args.eval_every == 0 \
                    and step < total_steps:
                record_eval(epoch)
        if rank == 0:
            record_eval(epoch)
        if step >= total_steps:
            break
    mx.nd.waitall()
    elapsed = time.perf_counter() - start
    if progress is not None:
        progress.close()
    summary = {"event": "summary", "model": model, "kvstore": args.kvstore, "steps": step,
               "time_s": elapsed, "train_time_s": elapsed - eval_s, "accuracy": accuracy,
               "final_loss": float(np.mean(losses[-20:])) if losses else None}
    counters = dgt_counters(kv)
    if counters:
        expected = counters["udp_expected"]
        # The counters cover the steps dgt has recorded (the last one is recorded at close).
        summary.update(bytes_per_channel=counters["bytes_per_channel"],
                       dgt_steps=counters["steps"],
                       udp_loss_rate=(counters["udp_lost"] / expected) if expected else 0.0,
                       # Part of the loss: datagrams that did arrive, after their step closed.
                       udp_late_rate=(counters["udp_late"] / expected) if expected else 0.0,
                       dgt_cpu_ms_per_step=counters["cpu_ms"] / max(counters["steps"], 1))
    if args.save_params:
        weights = np.concatenate([p.data().asnumpy().ravel()
                                  for _, p in sorted(net.collect_params().items())])
        np.save(args.save_params.format(rank=rank), weights)
    if rank == 0:
        curve.write(summary)
        print_summary(summary, workers)
    return summary


def average_models(kv, params, anchors, workers: int) -> None:
    """FedAvg round: w = anchor + mean over workers of (w_local - anchor), through the kvstore
    (so dgt's differential transmission carries FedAvg traffic too)."""
    for index, (param, anchor) in enumerate(zip(params, anchors)):
        delta = param.data() - anchor
        kv.pushpull(index, delta, out=delta)
        anchor += delta / workers
        param.set_data(anchor)


def print_summary(summary: dict, workers: int) -> None:
    lines = [f"model {summary['model']}, kvstore {summary['kvstore']}, {workers} workers",
             f"steps {summary['steps']} in {summary['time_s']:.1f} s "
             f"({summary['steps'] / max(summary['time_s'], 1e-9):.2f} steps/s)"]
    if summary["accuracy"] is not None:
        lines.append(f"test accuracy {summary['accuracy']:.4f}, final loss {summary['final_loss']:.4f}")
    if "bytes_per_channel" in summary:
        mb = ", ".join(f"ch{i} {b / 1e6:.1f} MB" for i, b in enumerate(summary["bytes_per_channel"]))
        lines.append(f"bytes sent by rank 0: {mb} (ch0 = TCP)")
        lines.append(f"UDP datagrams lost: {summary['udp_loss_rate'] * 100:.2f} % "
                     f"(arrived too late: {summary['udp_late_rate'] * 100:.2f} %)")
    sys.stdout.write("\n".join(["== summary =="] + lines) + "\n")
    sys.stdout.flush()
