"""Side-by-side benchmark on the emulated congested cluster (root only).

    sudo python -m benchmarks.compare --quick            # every system on AlexNet, < 10 min
    sudo python -m benchmarks.compare --models alexnet,vgg11,googlenet --steps 300 \\
         --eval-every 50 --target-accuracy 0.7

For every model, the same testbed (``benchmarks/testbed.py``: one namespace per node, links
shaped to ``--rate`` Mbit/s in both directions, priority classes on the TOS byte), the same
data (Fashion-MNIST, IID, the same seeds) and the same step budget, one system after the other:

* ``dgt``           -- dgt with its defaults;
* ``dgt-reliable``  -- dgt with ``DGT_ENABLE=0`` (everything over TCP: transport efficiency);
* ``dist_sync``     -- MXNet's parameter server;
* ``dist_sync_2bit``-- the same with 2-bit gradient compression;
* ``dist_sync_p3``  -- the same with MXNet's P3 priority van;
* ``horovod``       -- Horovod's ring allreduce over Gloo, when ``horovod.mxnet`` imports
  (``make horovod`` builds it; else reported as not installed).  It has no server, so its
  bytes are those of worker 0's link;
* ``horovod_fp16``  -- the same with Horovod's ``Compression.fp16`` (gradients as float16),
  the peer of dgt's ``DGT_WIRE_DTYPE=bfloat16``;
* ``dgt-NAME``      -- dgt with extra settings, defined by ``--variant NAME:DGT_X=1,DGT_Y=2``,
  so that several dgt settings meet the same baseline in one run.

``--rounds N`` runs the systems N times, forwards then backwards, so that the machine's drift
over the run falls on every system alike (``benchmarks/rounds.py``); each row is then the
median of its rounds, and every round is listed too.

``--cross-traffic MBIT`` adds another tenant's load for the whole run: an open-loop UDP flow
of MBIT Mbit/s into and out of every node of the job (``benchmarks/crosstraffic.py``), at IP
precedence ``--cross-precedence`` (0, best effort, by default), the same for every system.

Each run is a real training job (``examples/train_<model>.py``) with the server in its own
namespace and each worker in its own.  Reported per system and model: median and p90 step time,
throughput, bytes through the server's link per step (kernel interface counters), UDP loss
(dgt), time to ``--target-accuracy`` and the final accuracy, a lower bound
``max(compute time, bytes through the bottleneck / rate)``, dgt's own CPU per step, and the
whole machine's busy and stolen shares of its CPU time over the training steps (from
``/proc/stat``; a run near 100 % was CPU-bound, whatever its network did).  Results go to
``benchmarks/results/<name>.csv``, ``.md`` and ``<name>-*.png``.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks.rounds import combine_rounds, round_order, same_round_ratios  # noqa: E402
from benchmarks.testbed import QUEUE_FRAMES, Testbed, available  # noqa: E402
from benchmarks.timeline import load_events, part_times  # noqa: E402
from benchmarks.timeline import report as timeline_report  # noqa: E402
from dgt.launch import _Child, supervise  # noqa: E402
from dgt.server import own_cpu_from_log  # noqa: E402
import examples.data as examples_data  # noqa: E402

SYSTEMS = ("dgt", "dgt-reliable", "dist_sync", "dist_sync_2bit", "dist_sync_p3", "horovod",
           "horovod_fp16")
HOROVOD_SYSTEMS = ("horovod", "horovod_fp16")
COLUMNS = ("system", "model", "workers", "rate_mbit", "steps", "step_time_s", "step_time_p90_s",
           "throughput_samples_s", "bytes_per_step", "channel_bytes_per_step", "udp_loss_rate",
           "udp_late_rate", "time_to_target_s",
           "final_accuracy", "compute_s", "lower_bound_s", "worker_cpu_ms", "server_cpu_ms",
           "machine_cpu_busy", "machine_cpu_steal", "kernel_drops_per_step", "rounds", "status")


@dataclass
class Row:
    system: str
    model: str
    workers: int
    rate_mbit: float
    steps: int = 0
    step_time_s: Optional[float] = None
    step_time_p90_s: Optional[float] = None
    throughput_samples_s: Optional[float] = None
    bytes_per_step: Optional[float] = None
    udp_loss_rate: Optional[float] = None
    time_to_target_s: Optional[float] = None
    final_accuracy: Optional[float] = None
    compute_s: Optional[float] = None
    lower_bound_s: Optional[float] = None
    # dgt's own CPU per step (thread CPU, see StepStats.cpu_ms and Server.own_cpu_s): on
    # worker 0, and on the busiest server.  Empty for the other systems.
    worker_cpu_ms: Optional[float] = None
    server_cpu_ms: Optional[float] = None
    # The whole machine's CPU over the training steps (every process of the job, and anyone
    # else's), as shares of all its cores' time: busy, and stolen by the hypervisor.  A run
    # whose busy + steal is near 1 was CPU-bound, whatever its network did.
    machine_cpu_busy: Optional[float] = None
    machine_cpu_steal: Optional[float] = None
    status: str = "ok"
    # dgt's own count (its statistics, not the kernel's): payload bytes worker 0 pushed per
    # step on each channel, TCP first, then UDP channels 1..C.  Empty for the other systems.
    channel_bytes_per_step: Optional[List[float]] = None
    # --rounds: how many rounds a row folds in; a round's own row carries its number (1..).
    rounds: int = 1
    round: Optional[int] = None
    curve_paths: Optional[List[str]] = None  # the accuracy curves behind the row
    # The part of udp_loss_rate that arrived, but after the server had closed its step.
    udp_late_rate: Optional[float] = None
    # Packets the kernel's queues dropped on the job's links, per class from the top (dgt's
    # reliable channel) to the lowest (its last UDP channel and all unmarked traffic), per
    # step over the whole run: what every system lost in the network, TCP's retransmitted.
    kernel_drops_per_step: Optional[List[float]] = None


# -- measuring one run ------------------------------------------------------------------------
def summarise_curve(path: str, target: float, warmup: int) -> dict:
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if r.get("event") == "step"]
    evals = [r for r in records if r.get("event") == "eval"]
    summary = next((r for r in reversed(records) if r.get("event") == "summary"), {})
    times = [b["train_time_s"] - a["train_time_s"] for a, b in zip(steps, steps[1:])
             if b["step"] == a["step"] + 1 and b["step"] > warmup]
    out = {"steps": summary.get("steps", len(steps)),
           "final_accuracy": evals[-1]["accuracy"] if evals else None,
           "udp_loss_rate": summary.get("udp_loss_rate"),
           "udp_late_rate": summary.get("udp_late_rate"),
           "worker_cpu_ms": worker_cpu_median(steps, warmup)
           if any("dgt_cpu_ms" in s for s in steps) else summary.get("dgt_cpu_ms_per_step"),
           "accuracy_curve": [(e["train_time_s"], e["accuracy"]) for e in evals],
           "channel_bytes_per_step": None}
    out["machine_cpu_busy"], out["machine_cpu_steal"] = machine_cpu_shares(records, warmup)
    counted = summary.get("dgt_steps", out["steps"])  # the steps dgt's totals cover
    if summary.get("bytes_per_channel") and counted:
        out["channel_bytes_per_step"] = [b / counted for b in summary["bytes_per_channel"]]
    if times:
        ordered = sorted(times)
        out["step_time_s"] = statistics.median(times)
        out["step_time_p90_s"] = ordered[int(0.9 * (len(ordered) - 1))]
    reached = [e["train_time_s"] for e in evals if e["accuracy"] >= target] if target else []
    out["time_to_target_s"] = reached[0] if reached else None
    return out


def worker_cpu_median(steps: list, warmup: int) -> Optional[float]:
    """dgt's own CPU per step on rank 0, the median over the steps after ``warmup`` (as the
    step time is): from the running totals of CPU and of steps dgt has recorded, which trail
    the training steps a little.  A mean would charge one-time costs (numba compiling a
    kernel on a machine without its cache, first-touch page faults) to a 60-step run."""
    per_step = []
    for a, b in zip(steps, steps[1:]):
        if b["step"] <= warmup or "dgt_cpu_ms" not in a or "dgt_cpu_ms" not in b:
            continue
        counted = b.get("dgt_steps", b["step"]) - a.get("dgt_steps", a["step"])
        if counted > 0:
            per_step.append((b["dgt_cpu_ms"] - a["dgt_cpu_ms"]) / counted)
    return statistics.median(per_step) if per_step else None


def machine_cpu_shares(records: list, warmup: int) -> tuple:
    """``(busy, steal)``: the machine's busy and stolen CPU time over the training steps after
    ``warmup``, as shares of all its CPU time, from the ``machine_cpu_ticks`` of consecutive
    step records; a pair of steps with an evaluation between them is left out, as the step
    times leave out the evaluation.  ``(None, None)`` when the records carry no ticks."""
    busy = idle = steal = 0
    previous = None
    for record in records:
        if record.get("event") == "eval":
            previous = None
        if record.get("event") != "step":
            continue
        ticks = record.get("machine_cpu_ticks")
        if (previous is not None and ticks and record["step"] > warmup
                and record["step"] == previous["step"] + 1):
            before = previous["machine_cpu_ticks"]
            busy += ticks["busy"] - before["busy"]
            idle += ticks["idle"] - before["idle"]
            steal += ticks["steal"] - before["steal"]
        previous = record if ticks else None
    total = busy + idle + steal
    return (busy / total, steal / total) if total > 0 else (None, None)


def measure_compute(model: str, batch: int) -> Optional[float]:
    """Median fwd+bwd+update time of one process with no communication (kvstore local)."""
    with open(os.devnull, "w") as devnull:
        path = os.path.join(HERE, "results", f".compute-{model}-{os.getpid()}.jsonl")
        cmd = [sys.executable, os.path.join(ROOT, "examples", f"train_{model}.py"),
               "--kvstore", "local", "--dataset", "fashion-mnist", "--max-steps", "12",
               "--batch-size", str(batch), "--eval-samples", "10", "--log-every", "1",
               "--log", path]
        if subprocess.run(cmd, stdout=devnull, stderr=devnull, timeout=900).returncode != 0:
            return None
    try:
        return summarise_curve(path, 0.0, warmup=3).get("step_time_s")
    finally:
        os.remove(path)


def server_nodes(count: int) -> List[str]:
    """Testbed node names of dedicated servers: ``server``, ``server1``, ..."""
    return ["server"] + [f"server{i}" for i in range(1, count)]


def server_hosts(args) -> List[str]:
    """Where the parameter servers run: their own nodes, or with ``--colocate`` server i on
    worker i's node (no extra machine; each link then carries the other workers' share)."""
    if getattr(args, "colocate", False):
        return [f"worker{i}" for i in range(args.servers)]
    return server_nodes(args.servers)


def job_nodes(args) -> List[str]:
    """Every node a job's processes run on (the ones the background load goes through)."""
    workers = [f"worker{r}" for r in range(args.workers)]
    return [node for node in server_hosts(args) if node not in workers] + workers


