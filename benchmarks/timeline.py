"""Where a dgt step waits: the message timelines of a job's ``DGT_TRACE`` files, summed up.

    DGT_TRACE=/tmp/t/{role}{index}.jsonl dgt-launch ...      # or benchmarks.compare --trace
    python -m benchmarks.timeline /tmp/t/*.jsonl [--warmup 3]

Every part of every key is pushed once per training step; each push names its worker's
training step.  For each (key, part, step) the files give when each worker began its push (the
gradient ready, handed to dgt), when the server merged it, when the step closed and the
replies were queued, and when each worker got its reply.  Printed, as medians over the
steps after ``--warmup``:

* per key (its parts together), in push order: the round trip (push begun -> reply in, the
  slowest worker's), split into the way up (push -> merged at the server, the last worker's),
  the wait at the server (last push merged -> replies queued: datagrams, grace, optimizer)
  and the way down (queued -> reply in, the last worker's);
* per step: how far apart the workers' first pushes were, the span from the first push to the
  last reply, and the gap from the last reply of a step to the first push of the next, when
  no dgt message is in flight (the training's own compute between two exchanges).

Times need one clock: the files of one machine, or hosts kept in sync.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

__all__ = ["PartTimes", "load_events", "part_times", "key_summary", "step_summary", "main"]


@dataclass
class PartTimes:
    """The events of one (key, part, step), seconds on the wall clock."""

    pushed: Dict[int, float] = field(default_factory=dict)  # rank -> dgt began its push
    arrived: Dict[int, float] = field(default_factory=dict)  # rank -> merged at the server
    closed: Optional[float] = None
    queued: Optional[float] = None  # replies queued for the workers
    received: Dict[int, float] = field(default_factory=dict)  # rank -> reply in

    def complete(self, workers: int) -> bool:
        return (len(self.pushed) == workers and len(self.arrived) == workers
                and self.queued is not None and len(self.received) == workers)


def load_events(paths: Iterable[str]) -> List[dict]:
    """Every event of the given trace files (a directory stands for its ``*.jsonl``)."""
    files: List[str] = []
    for path in paths:
        files += sorted(glob.glob(os.path.join(path, "*.jsonl"))) if os.path.isdir(path) \
            else [path]
    events = []
    for name in files:
        with open(name, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{name}:{number}: not a trace line ({exc})") from None
    return events


def part_times(events: Iterable[dict]) -> Dict[Tuple[int, int, int], PartTimes]:
    """(key, part, training step) -> its :class:`PartTimes`.

    Messages count a part's own pushes (``step``); a push also says which training step of
    its worker it belongs to (``round``), and that is the step the part is filed under, so
    that keys whose counts started late (fused buckets) line up with the others.  Without a
    round (-1) the part's own count stands."""
    by_message: Dict[Tuple[int, int, int], PartTimes] = defaultdict(PartTimes)
    rounds: Dict[Tuple[int, int, int], int] = {}
    for event in events:
        ident = (event["key"], event["part"], event["step"])
        times = by_message[ident]
        kind, role, rank, t = event["event"], event["role"], event["rank"], event["t"]
        if role == "worker" and kind == "push":
            times.pushed[rank] = t
            if event.get("round", -1) >= 0:
                rounds[ident] = min(rounds.get(ident, event["round"]), event["round"])
        elif role == "worker" and kind == "reply":
            times.received[rank] = t
        elif role == "server" and kind == "arrive":
            times.arrived[rank] = t
        elif role == "server" and kind == "close":
            times.closed = t
        elif role == "server" and kind == "reply":
            times.queued = t
    return {(key, part, rounds.get((key, part, step), step)): times
            for (key, part, step), times in by_message.items()}


def _workers(parts: Dict[Tuple[int, int, int], PartTimes]) -> int:
    return max((len(times.pushed) for times in parts.values()), default=0)


def _median_ms(values: List[float]) -> Optional[float]:
    return statistics.median(values) * 1000.0 if values else None


