"""--rounds: alternating orders, folding rounds into one row, and the reports of a run."""
import argparse
import csv
import itertools
import os

import pytest

pytest.importorskip("matplotlib")

from benchmarks import compare  # noqa: E402
from benchmarks.compare import COLUMNS, Row, write_reports  # noqa: E402
from benchmarks.rounds import (combine_rounds, median_reached, round_order,  # noqa: E402
                               same_round_ratios)

from .test_compare_reports import recorded_curve  # noqa: E402


def test_rounds_alternate_forwards_and_backwards():
    systems = ["dgt", "dist_sync", "horovod"]
    assert round_order(systems, 0) == systems
    assert round_order(systems, 1) == ["horovod", "dist_sync", "dgt"]
    assert round_order(systems, 2) == systems
    with pytest.raises(ValueError, match="round_index"):
        round_order(systems, -1)


@pytest.mark.parametrize("count", [1, 2, 3, 5])
@pytest.mark.parametrize("rounds", [2, 4, 6])
def test_over_an_even_number_of_rounds_a_linear_drift_falls_on_every_system_alike(count, rounds):
    """Each run takes one time slot; a machine slowing down linearly charges a run its slot
    number.  Summed over the rounds, every system is charged the same."""
    systems = [f"s{i}" for i in range(count)]
    slots = itertools.count()
    charged = dict.fromkeys(systems, 0)
    for r in range(rounds):
        for system in round_order(systems, r):
            charged[system] += next(slots)
    assert len(set(charged.values())) == 1


def test_time_to_target_over_rounds_counts_a_miss_as_later_than_any_hit():
    assert median_reached([10.0, None, 12.0]) == 12.0
    assert median_reached([10.0, 20.0]) == 15.0
    assert median_reached([10.0, None, None]) is None  # the median round never got there
    assert median_reached([None]) is None and median_reached([]) is None


def rows_of(system, steps, targets, accuracies, statuses=None):
    statuses = statuses or ["ok"] * len(steps)
    return [Row(system, "alexnet", 2, 1000.0, 100, step, step and step * 1.1, None,
                100e6 * (i + 1), udp_loss_rate=0.1 * (i + 1), udp_late_rate=0.01 * (i + 1),
                time_to_target_s=target, final_accuracy=accuracy, compute_s=0.2,
                lower_bound_s=0.5, worker_cpu_ms=10.0 * (i + 1),
                machine_cpu_busy=0.3 * (i + 1), machine_cpu_steal=0.01 * (i + 1),
                channel_bytes_per_step=[8.0 * (i + 1), 2.0],
                kernel_drops_per_step=[0.0, 1.0 * (i + 1), 3.0, 10.0 * (i + 1)],
                round=i + 1, status=status,
                curve_paths=[f"{system}-r{i + 1}.jsonl"])
            for i, (step, target, accuracy, status) in
            enumerate(zip(steps, targets, accuracies, statuses))]


def test_rounds_fold_into_medians_a_mean_accuracy_and_named_failures():
    row = combine_rounds(rows_of("dgt", [0.5, 0.7, 0.6], [50.0, None, 40.0], [0.7, 0.8, 0.9]),
                         throughput_of=lambda step: 64 / step)
    assert row.step_time_s == pytest.approx(0.6) and row.throughput_samples_s == 64 / 0.6
    assert row.step_time_p90_s == pytest.approx(0.66) and row.bytes_per_step == 200e6
    assert row.udp_loss_rate == pytest.approx(0.2) and row.worker_cpu_ms == 20.0
    assert row.udp_late_rate == pytest.approx(0.02)
    assert row.kernel_drops_per_step == [0.0, 2.0, 3.0, 20.0]
    assert row.machine_cpu_busy == pytest.approx(0.6)
    assert row.machine_cpu_steal == pytest.approx(0.02)
    assert row.time_to_target_s == 50.0  # 40, 50 and a miss
    assert row.final_accuracy == pytest.approx(0.8) and row.channel_bytes_per_step == [16.0, 2.0]
    assert (row.rounds, row.round, row.status) == (3, None, "ok")
    # A failed round is left out of the medians, counted as a miss, and named.
    row = combine_rounds(rows_of("dgt", [0.5, None, 0.7], [50.0, None, 60.0], [0.7, None, 0.9],
                                 ["ok", "failed (exit 1)", "ok"]))
    assert row.step_time_s == pytest.approx(0.6) and row.time_to_target_s == 60.0
    assert row.status == "round 2: failed (exit 1)" and row.final_accuracy == pytest.approx(0.8)
    failed = combine_rounds(rows_of("dgt", [None], [None], [None], ["failed (exit 2)"]))
    assert failed.status == "round 1: failed (exit 2)" and failed.step_time_s is None
    with pytest.raises(ValueError, match="at least one"):
        combine_rounds([])


def test_same_round_ratios_pair_each_round_with_the_baselines_own():
    rows = (rows_of("dgt", [0.5, 0.9], [50.0, None], [0.7, 0.8])
            + rows_of("dist_sync", [1.0, 1.5], [100.0, 150.0], [0.7, 0.8]))
    assert same_round_ratios(rows, "step_time_s", "dist_sync") == {
        ("alexnet", "dgt", 1): 0.5, ("alexnet", "dgt", 2): 0.6,
        ("alexnet", "dist_sync", 1): 1.0, ("alexnet", "dist_sync", 2): 1.0}
    assert same_round_ratios(rows, "time_to_target_s", "dist_sync")[("alexnet", "dgt", 1)] == 0.5
    assert ("alexnet", "dgt", 2) not in same_round_ratios(rows, "time_to_target_s", "dist_sync")