def measured_links(system: str, args) -> List[str]:
    """The links whose bytes bound the step: the servers', or the workers' where they serve
    (or, for allreduce, where there is no server; its links are all alike)."""
    if system in HOROVOD_SYSTEMS:
        return ["worker0"]
    return server_hosts(args)


def parse_variant(text: str) -> tuple:
    """``NAME:DGT_X=1,DGT_Y=2`` -> (``dgt-NAME``, {DGT_X: 1, DGT_Y: 2})."""
    name, sep, settings = text.partition(":")
    if not sep or not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):
        raise ValueError(f"--variant {text!r}: expected NAME:DGT_X=VALUE[,DGT_Y=VALUE...] "
                         "with NAME of lower-case letters, digits and '-'")
    env = {}
    for item in settings.split(","):
        var, eq, value = item.partition("=")
        if not eq or not var.startswith("DGT_") or not value:
            raise ValueError(f"--variant {text!r}: {item!r} is not DGT_VARIABLE=VALUE")
        env[var] = value
    return f"dgt-{name}", env


def resolve_systems(listed: str, variants: List[str]) -> tuple:
    """The systems to run, in order, and each dgt variant's settings.  Variants not named in
    ``listed`` run after it; an unknown name is refused before any run starts."""
    extra = dict(parse_variant(text) for text in variants)
    systems = [name for name in listed.split(",") if name]
    unknown = [name for name in systems if name not in SYSTEMS and name not in extra]
    if unknown:
        raise ValueError(f"--systems: unknown {', '.join(unknown)}; known: "
                         f"{', '.join(SYSTEMS + tuple(extra))}")
    systems += [name for name in extra if name not in systems]
    return systems, extra


