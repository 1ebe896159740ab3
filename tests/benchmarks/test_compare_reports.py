"""The benchmark's CSV / Markdown / PNG writer, on a small recorded run."""
import argparse
import csv
import json
import os

import pytest

pytest.importorskip("matplotlib")

from benchmarks import compare  # noqa: E402
from benchmarks.compare import COLUMNS, Row, markdown, summarise_curve, write_reports  # noqa: E402


def recorded_curve(path, step_s, accuracy_at):
    lines = [{"event": "start", "model": "alexnet"}]
    for step in range(1, 11):
        lines.append({"event": "step", "step": step, "train_time_s": step * step_s,
                      "time_s": step * step_s, "loss": 2.0})
        if step % 5 == 0:
            lines.append({"event": "eval", "step": step, "train_time_s": step * step_s,
                          "time_s": step * step_s, "accuracy": accuracy_at[step]})
    lines.append({"event": "summary", "steps": 10, "udp_loss_rate": 0.25,
                  "udp_late_rate": 0.05, "dgt_cpu_ms_per_step": 12.5, "bytes_per_channel": [8e6, 1e6, 5e5, 5e5]})
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_summarise_curve_measures_steps_and_time_to_target(tmp_path):
    curve = tmp_path / "c.jsonl"
    recorded_curve(curve, 0.5, {5: 0.4, 10: 0.7})
    out = summarise_curve(str(curve), target=0.6, warmup=3)
    assert out["step_time_s"] == pytest.approx(0.5) and out["step_time_p90_s"] == pytest.approx(0.5)
    assert out["time_to_target_s"] == pytest.approx(5.0) and out["final_accuracy"] == 0.7
    assert out["udp_loss_rate"] == 0.25 and out["worker_cpu_ms"] == 12.5
    assert out["udp_late_rate"] == 0.05
    assert out["channel_bytes_per_step"] == [8e5, 1e5, 5e4, 5e4]  # run totals / 10 steps
    with open(curve, "a") as f:  # dgt's totals covered 8 steps: the bytes are theirs
        f.write(json.dumps({"event": "summary", "steps": 10, "dgt_steps": 8,
                            "bytes_per_channel": [8e6, 0, 0, 0]}) + "\n")
    assert summarise_curve(str(curve), 0.6, 3)["channel_bytes_per_step"] == [1e6, 0, 0, 0]
    assert summarise_curve(str(curve), target=0.9, warmup=3)["time_to_target_s"] is None


def test_the_loss_cell_shows_the_late_part_and_nothing_for_systems_without_udp():
    assert compare.loss_cell(Row("dgt", "alexnet", 2, 1000.0, udp_loss_rate=0.42,
                                 udp_late_rate=0.031)) == "42.0% (3.1% late)"
    # A run recorded before the late count existed: only the loss.
    assert compare.loss_cell(Row("dgt", "alexnet", 2, 1000.0, udp_loss_rate=0.42)) == "42.0%"
    assert compare.loss_cell(Row("dist_sync", "alexnet", 2, 1000.0)) == "-"


def test_worker_cpu_is_the_median_per_counted_step_after_the_warmup(tmp_path):
    """Running totals in the step records: a compile in step 2 and a step dgt recorded late
    (two counted at once) do not move the median, which the run's mean (12.5) would."""
    cpu = {1: 0, 2: 900, 3: 910, 4: 920, 5: 930, 6: 950, 7: 960, 8: 970, 9: 980, 10: 990}
    counted = {1: 0, 2: 1, 3: 2, 4: 3, 5: 4, 6: 6, 7: 7, 8: 8, 9: 9, 10: 10}
    lines = [{"event": "step", "step": s, "train_time_s": s * 0.5, "dgt_cpu_ms": cpu[s],
              "dgt_steps": counted[s]} for s in range(1, 11)]
    lines.append({"event": "summary", "steps": 10, "dgt_cpu_ms_per_step": 99.0})
    curve = tmp_path / "c.jsonl"
    curve.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    # steps 4..10 after warmup 3: 10, 10, 20/2, 10, 10, 10, 10 ms per counted step
    assert summarise_curve(str(curve), 0.6, warmup=3)["worker_cpu_ms"] == pytest.approx(10.0)
    assert summarise_curve(str(curve), 0.6, warmup=1)["worker_cpu_ms"] == pytest.approx(10.0)