def test_reports_of_several_rounds_list_every_round_and_the_same_round_medians(tmp_path):
    args = argparse.Namespace(name="t", workers=2, rate=1000.0, batch_size=32, steps=10,
                              results_dir=str(tmp_path), systems=["dgt", "dist_sync"])
    round_rows = (rows_of("dgt", [0.5, 0.9], [50.0, None], [0.7, 0.8])
                  + rows_of("dist_sync", [1.0, 1.5], [100.0, 150.0], [0.7, 0.8]))
    for r in round_rows:
        r.curve_paths = [str(tmp_path / p) for p in r.curve_paths]
        recorded_curve(tmp_path / os.path.basename(r.curve_paths[0]), r.step_time_s, {5: 0.5, 10: 0.8})
    rows = compare.fold_rounds(round_rows, args)
    assert [r.system for r in rows] == ["dgt", "dist_sync"] and rows[0].rounds == 2
    assert rows[0].curve_paths == [r.curve_paths[0] for r in round_rows[:2]]
    paths = write_reports(rows, args, "M.", round_rows)
    with open(tmp_path / "t.csv") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == list(COLUMNS) and table[0]["rounds"] == "2"
    assert float(table[0]["step_time_s"]) == pytest.approx(0.7)
    with open(tmp_path / "t-rounds.csv") as f:
        per_round = list(csv.DictReader(f))
    assert [(r["system"], r["round"]) for r in per_round] == [
        ("dgt", "1"), ("dgt", "2"), ("dist_sync", "1"), ("dist_sync", "2")]
    text = (tmp_path / "t.md").read_text()
    assert "the median of 2 rounds" in text
    # round 2 runs backwards: dist_sync first, dgt second
    assert "| alexnet | dgt | 2 | 2 | 0.900 | 0.60 | - | - | 0.800 | ok |" in text
    assert "| alexnet | dist_sync | 2 | 1 | 1.500 | 1.00 | 150.0 | 1.00 |" in text
    assert ("alexnet, dgt: the median of the same-round ratios to `dist_sync` is 0.55 on the "
            "step, 0.50 on the time to target (the 1 of 2 rounds where both reached it)"
            in text)
    assert str(tmp_path / "t-rounds.csv") in paths and (tmp_path / "t-accuracy.png").exists()


def test_a_run_of_several_rounds_alternates_and_folds(tmp_path, monkeypatch):
    """main() with the testbed and the jobs replaced: the order of the runs, and the rows."""
    ran = []

    class FakeBed:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def fake_run(system, model, bed, args, compute, round_index=0):
        ran.append((round_index, system))
        step = {"dgt": 0.5, "dist_sync": 1.0}[system] * (1 + 0.1 * len(ran))  # drifting
        return Row(system, model, args.workers, args.rate, 10, step, step, None, 1e6,
                   round=round_index + 1, status="ok")

    monkeypatch.setattr(compare, "available", lambda: "")
    monkeypatch.setattr(compare.examples_data, "fashion_mnist_missing", lambda data_dir="": "")
    monkeypatch.setattr(compare, "Testbed", FakeBed)
    monkeypatch.setattr(compare, "measure_compute", lambda model, batch: 0.1)
    monkeypatch.setattr(compare, "run_one", fake_run)
    monkeypatch.setattr(compare, "plot", lambda rows, args: [])
    assert compare.main(["--models", "alexnet", "--systems", "dgt,dist_sync", "--rounds", "4",
                         "--results-dir", str(tmp_path), "--name", "r"]) == 0
    assert ran == [(0, "dgt"), (0, "dist_sync"), (1, "dist_sync"), (1, "dgt"),
                   (2, "dgt"), (2, "dist_sync"), (3, "dist_sync"), (3, "dgt")]
    with open(tmp_path / "r.csv") as f:
        table = {r["system"]: r for r in csv.DictReader(f)}
    # dgt's runs sit in slots 1, 4, 5, 8 and dist_sync's in 2, 3, 6, 7: the same drift.
    assert float(table["dgt"]["step_time_s"]) == pytest.approx(0.5 * 1.45)
    assert float(table["dist_sync"]["step_time_s"]) == pytest.approx(1.0 * 1.45)
    with open(tmp_path / "r-rounds.csv") as f:
        assert len(list(csv.DictReader(f))) == 8


@pytest.mark.parametrize("rounds", ["0", "21"])
def test_a_bad_number_of_rounds_is_refused_before_any_set_up(rounds, capsys):
    with pytest.raises(SystemExit):
        compare.main(["--rounds", rounds])
    assert "--rounds" in capsys.readouterr().err


def test_a_missing_dataset_is_refused_before_the_testbed_is_built(tmp_path, monkeypatch, capsys):
    class Unbuildable:
        def __init__(self, *args, **kwargs):
            raise AssertionError("the testbed was built although no run could read its data")

    monkeypatch.setattr(compare, "available", lambda: "")
    monkeypatch.setattr(compare.examples_data, "FASHION_MNIST_DIR", str(tmp_path / "none"))
    monkeypatch.setattr(compare, "Testbed", Unbuildable)
    assert compare.main(["--quick", "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Fashion-MNIST not found in" in err and "train-images-idx3-ubyte.gz" in err
    assert "dataset-fashion-mnist" in err
