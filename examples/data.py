"""Datasets and worker partitions for the examples (numpy only, no download ever).

* ``fashion-mnist``: the four idx files of the Debian package ``dataset-fashion-mnist``
  (``/usr/share/datasets/fashion-mnist``), or the same files in ``--data-dir``.
* ``cifar10``: the standard python-pickle batches (``cifar-10-batches-py``) in ``--data-dir``.
* ``synthetic``: seeded random images of the right shape with learnable labels, for timing.

Partitions: ``iid`` deals a seeded permutation round-robin; ``noniid`` is label-skewed: for
every class, its samples are split among the workers in proportions drawn from
Dirichlet(alpha) (alpha = ``--noniid-alpha``, 0.5 by default; smaller is more skewed), seeded,
so every sample belongs to exactly one worker.
"""
from __future__ import annotations

import gzip
import os
import pickle
from dataclasses import dataclass
from typing import List

import numpy as np

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                 "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
CIFAR_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)


class DatasetMissing(FileNotFoundError):
    """The dataset's files are not where they were looked for (message says how to fix)."""


@dataclass
class Dataset:
    name: str
    train_x: np.ndarray  # (N, C, H, W) uint8
    train_y: np.ndarray  # (N,) int
    test_x: np.ndarray
    test_y: np.ndarray
    classes: int = 10


def _read_idx(path: str) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    magic = int.from_bytes(raw[0:4], "big")
    ndim = magic & 0xFF
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def fashion_mnist_missing(data_dir: str = "") -> str:
    """Why Fashion-MNIST cannot be read from ``data_dir`` (and how to fix it), or ``""``."""
    directory = data_dir or FASHION_MNIST_DIR
    missing = [f for f in FASHION_FILES if not os.path.exists(os.path.join(directory, f))]
    if not missing:
        return ""
    return (f"Fashion-MNIST not found in {directory} (missing {', '.join(missing)}). Install "
            "the Debian package: `sudo apt-get install dataset-fashion-mnist` (`make dataset` "
            "does it when run as root), or pass --data-dir with those four files.")


def load_fashion_mnist(data_dir: str = "") -> Dataset:
    problem = fashion_mnist_missing(data_dir)
    if problem:
        raise DatasetMissing(problem)
    directory = data_dir or FASHION_MNIST_DIR
    arrays = [_read_idx(os.path.join(directory, f)) for f in FASHION_FILES]
    train_x, train_y, test_x, test_y = arrays
    return Dataset("fashion-mnist", train_x[:, None], train_y.astype(np.int64),
                   test_x[:, None], test_y.astype(np.int64))


def load_cifar10(data_dir: str) -> Dataset:
    candidates = [data_dir, os.path.join(data_dir, "cifar-10-batches-py")] if data_dir else []
    for directory in candidates:
        if all(os.path.exists(os.path.join(directory, f)) for f in CIFAR_FILES):
            break
    else:
        raise DatasetMissing(
            f"CIFAR-10 not found in {data_dir or '(no --data-dir given)'}: expected the python "
            f"batches {', '.join(CIFAR_FILES)} (the `cifar-10-batches-py` folder of the "
            "official archive). Pass --data-dir pointing at it; dgt never downloads data.")

    def read(name):
        with open(os.path.join(directory, name), "rb") as f:
            batch = pickle.load(f, encoding="bytes")  # the local dataset file, not the network
        return (np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32),
                np.asarray(batch[b"labels"], dtype=np.int64))

    parts = [read(name) for name in CIFAR_FILES[:5]]
    test_x, test_y = read("test_batch")
    return Dataset("cifar10", np.concatenate([p[0] for p in parts]),
                   np.concatenate([p[1] for p in parts]), test_x, test_y)


def make_synthetic(channels: int = 1, size: int = 28, train: int = 6000, test: int = 1000,
                   seed: int = 0) -> Dataset:
    """Random images whose label is encoded in a bright class-specific patch (learnable)."""
    rng = np.random.default_rng(seed)

    def build(count):
        labels = rng.integers(0, 10, count)
        images = rng.integers(0, 90, (count, channels, size, size), dtype=np.uint8)
        patch = max(2, size // 8)
        for cls in range(10):
            row, col = divmod(cls, 4)
            rows = slice(row * patch * 2, row * patch * 2 + patch)
            cols = slice(col * patch * 2, col * patch * 2 + patch)
            images[labels == cls, :, rows, cols] = 255
        return images, labels

    train_x, train_y = build(train)
    test_x, test_y = build(test)
    return Dataset("synthetic", train_x, train_y, test_x, test_y)


def load(name: str, data_dir: str = "", channels: int = 1, seed: int = 0) -> Dataset:
    if name == "fashion-mnist":
        return load_fashion_mnist(data_dir)
    if name == "cifar10":
        return load_cifar10(data_dir)
    if name == "synthetic":
        return make_synthetic(channels=channels, seed=seed)
    raise ValueError(f"unknown dataset {name!r}: fashion-mnist, cifar10 or synthetic")


def partition(labels: np.ndarray, workers: int, scheme: str, seed: int,
              alpha: float = 0.5) -> List[np.ndarray]:
    """Sample indices of every worker's shard (disjoint, together all samples)."""
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        order = rng.permutation(len(labels))
        return [np.sort(order[w::workers]) for w in range(workers)]
    if scheme != "noniid":
        raise ValueError(f"unknown partition {scheme!r}: iid or noniid")
    if alpha <= 0:
        raise ValueError(f"--noniid-alpha must be > 0, got {alpha}")
    shards: List[list] = [[] for _ in range(workers)]
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        shares = rng.dirichlet(np.full(workers, alpha))
        cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
        for w, piece in enumerate(np.split(members, cuts)):
            shards[w].extend(piece.tolist())
    return [np.sort(np.asarray(s, dtype=np.int64)) for s in shards]