def key_summary(parts: Dict[Tuple[int, int, int], PartTimes], warmup: int = 0) -> List[dict]:
    """One row per key, in the order of its median push time within a step."""
    workers = _workers(parts)
    first_push = _first_push_per_step(parts)
    by_key: Dict[int, dict] = {}
    for (key, part, step), times in parts.items():
        if step < warmup or not times.complete(workers):
            continue
        row = by_key.setdefault(key, {"key": key, "parts": set(), "offset": [], "trip": [],
                                      "up": [], "server": [], "down": []})
        row["parts"].add(part)
        pushed_last = max(times.pushed.values())
        arrived_last = max(times.arrived.values())
        received_last = max(times.received.values())
        row["offset"].append(min(times.pushed.values()) - first_push[step])
        row["trip"].append(received_last - pushed_last)
        row["up"].append(arrived_last - pushed_last)
        row["server"].append(times.queued - arrived_last)
        row["down"].append(received_last - times.queued)
    rows = []
    for row in by_key.values():
        rows.append({"key": row["key"], "parts": len(row["parts"]),
                     "pushed_after_ms": _median_ms(row["offset"]),
                     "round_trip_ms": _median_ms(row["trip"]), "up_ms": _median_ms(row["up"]),
                     "at_server_ms": _median_ms(row["server"]),
                     "down_ms": _median_ms(row["down"])})
    return sorted(rows, key=lambda r: r["pushed_after_ms"])


def _first_push_per_step(parts) -> Dict[int, float]:
    first: Dict[int, float] = {}
    for (_, _, step), times in parts.items():
        if times.pushed:
            first[step] = min(first.get(step, float("inf")), min(times.pushed.values()))
    return first


def step_summary(parts: Dict[Tuple[int, int, int], PartTimes], warmup: int = 0) -> dict:
    """Medians over the steps after ``warmup`` (ms): ``lag`` between the workers' first
    pushes, ``span`` from the first push to the last reply, ``gap`` from a step's last reply
    to the next step's first push; and ``steps``, how many steps had every event."""
    workers = _workers(parts)
    per_step: Dict[int, dict] = {}
    incomplete = set()
    for (_, _, step), times in parts.items():
        if not times.complete(workers):
            incomplete.add(step)
            continue
        s = per_step.setdefault(step, {"first": {}, "last_reply": 0.0})
        for rank, t in times.pushed.items():
            s["first"][rank] = min(s["first"].get(rank, float("inf")), t)
        s["last_reply"] = max(s["last_reply"], max(times.received.values()))
    steps = sorted(step for step in per_step if step >= warmup and step not in incomplete)
    lag, span, gap = [], [], []
    for step in steps:
        firsts = per_step[step]["first"]
        lag.append(max(firsts.values()) - min(firsts.values()))
        span.append(per_step[step]["last_reply"] - min(firsts.values()))
        after = per_step.get(step + 1)
        if after is not None and step + 1 not in incomplete:
            gap.append(min(after["first"].values()) - per_step[step]["last_reply"])
    return {"steps": len(steps), "lag_ms": _median_ms(lag), "span_ms": _median_ms(span),
            "gap_ms": _median_ms(gap)}


def _cell(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def report(parts, warmup: int) -> List[str]:
    """The two tables as Markdown lines."""
    summary = step_summary(parts, warmup)
    lines = [f"{summary['steps']} steps after {warmup} warm-up steps, medians (ms):", "",
             "| workers' first pushes apart | first push to last reply | last reply to next "
             "step's first push |", "|---|---|---|",
             f"| {_cell(summary['lag_ms'])} | {_cell(summary['span_ms'])} | "
             f"{_cell(summary['gap_ms'])} |", "",
             "| key | parts | pushed after the step's first push | round trip | up (push to "
             "merged) | at the server | down (queued to reply in) |",
             "|---|---|---|---|---|---|---|"]
    for row in key_summary(parts, warmup):
        lines.append(f"| {row['key']} | {row['parts']} | {_cell(row['pushed_after_ms'])} | "
                     f"{_cell(row['round_trip_ms'])} | {_cell(row['up_ms'])} | "
                     f"{_cell(row['at_server_ms'])} | {_cell(row['down_ms'])} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("paths", nargs="+", help="trace files, or directories of *.jsonl")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out at the start")
    args = parser.parse_args(argv)
    try:
        events = load_events(args.paths)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"timeline: {exc}\n")
        return 2
    if not events:
        sys.stderr.write("timeline: no events in the given files (was DGT_TRACE set?)\n")
        return 2
    sys.stdout.write("\n".join(report(part_times(events), args.warmup)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
