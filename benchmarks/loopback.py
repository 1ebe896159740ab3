"""Transport efficiency on localhost: dgt with everything reliable vs MXNet ``dist_sync``.

    python benchmarks/loopback.py [--model alexnet] [--steps 12] [--rounds 2]

Runs AlexNet (3x64x64, batch 32, synthetic data) with 2 workers and 1 server under both
systems, alternating A/B/A/B so that machine noise hits both alike, and prints the median step
times and their ratio (dgt / dist_sync; below 1 is faster).  Nothing is network-bound on
loopback, so this measures the overhead of dgt's Python transport, not DGT's benefit (see the
testbed benchmark for that).  Each worker process is this same file with ``--worker``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run_worker(args) -> None:
    import numpy as np

    import dgt  # noqa: F401  (registers kvstore='dgt')
    import mxnet as mx
    from mxnet import autograd, gluon

    mx.random.seed(1)
    net = gluon.model_zoo.vision.get_model(args.model, classes=10)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9},
                            kvstore=args.kvstore)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    size = 64 if args.model == "alexnet" else 32
    rng = np.random.RandomState(0)
    x = mx.nd.array(rng.rand(args.batch, 3, size, size))
    y = mx.nd.array(rng.randint(0, 10, args.batch))
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(args.batch)
        mx.nd.waitall()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    kv = trainer._kvstore
    if kv.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"kvstore": args.kvstore, "times": times}, f)


def launch(system: str, args, out: str) -> list:
    worker = [sys.executable, os.path.abspath(__file__), "--worker", "--model", args.model,
              "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch",
              str(args.batch), "--out", out]
    env = dict(os.environ)
    if system == "dgt-reliable":
        cmd = ["dgt-launch", "-n", "2", *worker, "--kvstore", "dgt"]
        env["DGT_ENABLE"] = "0"
    elif system == "dgt":
        cmd = ["dgt-launch", "-n", "2", *worker, "--kvstore", "dgt"]
    else:
        cmd = ["dgt-launch", "--backend", "mxnet", "-n", "2", *worker, "--kvstore", system]
    cmd = [sys.executable, "-m", "dgt.launch", *cmd[1:]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:])
        raise SystemExit(f"{system} run failed with code {proc.returncode}")
    with open(out) as f:
        return json.load(f)["times"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kvstore", default="dgt", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="alexnet", choices=("alexnet", "vgg11"))
    parser.add_argument("--steps", type=int, default=12, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="A/B repetitions")
    parser.add_argument("--systems", default="dgt-reliable,dist_sync",
                        help="comma list of dgt, dgt-reliable, dist_sync")
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    systems = args.systems.split(",")
    samples = {s: [] for s in systems}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for system in systems:
                times = launch(system, args, os.path.join(tmp, f"{system}-{round_index}.json"))
                samples[system].extend(times)
                print(f"round {round_index + 1}: {system:13s} median step "
                      f"{statistics.median(times) * 1000:7.1f} ms", flush=True)
    medians = {s: statistics.median(v) for s, v in samples.items()}
    print(f"\n{args.model}, 2 workers, batch {args.batch}, {args.steps} steps x {args.rounds} rounds")
    print(f"{'system':14s} {'median ms':>10s} {'p90 ms':>8s}")
    for system in systems:
        values = sorted(samples[system])
        p90 = values[int(0.9 * (len(values) - 1))]
        print(f"{system:14s} {medians[system] * 1000:10.1f} {p90 * 1000:8.1f}")
    base = "dist_sync" if "dist_sync" in medians else systems[-1]
    for system in systems:
        if system != base:
            print(f"ratio {system} / {base}: {medians[system] / medians[base]:.3f}")


if __name__ == "__main__":
    main()
