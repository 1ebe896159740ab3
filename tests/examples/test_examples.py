"""The bundled examples: data, partitions, and short real runs under dgt and dist_sync."""
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

import data  # noqa: E402


def run_example(model, kvstore, *extra, workers=2, timeout=400):
    cmd = [sys.executable, str(EXAMPLES / "launch.py"), "-n", str(workers), "--timeout", "360",
           "--", sys.executable, str(EXAMPLES / f"train_{model}.py"), "--kvstore", kvstore, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.parametrize("kvstore", ["dgt", "dist_sync"])
@pytest.mark.parametrize("model", ["googlenet", "alexnet", "vgg11"])
def test_each_model_trains_a_few_steps(model, kvstore, tmp_path):
    pytest.importorskip("mxnet")
    log = tmp_path / "curve.jsonl"
    out = run_example(model, kvstore, "--dataset", "synthetic", "--max-steps", "3",
                      "--batch-size", "8", "--eval-samples", "64", "--log", str(log))
    assert f"model {model}, kvstore {kvstore}, 2 workers" in out and "steps 3" in out
    records = [line for line in log.read_text().splitlines() if '"summary"' in line]
    assert records, "rank 0 wrote no summary"
    steps = [line for line in log.read_text().splitlines() if '"event": "step"' in line]
    if os.path.exists("/proc/stat"):  # what benchmarks.compare reads a run's CPU from
        assert steps and all('"machine_cpu_ticks"' in line for line in steps)


def test_machine_cpu_ticks_count_every_core_s_time():
    """Over a wall-clock interval the busy, idle and stolen ticks of all cores add up to the
    interval times the cores (at the kernel's clock-tick rate)."""
    pytest.importorskip("mxnet")
    if not os.path.exists("/proc/stat"):
        pytest.skip("needs Linux's /proc/stat")
    import time

    import common
    before, began = common.machine_cpu_ticks(), time.monotonic()
    deadline = began + 1.0
    while time.monotonic() < deadline:  # keep one core busy
        pass
    after, elapsed = common.machine_cpu_ticks(), time.monotonic() - began
    grown = {name: after[name] - before[name] for name in before}
    assert all(value >= 0 for value in grown.values()) and grown["busy"] > 0
    expected = elapsed * os.cpu_count() * os.sysconf("SC_CLK_TCK")
    assert sum(grown.values()) == pytest.approx(expected, rel=0.25)


@pytest.mark.parametrize("kvstore", ["horovod", "horovod_fp16"])
def test_horovod_baseline_trains_identical_replicas(tmp_path, kvstore):
    pytest.importorskip("mxnet")
    pytest.importorskip("horovod.mxnet", reason="needs Horovod built with MXNet (make horovod)")
    params = tmp_path / "params-{rank}.npy"
    out = run_example("alexnet", kvstore, "--dataset", "synthetic", "--max-steps", "3",
                      "--batch-size", "8", "--eval-samples", "32", "--save-params", str(params))
    assert f"kvstore {kvstore}, 2 workers" in out
    np.testing.assert_array_equal(np.load(str(params).format(rank=0)),
                                  np.load(str(params).format(rank=1)))


def test_fedavg_keeps_replicas_identical_after_each_round(tmp_path):
    pytest.importorskip("mxnet")
    params = tmp_path / "params-{rank}.npy"
    run_example("alexnet", "dgt", "--dataset", "synthetic", "--algo", "fedavg",
                "--local-steps", "2", "--max-steps", "4", "--batch-size", "8",
                "--partition", "noniid", "--eval-samples", "32", "--save-params", str(params))
    w0 = np.load(str(params).format(rank=0))
    w1 = np.load(str(params).format(rank=1))
    np.testing.assert_array_equal(w0, w1)


def label_skew(labels, shards):
    overall = np.bincount(labels, minlength=10) / len(labels)
    return max(0.5 * np.abs(np.bincount(labels[s], minlength=10) / len(s) - overall).sum()
               for s in shards)


def test_noniid_partition_is_label_skewed_and_iid_is_not():
    labels = np.random.default_rng(0).integers(0, 10, 20000)
    for scheme, alpha in (("iid", 0.5), ("noniid", 0.1), ("noniid", 0.5)):
        shards = data.partition(labels, 4, scheme, seed=3, alpha=alpha)
        merged = np.sort(np.concatenate(shards))
        np.testing.assert_array_equal(merged, np.arange(len(labels)))  # disjoint and complete
        skew = label_skew(labels, shards)
        if scheme == "iid":
            assert skew < 0.05
        else:
            assert skew > (0.5 if alpha == 0.1 else 0.2), (alpha, skew)
    again = data.partition(labels, 4, "noniid", seed=3, alpha=0.1)
    assert all((a == b).all() for a, b in zip(again, data.partition(labels, 4, "noniid", 3, 0.1)))


def write_cifar_fixture(directory: Path, per_batch: int = 10):
    rng = np.random.default_rng(1)
    directory.mkdir(parents=True)
    for name in data.CIFAR_FILES:
        batch = {b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 b"labels": rng.integers(0, 10, per_batch).tolist()}
        with open(directory / name, "wb") as f:
            pickle.dump(batch, f)


def test_cifar_loader_reads_the_python_batches(tmp_path):
    write_cifar_fixture(tmp_path / "cifar-10-batches-py")
    dataset = data.load_cifar10(str(tmp_path))
    assert dataset.train_x.shape == (50, 3, 32, 32) and dataset.train_x.dtype == np.uint8
    assert dataset.test_x.shape == (10, 3, 32, 32) and dataset.train_y.shape == (50,)


def test_missing_datasets_give_a_clear_error(tmp_path):
    with pytest.raises(data.DatasetMissing, match="dataset-fashion-mnist"):
        data.load_fashion_mnist(str(tmp_path))
    with pytest.raises(data.DatasetMissing, match="data_batch_1.*cifar-10-batches-py"):
        data.load_cifar10(str(tmp_path))
    pytest.importorskip("mxnet")
    proc = subprocess.run([sys.executable, str(EXAMPLES / "train_alexnet.py"), "--kvstore",
                           "local", "--dataset", "cifar10", "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "CIFAR-10 not found" in proc.stderr


@pytest.mark.skipif(not os.path.exists(data.FASHION_MNIST_DIR),
                    reason="needs the Debian package dataset-fashion-mnist")
def test_fashion_mnist_from_the_debian_package():
    dataset = data.load_fashion_mnist()
    assert dataset.train_x.shape == (60000, 1, 28, 28) and dataset.test_x.shape == (10000, 1, 28, 28)
    assert dataset.train_y[0] == 9 and np.bincount(dataset.train_y).tolist() == [6000] * 10
    assert abs(dataset.train_x.mean() / 255 - 0.2860) < 1e-3


def test_plot_tool_draws_a_recorded_run(tmp_path):
    pytest.importorskip("matplotlib")
    log = tmp_path / "run.jsonl"
    log.write_text("\n".join([
        '{"event": "start", "model": "alexnet", "kvstore": "dgt"}',
        '{"event": "step", "step": 10, "time_s": 5.0, "loss": 2.1, "k": 0.8, "bytes_per_channel": [100, 10, 10, 10]}',
        '{"event": "step", "step": 20, "time_s": 9.0, "loss": 1.7, "k": 0.7, "bytes_per_channel": [200, 25, 25, 25]}',
        '{"event": "eval", "step": 20, "time_s": 9.5, "accuracy": 0.61}']) + "\n")
    out = tmp_path / "plots"
    proc = subprocess.run([sys.executable, "-m", "dgt.plot", str(log), "-o", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("accuracy_vs_time.png", "accuracy_vs_step.png", "bytes_per_channel.png",
                 "k_vs_time.png", "loss_vs_step.png"):
        assert (out / name).stat().st_size > 1000


@pytest.mark.parametrize("text", ["0", "-0.5", "half"])
def test_a_bad_two_bit_threshold_is_refused_by_the_parser(text, capsys):
    import common
    with pytest.raises(SystemExit):
        common.build_parser("alexnet").parse_args(["--two-bit-threshold", text])
    assert "--two-bit-threshold" in capsys.readouterr().err
    assert common.build_parser("alexnet").parse_args(
        ["--two-bit-threshold", "0.05"]).two_bit_threshold == 0.05