def test_machine_cpu_is_its_share_over_the_training_steps_without_the_evaluation(tmp_path):
    """Ticks per step: 10 busy of 10 in the warm-up, then 6 busy, 1 idle, 3 stolen a step,
    except across the evaluation after step 5 (100 busy), which is left out as its time is."""
    ticks, lines = {"busy": 0, "idle": 0, "steal": 0}, []
    for step in range(1, 11):
        warm = step <= 3
        across_eval = step == 6
        for name, per_step in (("busy", 100 if across_eval else 10 if warm else 6),
                               ("idle", 0 if warm or across_eval else 1),
                               ("steal", 0 if warm or across_eval else 3)):
            ticks[name] += per_step
        lines.append({"event": "step", "step": step, "train_time_s": step * 0.5,
                      "machine_cpu_ticks": dict(ticks)})
        if step == 5:
            lines.append({"event": "eval", "step": 5, "train_time_s": 2.5, "accuracy": 0.5})
    curve = tmp_path / "c.jsonl"
    curve.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = summarise_curve(str(curve), 0.6, warmup=3)
    assert out["machine_cpu_busy"] == pytest.approx(0.6)
    assert out["machine_cpu_steal"] == pytest.approx(0.3)
    # Records without ticks (another OS, or an older run): nothing is claimed.
    recorded_curve(curve, 0.5, {5: 0.4, 10: 0.7})
    out = summarise_curve(str(curve), 0.6, warmup=3)
    assert out["machine_cpu_busy"] is None and out["machine_cpu_steal"] is None


def test_reports_are_written_with_every_column(tmp_path):
    args = argparse.Namespace(name="t", workers=2, rate=1000.0, batch_size=32, steps=10,
                              results_dir=str(tmp_path))
    recorded_curve(tmp_path / "t-alexnet-dgt.jsonl", 0.4, {5: 0.5, 10: 0.8})
    recorded_curve(tmp_path / "t-alexnet-dist_sync.jsonl", 0.8, {5: 0.5, 10: 0.8})
    rows = [Row("dgt", "alexnet", 2, 1000.0, 10, 0.4, 0.45, 160.0, 150e6, 0.1, 2.0, 0.8, 0.2,
                1.2, worker_cpu_ms=20.0, server_cpu_ms=40.0, machine_cpu_busy=0.854,
                machine_cpu_steal=0.1, channel_bytes_per_step=[60e6, 5e6, 4.5e6, 4e6],
                kernel_drops_per_step=[0.0, 12.5, 20.0, 31.25]),
            Row("dist_sync", "alexnet", 2, 1000.0, 10, 0.8, 0.9, 80.0, 320e6, None, 4.0, 0.8,
                0.2, 2.6),
            Row("horovod", "alexnet", 2, 1000.0, status="not installed")]
    paths = write_reports(rows, args, "Machine: test.")
    with open(tmp_path / "t.csv") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == list(COLUMNS) and len(table) == 3
    assert table[0]["system"] == "dgt" and float(table[0]["step_time_s"]) == 0.4
    assert table[0]["channel_bytes_per_step"] == "60000000;5000000;4500000;4000000"
    assert table[1]["channel_bytes_per_step"] == ""  # dist_sync: no per-channel count
    text = (tmp_path / "t.md").read_text()
    assert "| alexnet | dgt | 0.400 | 0.450 | 0.50 |" in text  # ratio vs dist_sync
    assert "| 150.0 | 60.0; 5.0; 4.5; 4.0 | 10.0% |" in text  # kernel total, dgt's channels
    # dgt's CPU and its share of 0.4 s, then the machine's busy and stolen shares
    assert "| 20.0 (5.0 %), 40.0 (10.0 %) | 85 %, 10 % | 0.0; 12.5; 20.0; 31.2 | ok |" in text
    assert table[0]["kernel_drops_per_step"] == "0.0;12.5;20.0;31.2"
    assert "| 2.600 | - | - | - | ok |" in text  # no dgt CPU for dist_sync, no machine figures
    assert float(table[0]["machine_cpu_busy"]) == 0.854 and table[1]["machine_cpu_busy"] == ""
    assert "not installed" in text and text == markdown(rows, args, "Machine: test.")
    assert "Time to target" not in text  # no target was asked for
    args.target_accuracy, args.eval_every, args.eval_samples = 0.7, 5, 0
    assert ("first reaches 0.7, read every 5 steps on the whole test set"
            in markdown(rows, args, "Machine: test."))
    for name in ("t-step-time.png", "t-accuracy.png", "t-bytes.png"):
        assert (tmp_path / name).stat().st_size > 1000 and str(tmp_path / name) in paths