def job_processes(system: str, bed: Testbed, args, model: str, curve: str, log) -> List[_Child]:
    server_ip = bed.addresses["server"]
    servers = server_hosts(args)
    port = 9100 + random.randrange(800)
    base = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for key in [k for k in base if k.startswith(("DGT_", "DMLC_"))]:
        del base[key]
    # Workers and servers import dgt from this checkout: an editable install points at
    # another one (a worktree's run once mixed the main checkout's workers with its servers).
    base["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, base.get("PYTHONPATH", "")) if p)
    train = [sys.executable, os.path.join(ROOT, "examples", f"train_{model}.py"),
             "--dataset", "fashion-mnist", "--max-steps", str(args.steps), "--batch-size",
             str(args.batch_size), "--lr", str(args.lr), "--eval-samples", str(args.eval_samples),
             "--log-every", "1", "--log", curve, "--seed", str(getattr(args, "seed", 0))]
    if args.eval_every:
        train += ["--eval-every", str(args.eval_every)]
    if getattr(args, "update_on_workers", False):
        train += ["--update-on-kvstore", "0"]
    if system == "dist_sync_2bit":
        train += ["--two-bit-threshold", str(getattr(args, "two_bit_threshold", 0.5))]
    children = []
    if system.startswith("dgt"):
        addrs = ",".join(f"{bed.addresses[node]}:{port}" for node in servers)
        job = {"DGT_NUM_WORKERS": str(args.workers), "DGT_NUM_SERVERS": str(len(servers)),
               "DGT_SERVER_ADDRS": addrs, "DGT_JOB_ID": str(random.randrange(1, 2 ** 31)),
               "DGT_TIMEOUT_S": "600"}
        if system == "dgt-reliable":
            job["DGT_ENABLE"] = "0"
        job.update(args.dgt_env)
        if getattr(args, "trace", False):
            trace_dir = trace_dir_of(curve)
            os.makedirs(trace_dir, exist_ok=True)
            job["DGT_TRACE"] = os.path.join(trace_dir, "{role}{index}.jsonl")
        job.update(getattr(args, "variants", {}).get(system, {}))
        for index, node in enumerate(servers):
            children.append(_Child("server", index, bed.exec_prefix(node) + [
                sys.executable, "-m", "dgt.server"], dict(
                    base, **job, DGT_ROLE="server", DGT_SERVER_INDEX=str(index),
                    DGT_BIND_HOST="0.0.0.0"), out=log))
        for rank in range(args.workers):
            children.append(_Child("worker", rank, bed.exec_prefix(f"worker{rank}") + train + [
                "--kvstore", "dgt"], dict(base, **job, DGT_RANK=str(rank)), out=log))
        return children
    if system in HOROVOD_SYSTEMS:
        # horovodrun starts its processes over ssh; here each rank runs in its worker's
        # namespace, so we do what it does: a Gloo rendezvous server (in the server's
        # namespace, which Horovod does not otherwise use) and Horovod's variables per rank.
        children.append(_Child("rendezvous", 0, bed.exec_prefix("server") + [
            sys.executable, os.path.join(HERE, "horovod_rendezvous.py"), str(port),
            str(args.workers)], base, out=log))
        time.sleep(2.0)
        for rank in range(args.workers):
            node = f"worker{rank}"
            env = dict(base, HOROVOD_HOSTNAME=node, HOROVOD_RANK=str(rank),
                       HOROVOD_SIZE=str(args.workers), HOROVOD_LOCAL_RANK="0",
                       HOROVOD_LOCAL_SIZE="1", HOROVOD_CROSS_RANK=str(rank),
                       HOROVOD_CROSS_SIZE=str(args.workers),
                       HOROVOD_GLOO_RENDEZVOUS_ADDR=server_ip,
                       HOROVOD_GLOO_RENDEZVOUS_PORT=str(port), HOROVOD_CONTROLLER="gloo",
                       HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE="e0")
            children.append(_Child("worker", rank, bed.exec_prefix(node) + train + [
                "--kvstore", system], env, out=log))
        return children
    kvstore = system
    job = {"DMLC_PS_ROOT_URI": server_ip, "DMLC_PS_ROOT_PORT": str(port),
           "DMLC_NUM_SERVER": str(len(servers)), "DMLC_NUM_WORKER": str(args.workers),
           "DMLC_INTERFACE": "e0"}
    if system == "dist_sync_p3":
        job["DMLC_PS_VAN_TYPE"] = "p3"
    start = [sys.executable, "-c", "import mxnet"]
    children.append(_Child("scheduler", 0, bed.exec_prefix("server") + start, dict(
        base, **job, DMLC_ROLE="scheduler", DMLC_NODE_HOST=server_ip), out=log))
    time.sleep(1.0)
    for index, node in enumerate(servers):
        children.append(_Child("server", index, bed.exec_prefix(node) + start, dict(
            base, **job, DMLC_ROLE="server", DMLC_NODE_HOST=bed.addresses[node]), out=log))
    for rank in range(args.workers):
        node = f"worker{rank}"
        children.append(_Child("worker", rank, bed.exec_prefix(node) + train + [
            "--kvstore", kvstore], dict(base, **job, DMLC_ROLE="worker",
                                        DMLC_NODE_HOST=bed.addresses[node],
                                        DGT_RANK=str(rank)), out=log))
    return children


def trace_dir_of(curve: str) -> str:
    """Where a run's ``DGT_TRACE`` files go: beside its curve, ``<tag>-trace/``."""
    return os.path.splitext(curve)[0] + "-trace"


def write_timeline(curve: str, warmup: int = 3) -> Optional[str]:
    """Sum up a traced run's message timelines into ``<tag>-timeline.md``; its path, or None
    when the run left no trace."""
    trace_dir = trace_dir_of(curve)
    events = load_events([trace_dir]) if os.path.isdir(trace_dir) else []
    if not events:
        return None
    path = os.path.splitext(curve)[0] + "-timeline.md"
    with open(path, "w", encoding="utf-8") as out:
        out.write("\n".join(timeline_report(part_times(events), warmup)) + "\n")
    return path


def run_one(system: str, model: str, bed: Testbed, args, compute: Optional[float],
            round_index: int = 0) -> Row:
    rounds = getattr(args, "rounds", 1)
    row = Row(system, model, args.workers, args.rate,
              round=round_index + 1 if rounds > 1 else None)
    if system in HOROVOD_SYSTEMS:
        probe = subprocess.run([sys.executable, "-c", "import horovod.mxnet"],
                               capture_output=True)
        if probe.returncode != 0:
            row.status = "not installed (make horovod)"
            return row
    results = args.results_dir
    tag = f"{args.name}-{model}-{system}" + (f"-r{round_index + 1}" if rounds > 1 else "")
    curve = os.path.join(results, f"{tag}.jsonl")
    log_path = os.path.join(results, f"{tag}.log")
    row.curve_paths = [curve]
    # Allreduce has no server: its busiest links are the workers'.
    links = measured_links(system, args)
    before = {link: bed.link_bytes(link) for link in links}
    drops_before = {node: bed.drops_by_class(node) for node in job_nodes(args)}
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        children = job_processes(system, bed, args, model, curve, log)
        code = supervise(children, args.run_timeout)
    after = {link: bed.link_bytes(link) for link in links}
    drops_after = {node: bed.drops_by_class(node) for node in job_nodes(args)}
    where = f" round {round_index + 1}" if rounds > 1 else ""
    print(f"  {system:15s} {model:10s}{where} exit {code} in "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    if code != 0 or not os.path.exists(curve):
        row.status = f"failed (exit {code}, see {os.path.relpath(log_path, ROOT)})"
        return row
    measured = summarise_curve(curve, args.target_accuracy, warmup=3)
    if getattr(args, "trace", False) and system.startswith("dgt"):
        timeline = write_timeline(curve)
        if timeline:
            print(f"  wrote {os.path.relpath(timeline)}", flush=True)
    row.steps = measured["steps"]
    row.step_time_s = measured.get("step_time_s")
    row.step_time_p90_s = measured.get("step_time_p90_s")
    row.final_accuracy = measured["final_accuracy"]
    row.udp_loss_rate = measured["udp_loss_rate"]
    row.udp_late_rate = measured["udp_late_rate"]
    row.time_to_target_s = measured["time_to_target_s"]
    row.worker_cpu_ms = measured["worker_cpu_ms"]
    row.machine_cpu_busy = measured["machine_cpu_busy"]
    row.machine_cpu_steal = measured["machine_cpu_steal"]
    row.channel_bytes_per_step = measured["channel_bytes_per_step"]
    if system.startswith("dgt"):
        with open(log_path, encoding="utf-8", errors="replace") as log:
            own_cpu_s = own_cpu_from_log(log.read())
        if own_cpu_s and row.steps:
            row.server_cpu_ms = max(own_cpu_s.values()) * 1000 / row.steps
    if row.step_time_s:
        row.throughput_samples_s = args.workers * args.batch_size / row.step_time_s
    moved = {link: (after[link]["rx"] - before[link]["rx"], after[link]["tx"] - before[link]["tx"])
             for link in links}
    row.bytes_per_step = sum(rx + tx for rx, tx in moved.values()) / max(row.steps, 1)
    row.kernel_drops_per_step = [
        sum(drops_after[node][c] - drops_before[node][c] for node in drops_before)
        / max(row.steps, 1) for c in bed.job_classes()]
    busiest = max(max(rx, tx) for rx, tx in moved.values())
    bottleneck_s = busiest / max(row.steps, 1) * 8 / (args.rate * 1e6)
    row.compute_s = compute
    row.lower_bound_s = max(compute or 0.0, bottleneck_s)
    return row


# -- reporting --------------------------------------------------------------------------------
def fmt(value, digits=3):
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def write_csv(path: str, rows: List[Row], columns) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            values = {k: v for k, v in asdict(row).items() if k in columns}
            if row.channel_bytes_per_step:
                values["channel_bytes_per_step"] = ";".join(
                    f"{b:.0f}" for b in row.channel_bytes_per_step)
            if row.kernel_drops_per_step:
                values["kernel_drops_per_step"] = ";".join(
                    f"{d:.1f}" for d in row.kernel_drops_per_step)
            writer.writerow(values)


def write_reports(rows: List[Row], args, machine: str,
                  round_rows: Optional[List[Row]] = None) -> List[str]:
    """``<name>.csv`` (one row per system and model), ``<name>.md``, the plots, and with
    several rounds ``<name>-rounds.csv`` (one row per round as well)."""
    results = args.results_dir
    csv_path = os.path.join(results, f"{args.name}.csv")
    write_csv(csv_path, rows, COLUMNS)
    paths = [csv_path]
    if round_rows:
        paths.append(os.path.join(results, f"{args.name}-rounds.csv"))
        write_csv(paths[-1], round_rows, ("round",) + COLUMNS)
    md_path = os.path.join(results, f"{args.name}.md")
    with open(md_path, "w") as f:
        f.write(markdown(rows, args, machine, round_rows))
    paths.append(md_path)
    paths += plot(rows, args)
    return paths


def markdown(rows: List[Row], args, machine: str,
             round_rows: Optional[List[Row]] = None) -> str:
    servers = getattr(args, "servers", 1)
    where = " on the workers' nodes" if getattr(args, "colocate", False) else ""
    if getattr(args, "update_on_workers", False):
        where += ", optimizer on the workers (update_on_kvstore=0)"
    lines = [f"Run `{args.name}`: {args.workers} workers + {servers} server"
             f"{'s' if servers > 1 else ''}{where}, links {args.rate:g} Mbit/s, "
             f"batch {args.batch_size}/worker, {args.steps} steps, Fashion-MNIST"
             f"{', seed %d' % args.seed if getattr(args, 'seed', 0) else ''}. {machine}"]
    if getattr(args, "target_accuracy", 0.0):
        # A time to target means nothing without the target and how accuracy was read.
        samples = getattr(args, "eval_samples", 0)
        lines.append(f"Time to target: training time (evaluation excluded) until the test "
                     f"accuracy first reaches {args.target_accuracy:g}, read every "
                     f"{getattr(args, 'eval_every', 0)} steps on "
                     f"{'the whole test set' if not samples else '%d test images' % samples}.")

    def settings(env):
        return " ".join(f"{var}={value}" for var, value in env.items())

    if getattr(args, "cross_traffic", 0.0):
        lines.append(f"Background load: {args.cross_traffic:g} Mbit/s of open-loop UDP into and "
                     f"out of every node of the job, at IP precedence "
                     f"{getattr(args, 'cross_precedence', 0)}, for every system; its bytes are "
                     "not in MB/step nor in the lower bound.")
    # Always stated: runs before 2026-12-04 had 100-frame low queues, which slowed dist_sync.
    low_queue = getattr(args, "low_queue_frames", QUEUE_FRAMES)
    lines.append(f"Queues: {QUEUE_FRAMES} full frames in every class." if low_queue == QUEUE_FRAMES
                 else f"Queues: {QUEUE_FRAMES} full frames in the top class, {low_queue} in "
                 "every class below it (where unmarked traffic lands too).")
    if getattr(args, "dgt_env", None):
        lines.append(f"Every dgt run: {settings(args.dgt_env)}.")
    for name, env in getattr(args, "variants", {}).items():
        lines.append(f"`{name}`: dgt with {settings(env)}.")
    if any(r.system == "dist_sync_2bit" for r in rows):
        lines.append(f"`dist_sync_2bit`: threshold {getattr(args, 'two_bit_threshold', 0.5):g}.")
    lines += ["", "| model | system | step s (median) | p90 | vs dist_sync | samples/s | MB/step "
              "(server links) | dgt's count: MB/step worker 0 pushed per channel (TCP; UDP 1..C) "
              "| UDP loss (of it late) | time to target s | final acc | lower bound s | "
              "dgt CPU ms/step: worker, server (% of step) | machine CPU: busy, steal | "
              "kernel drops/step per class (top: dgt's TCP; ..; lowest: its last UDP channel "
              "and all unmarked traffic) | status |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {r.model: r.step_time_s for r in rows if r.system == "dist_sync"}
    for r in rows:
        ratio = (r.step_time_s / base[r.model]) if r.step_time_s and base.get(r.model) else None
        lines.append(
            f"| {r.model} | {r.system} | {fmt(r.step_time_s)} | {fmt(r.step_time_p90_s)} | "
            f"{fmt(ratio, 2)} | {fmt(r.throughput_samples_s, 1)} | "
            f"{fmt(r.bytes_per_step / 1e6 if r.bytes_per_step else None, 1)} | "
            f"{channel_cell(r)} | "
            f"{loss_cell(r)} | {fmt(r.time_to_target_s, 1)} | "
            f"{fmt(r.final_accuracy)} | {fmt(r.lower_bound_s)} | {cpu_cell(r)} | "
            f"{machine_cell(r)} | {drops_cell(r)} | {r.status} |")
    if round_rows:
        lines += rounds_table(round_rows, args)
    return "\n".join(lines) + "\n"


def loss_cell(row: Row) -> str:
    """``42.0% (3.1% late)``: lost datagrams, and how many of them came after their step."""
    if row.udp_loss_rate is None:
        return "-"
    cell = f"{fmt(row.udp_loss_rate * 100, 1)}%"
    return cell + (f" ({fmt(row.udp_late_rate * 100, 1)}% late)"
                   if row.udp_late_rate is not None else "")


def rounds_table(round_rows: List[Row], args) -> List[str]:
    """Every round's own figures, with ratios to ``dist_sync`` of the same round (the
    figures least moved by the machine's drift) and their medians."""
    rounds = max(r.round or 1 for r in round_rows)
    systems = getattr(args, "systems", None) or list(dict.fromkeys(r.system for r in round_rows))
    lines = ["", f"Each row above is the median of {rounds} rounds (final accuracy: their mean; "
             "time to target: a round that missed it counts as later than any that reached "
             "it). The rounds ran the systems forwards, then backwards. Every round:", "",
             "| model | system | round | position | step s | vs dist_sync, same round | "
             "time to target s | vs dist_sync, same round | final acc | status |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    step_ratio = same_round_ratios(round_rows, "step_time_s", "dist_sync")
    target_ratio = same_round_ratios(round_rows, "time_to_target_s", "dist_sync")
    for r in round_rows:
        order = round_order(systems, (r.round or 1) - 1)
        position = order.index(r.system) + 1 if r.system in order else None
        ident = (r.model, r.system, r.round)
        lines.append(f"| {r.model} | {r.system} | {fmt(r.round)} | {fmt(position)} | "
                     f"{fmt(r.step_time_s)} | {fmt(step_ratio.get(ident), 2)} | "
                     f"{fmt(r.time_to_target_s, 1)} | {fmt(target_ratio.get(ident), 2)} | "
                     f"{fmt(r.final_accuracy)} | {r.status} |")
    lines.append("")
    for model in dict.fromkeys(r.model for r in round_rows):
        for system in systems:
            if system == "dist_sync":
                continue
            steps = [v for (m, s, _), v in step_ratio.items() if (m, s) == (model, system)]
            targets = [v for (m, s, _), v in target_ratio.items() if (m, s) == (model, system)]
            if not steps:
                continue
            on_target = (f"{statistics.median(targets):.2f} on the time to target (the "
                         f"{len(targets)} of {len(steps)} rounds where both reached it)"
                         if targets else "none on the time to target (no round where both "
                         "reached it)")
            lines.append(f"- {model}, {system}: the median of the same-round ratios to "
                         f"`dist_sync` is {statistics.median(steps):.2f} on the step, "
                         f"{on_target}.")
    return lines


def channel_cell(row: Row) -> str:
    if not row.channel_bytes_per_step:
        return "-"
    return "; ".join(f"{b / 1e6:.1f}" for b in row.channel_bytes_per_step)


def drops_cell(row: Row) -> str:
    if not row.kernel_drops_per_step:
        return "-"
    return "; ".join(f"{d:.1f}" for d in row.kernel_drops_per_step)


def cpu_cell(row: Row) -> str:
    """dgt's own CPU per step on a worker and on a server, with their shares of the step."""
    parts = []
    for cpu_ms in (row.worker_cpu_ms, row.server_cpu_ms):
        if cpu_ms is None:
            parts.append("-")
        elif row.step_time_s:
            parts.append(f"{cpu_ms:.1f} ({cpu_ms / 10 / row.step_time_s:.1f} %)")
        else:
            parts.append(f"{cpu_ms:.1f}")
    return "-" if parts == ["-", "-"] else ", ".join(parts)


def machine_cell(row: Row) -> str:
    """The machine's busy and stolen shares of its CPU time over the training steps."""
    if row.machine_cpu_busy is None:
        return "-"
    return f"{row.machine_cpu_busy * 100:.0f} %, {(row.machine_cpu_steal or 0.0) * 100:.0f} %"


def plot(rows: List[Row], args) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = args.results_dir
    written = []

    def save(fig, suffix):
        fig.tight_layout()
        path = os.path.join(results, f"{args.name}-{suffix}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    models = sorted({r.model for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r.model == model and r.step_time_s]
        ax.bar([r.system for r in mine], [r.step_time_s for r in mine], color="#4c72b0")
        ax.scatter([r.system for r in mine], [r.lower_bound_s for r in mine], color="black",
                   marker="_", s=400, label="lower bound", zorder=3)
        ax.set_title(f"{model}: step time")
        ax.set_ylabel("seconds")
        ax.tick_params(axis="x", rotation=30)
        ax.legend()
    save(fig, "step-time")
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for r in rows:
            if r.model != model:
                continue
            curves = r.curve_paths or [
                os.path.join(results, f"{args.name}-{model}-{r.system}.jsonl")]
            for number, curve in enumerate(curves, 1):
                if not os.path.exists(curve):
                    continue
                points = summarise_curve(curve, 0.0, 3)["accuracy_curve"]
                if points:
                    ax.plot(*zip(*points), marker="o",
                            label=r.system if len(curves) == 1 else f"{r.system} r{number}")
        ax.set_title(f"{model}: test accuracy vs training time")
        ax.set_xlabel("seconds (evaluation excluded)")
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    save(fig, "accuracy")
    fig, (ax, by_channel) = plt.subplots(1, 2, figsize=(12, 4))
    labels = [f"{r.model}\n{r.system}" for r in rows if r.bytes_per_step]
    ax.bar(labels, [r.bytes_per_step / 1e6 for r in rows if r.bytes_per_step], color="#55a868")
    ax.set_ylabel("MB per step through the server links")
    ax.set_title("kernel interface counters (both directions)")
    ax.tick_params(axis="x", rotation=45, labelsize=7)
    dgt_rows = [r for r in rows if r.channel_bytes_per_step]
    channels = max((len(r.channel_bytes_per_step) for r in dgt_rows), default=0)
    bottoms = [0.0] * len(dgt_rows)
    for channel in range(channels):
        heights = [(r.channel_bytes_per_step[channel] if channel < len(r.channel_bytes_per_step)
                    else 0.0) / 1e6 for r in dgt_rows]
        by_channel.bar([f"{r.model}\n{r.system}" for r in dgt_rows], heights, bottom=bottoms,
                       label="TCP" if channel == 0 else f"UDP {channel}")
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    by_channel.set_ylabel("MB per step")
    by_channel.set_title("dgt's count: worker 0's pushes per channel")
    by_channel.tick_params(axis="x", rotation=45, labelsize=7)
    if dgt_rows:
        by_channel.legend()
    save(fig, "bytes")
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="AlexNet only, 12 steps per system, a small evaluation")
    parser.add_argument("--models", default="alexnet,vgg11,googlenet")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--servers", type=int, default=1,
                        help="parameter servers, each on its own link (dgt and MXNet)")
    parser.add_argument("--colocate", action="store_true",
                        help="run server i on worker i's node instead of its own (needs "
                             "--servers <= --workers)")
    parser.add_argument("--update-on-workers", action="store_true",
                        help="run the optimizer on every worker (update_on_kvstore=0) for "
                             "the dgt and dist_sync systems too, as 2-bit and Horovod always "
                             "do; the servers then only sum, and dgt's replies carry only the "
                             "blocks that some worker's gradient reached")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of data, initialisation and partition for every system (0)")
    parser.add_argument("--two-bit-threshold", type=float, default=0.5,
                        help="dist_sync_2bit's threshold (MXNet's default 0.5)")
    parser.add_argument("--rate", type=float, default=1000.0, help="link rate, Mbit/s")
    parser.add_argument("--cross-traffic", type=float, default=0.0, metavar="MBIT",
                        help="background load: an open-loop UDP flow of MBIT Mbit/s into and "
                             "out of every node of the job, for every system alike (0: none)")
    parser.add_argument("--cross-precedence", type=int, default=0,
                        help="IP precedence of the background load, 0 (best effort, the "
                             "class of MXNet's and Horovod's traffic) .. 3 (dgt's reliable "
                             "channel's)")
    parser.add_argument("--low-queue-frames", type=int, default=QUEUE_FRAMES,
                        help="queue of every class below the top one, in full frames "
                             f"(default {QUEUE_FRAMES}, the top class's, so that every system "
                             "meets the same queues); shorter emulates a shallow-buffered "
                             "switch, and shortens the queue of MXNet's and Horovod's "
                             "unmarked TCP too, which slows them (RESULTS.md, 2026-12-04)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--eval-samples", type=int, default=2000)
    parser.add_argument("--target-accuracy", type=float, default=0.0,
                        help="report the training time to reach this test accuracy")
    parser.add_argument("--run-timeout", type=float, default=1800)
    parser.add_argument("--dgt", action="append", default=[], metavar="VAR=VALUE",
                        help="extra DGT_* setting for the dgt runs (repeatable)")
    parser.add_argument("--variant", action="append", default=[],
                        metavar="NAME:DGT_X=VALUE,...",
                        help="also run dgt with these settings, as system dgt-NAME "
                             "(repeatable)")
    parser.add_argument("--trace", action="store_true",
                        help="dgt runs write DGT_TRACE message timelines (<tag>-trace/) and "
                             "their summary, <tag>-timeline.md (see benchmarks/timeline.py)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the systems this many times, forwards then backwards "
                             "(A B C, C B A, ...), so that the machine's drift over the run "
                             "falls on every system alike; each row is then the median of "
                             "its rounds, with every round listed below it (1)")
    parser.add_argument("--name", default="", help="results file name (default: a timestamp)")
    parser.add_argument("--results-dir", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.steps, args.eval_samples = "alexnet", 12, 500
    args.name = args.name or time.strftime("compare-%Y%m%d-%H%M%S")
    if args.colocate and not 1 <= args.servers <= args.workers:
        parser.error(f"--colocate needs 1 <= --servers <= --workers (got --servers "
                     f"{args.servers}, --workers {args.workers})")
    if not 0 <= args.cross_traffic <= args.rate:
        parser.error(f"--cross-traffic {args.cross_traffic:g} is out of range: allowed "
                     f"0..{args.rate:g} (--rate)")
    if not 0 <= args.cross_precedence <= 3:
        parser.error(f"--cross-precedence {args.cross_precedence} is out of range: allowed "
                     "0..3 (the testbed's precedence levels)")
    if not 1 <= args.low_queue_frames <= 100_000:
        parser.error(f"--low-queue-frames {args.low_queue_frames} is out of range: allowed "
                     "1..100000")
    if not 1 <= args.rounds <= 20:
        parser.error(f"--rounds {args.rounds} is out of range: allowed 1..20")
    if not args.two_bit_threshold > 0:  # refused here, not by the 2-bit job after set-up
        parser.error(f"--two-bit-threshold {args.two_bit_threshold:g} is out of range: "
                     "allowed > 0")
    args.dgt_env = dict(item.split("=", 1) for item in args.dgt)
    try:
        args.systems, args.variants = resolve_systems(args.systems, args.variant)
    except ValueError as error:
        parser.error(str(error))
    reason = available()
    if reason:
        print(f"benchmark skipped: the testbed {reason}")
        return 0
    # Checked before the testbed is built: otherwise every run fails minutes later, one by one.
    problem = examples_data.fashion_mnist_missing()
    if problem:
        print(f"benchmark refused: {problem}", file=sys.stderr)
        return 2
    os.makedirs(args.results_dir, exist_ok=True)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    machine = (f"Machine: {os.cpu_count()} cores, "
               f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, "
               f"Python {sys.version.split()[0]}.")
    rows, round_rows = [], []
    # The "server" node stays even when colocated: MXNet's scheduler and Horovod's
    # rendezvous run there (control traffic only).
    nodes = server_nodes(1 if args.colocate else args.servers) + \
        [f"worker{r}" for r in range(args.workers)]
    with Testbed(nodes, rate_mbit=args.rate, cross_precedence=args.cross_precedence,
                 low_queue_frames=args.low_queue_frames) as bed:
        if args.cross_traffic:
            bed.start_cross_traffic(job_nodes(args), args.cross_traffic)
        for model in args.models.split(","):
            compute = measure_compute(model, args.batch_size)
            print(f"{model}: compute {fmt(compute)} s/step (one process, no communication)",
                  flush=True)
            mine = [run_one(system, model, bed, args, compute, round_index)
                    for round_index in range(args.rounds)
                    for system in round_order(args.systems, round_index)]
            if args.rounds == 1:
                rows += mine
                continue
            round_rows += mine
            rows += fold_rounds(mine, args)
    for path in write_reports(rows, args, machine, round_rows):
        print("wrote", os.path.relpath(path, ROOT))
    print(markdown(rows, args, machine, round_rows))
    return 0


def fold_rounds(round_rows: List[Row], args) -> List[Row]:
    """One row per system (in the listed order) from its rounds' rows."""
    folded = []
    for system in args.systems:
        mine = [r for r in round_rows if r.system == system]
        row = combine_rounds(mine, lambda step: args.workers * args.batch_size / step)
        row.curve_paths = [p for r in mine for p in (r.curve_paths or [])]
        folded.append(row)
    return folded


if __name__ == "__main__":
    sys.exit(main())