def test_colocated_servers_run_on_the_worker_nodes_and_their_links_are_measured():
    from benchmarks.compare import measured_links, server_hosts
    own = argparse.Namespace(servers=2, workers=2, colocate=False)
    shared = argparse.Namespace(servers=2, workers=2, colocate=True)
    assert server_hosts(own) == ["server", "server1"]
    assert server_hosts(shared) == ["worker0", "worker1"]
    assert measured_links("dgt", shared) == ["worker0", "worker1"]
    assert measured_links("dist_sync", own) == ["server", "server1"]
    assert measured_links("horovod", own) == ["worker0"]


def test_dgt_variants_join_the_systems_and_unknown_names_are_refused():
    from benchmarks.compare import resolve_systems
    systems, variants = resolve_systems(
        "dgt,dist_sync", ["k06:DGT_THRESHOLD=0.6,DGT_ERROR_FEEDBACK=1"])
    assert systems == ["dgt", "dist_sync", "dgt-k06"]
    assert variants == {"dgt-k06": {"DGT_THRESHOLD": "0.6", "DGT_ERROR_FEEDBACK": "1"}}
    # A variant named in --systems keeps its place.
    assert resolve_systems("dgt-k06,dgt", ["k06:DGT_THRESHOLD=0.6"])[0] == ["dgt-k06", "dgt"]
    with pytest.raises(ValueError, match="unknown dist-sync"):
        resolve_systems("dgt,dist-sync", [])
    for bad in ("k06", "K06:DGT_THRESHOLD=0.6", "k06:THRESHOLD=0.6", "k06:DGT_THRESHOLD="):
        with pytest.raises(ValueError, match="--variant"):
            resolve_systems("dgt", [bad])


def test_the_table_states_every_dgt_setting(tmp_path):
    args = argparse.Namespace(name="t", workers=2, rate=1000.0, batch_size=32, steps=10,
                              results_dir=str(tmp_path), dgt_env={"DGT_ADAPTIVE": "1"},
                              variants={"dgt-k06": {"DGT_THRESHOLD": "0.6"}})
    text = markdown([Row("dgt-k06", "alexnet", 2, 1000.0, status="ok")], args, "M.")
    assert "Every dgt run: DGT_ADAPTIVE=1." in text
    assert "`dgt-k06`: dgt with DGT_THRESHOLD=0.6." in text
    assert "| alexnet | dgt-k06 |" in text
    assert "dist_sync_2bit" not in text  # its threshold only when it ran
    args.two_bit_threshold = 0.05
    text = markdown([Row("dist_sync_2bit", "alexnet", 2, 1000.0, status="ok")], args, "M.")
    assert "`dist_sync_2bit`: threshold 0.05." in text
    assert "seed" not in text  # seed 0, the default, goes unsaid
    args.seed = 3
    assert "steps, Fashion-MNIST, seed 3. M." in markdown([], args, "M.")


@pytest.mark.parametrize("threshold", ["0", "-0.5"])
def test_a_bad_two_bit_threshold_is_refused_before_any_set_up(threshold, capsys):
    with pytest.raises(SystemExit):
        compare.main(["--two-bit-threshold", threshold])
    assert "--two-bit-threshold" in capsys.readouterr().err


def test_the_background_load_runs_through_every_node_of_the_job_and_is_stated(tmp_path):
    from benchmarks.compare import job_nodes
    own = argparse.Namespace(servers=1, workers=2, colocate=False)
    shared = argparse.Namespace(servers=2, workers=2, colocate=True)
    assert job_nodes(own) == ["server", "worker0", "worker1"]
    assert job_nodes(shared) == ["worker0", "worker1"]  # the scheduler's node carries no data
    args = argparse.Namespace(name="t", workers=2, rate=1000.0, batch_size=32, steps=10,
                              results_dir=str(tmp_path))
    assert "Background load" not in markdown([], args, "M.")
    args.cross_traffic, args.cross_precedence = 300.0, 0
    assert ("Background load: 300 Mbit/s of open-loop UDP into and out of every node of the "
            "job, at IP precedence 0" in markdown([], args, "M."))


def test_the_low_queue_setting_is_checked_and_reported(tmp_path, capsys):
    for bad in ("0", "100001"):
        with pytest.raises(SystemExit):
            compare.main(["--low-queue-frames", bad])
        assert f"--low-queue-frames {bad} is out of range" in capsys.readouterr().err
    args = argparse.Namespace(name="t", workers=2, rate=1000.0, batch_size=32, steps=10,
                              results_dir=str(tmp_path))
    assert "Queues: 1000 full frames in every class." in markdown([], args, "M.")
    args.low_queue_frames = 100
    assert ("Queues: 1000 full frames in the top class, 100 in every class below it"
            in markdown([], args, "M."))


@pytest.mark.parametrize("flags", [["--cross-traffic", "-1"],
                                   ["--rate", "250", "--cross-traffic", "300"],
                                   ["--cross-traffic", "100", "--cross-precedence", "4"]])
def test_a_bad_background_load_is_refused_before_any_set_up(flags, capsys):
    with pytest.raises(SystemExit):
        compare.main(flags)
    assert "--cross-" in capsys.readouterr().err


class _Bed:
    """What job_processes reads of a Testbed: addresses and the namespace prefix."""

    addresses = {"server": "10.0.0.1", "worker0": "10.0.0.2", "worker1": "10.0.0.3"}

    def exec_prefix(self, node):
        return ["ip", "netns", "exec", node]


def _job_args(tmp_path, trace):
    return argparse.Namespace(workers=2, servers=1, colocate=False, steps=5, batch_size=8,
                              lr=0.01, eval_samples=100, eval_every=0, seed=0, dgt_env={},
                              variants={}, trace=trace, results_dir=str(tmp_path))


class _Unstarted:
    """Stands for dgt.launch._Child: records what would be started, starts nothing."""

    def __init__(self, role, rank, argv, env, out=None, host=None):
        self.role, self.rank, self.argv, self.env = role, rank, argv, env


@pytest.mark.parametrize("trace", [False, True])
def test_trace_flag_gives_every_dgt_process_a_trace_path(tmp_path, monkeypatch, trace):
    monkeypatch.setattr(compare, "_Child", _Unstarted)
    curve = str(tmp_path / "run-alexnet-dgt.jsonl")
    children = compare.job_processes("dgt", _Bed(), _job_args(tmp_path, trace), "alexnet",
                                     curve, None)
    assert {c.role for c in children} == {"server", "worker"}
    for child in children:
        if trace:
            assert child.env["DGT_TRACE"] == str(tmp_path / "run-alexnet-dgt-trace"
                                                 / "{role}{index}.jsonl")
        else:
            assert "DGT_TRACE" not in child.env
    assert (tmp_path / "run-alexnet-dgt-trace").is_dir() == trace


def test_a_traced_run_gets_its_timeline_summary_and_an_untraced_one_none(tmp_path):
    from tests.benchmarks.test_timeline import two_keys_three_steps

    curve = str(tmp_path / "run-alexnet-dgt.jsonl")
    assert compare.write_timeline(curve) is None
    trace_dir = tmp_path / "run-alexnet-dgt-trace"
    trace_dir.mkdir()
    (trace_dir / "all.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in two_keys_three_steps()))
    path = compare.write_timeline(curve, warmup=0)
    assert path == str(tmp_path / "run-alexnet-dgt-timeline.md")
    text = open(path).read()
    assert "| 7 | 1 | 0.0 | 100.0 | 50.0 | 10.0 | 40.0 |" in text


def test_every_process_of_a_job_imports_dgt_from_the_benchmarks_checkout(tmp_path, monkeypatch):
    # An editable install may point at another checkout than the one running the benchmark.
    monkeypatch.setattr(compare, "_Child", _Unstarted)
    monkeypatch.setenv("PYTHONPATH", "elsewhere")
    children = compare.job_processes("dgt", _Bed(), _job_args(tmp_path, False), "alexnet",
                                     str(tmp_path / "run-alexnet-dgt.jsonl"), None)
    for child in children:
        assert child.env["PYTHONPATH"].split(os.pathsep) == [compare.ROOT, "elsewhere"]
