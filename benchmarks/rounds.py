"""Several rounds of one comparison, in alternating order, folded into one row per system.

A shared machine's speed drifts within an hour (this project's runs saw AlexNet's compute go
from 0.15 to 0.40 s/step over a day).  Systems run one after the other, so whichever runs
last meets a different machine from whichever ran first.  Running the list forwards, then
backwards (A B C, C B A, A B C, ...) puts every system at every position in turn: a drift
that is linear in time then costs each system the same on the sum over an even number of
rounds.  The pure part lives here; ``compare.py`` runs the jobs.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import List, Optional, Sequence

__all__ = ["round_order", "median_or_none", "median_reached", "combine_rounds",
           "same_round_ratios"]


def round_order(systems: Sequence[str], round_index: int) -> List[str]:
    """The order of ``systems`` in round ``round_index`` (0-based): as listed in even
    rounds, reversed in odd ones."""
    if round_index < 0:
        raise ValueError(f"round_index must be >= 0 (got {round_index})")
    return list(systems) if round_index % 2 == 0 else list(reversed(systems))


def median_or_none(values: Sequence[Optional[float]]) -> Optional[float]:
    """The median of the values that were measured (None where none was)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def median_reached(times: Sequence[Optional[float]]) -> Optional[float]:
    """The median time to target over rounds, a round that never reached it counting as
    later than any that did; None when the median round did not reach it.  (Dropping the
    misses instead would make a system that reaches the target in one round of three look
    as good as one that always does.)"""
    if not times:
        return None
    median = statistics.median(math.inf if t is None else t for t in times)
    return None if math.isinf(median) else median


def combine_rounds(rows: Sequence, throughput_of=None):
    """One row for one system and model from its rounds' rows (a dataclass with the fields of
    ``compare.Row``): medians of the step time, its p90, bytes, loss, bound, dgt's CPU and the
    machine's CPU shares; the time to target by :func:`median_reached`; the mean final
    accuracy; the rounds that failed named in ``status``.  ``throughput_of(step_time_s)``
    recomputes the throughput."""
    if not rows:
        raise ValueError("combine_rounds needs at least one round's row")
    ok = [r for r in rows if r.status == "ok"]
    failed = [f"round {i + 1}: {r.status}" for i, r in enumerate(rows) if r.status != "ok"]
    first = rows[0]
    if not ok:
        return dataclasses.replace(first, rounds=len(rows), round=None, status="; ".join(failed))

    def median_of(field):
        return median_or_none([getattr(r, field) for r in ok])

    def median_per_item(field):
        """Item by item, the median of a per-channel or per-class list over the rounds."""
        lists = [getattr(r, field) for r in ok if getattr(r, field)]
        if lists and len({len(x) for x in lists}) == 1:
            return [statistics.median(items) for items in zip(*lists)]
        return getattr(ok[0], field)

    step = median_of("step_time_s")
    accuracies = [r.final_accuracy for r in ok if r.final_accuracy is not None]

    return dataclasses.replace(
        ok[0],
        steps=int(statistics.median(r.steps for r in ok)),
        step_time_s=step,
        step_time_p90_s=median_of("step_time_p90_s"),
        throughput_samples_s=throughput_of(step) if throughput_of and step else
        median_of("throughput_samples_s"),
        bytes_per_step=median_of("bytes_per_step"),
        udp_loss_rate=median_of("udp_loss_rate"),
        udp_late_rate=median_of("udp_late_rate"),
        # A failed round has no time; it counts as a miss, as a round that never got there.
        time_to_target_s=median_reached([r.time_to_target_s for r in ok] + [None] * len(failed)),
        final_accuracy=statistics.fmean(accuracies) if accuracies else None,
        compute_s=median_of("compute_s"),
        lower_bound_s=median_of("lower_bound_s"),
        worker_cpu_ms=median_of("worker_cpu_ms"),
        server_cpu_ms=median_of("server_cpu_ms"),
        machine_cpu_busy=median_of("machine_cpu_busy"),
        machine_cpu_steal=median_of("machine_cpu_steal"),
        kernel_drops_per_step=median_per_item("kernel_drops_per_step"),
        channel_bytes_per_step=median_per_item("channel_bytes_per_step"),
        rounds=len(rows),
        round=None,
        status="ok" if not failed else "; ".join(failed))


def same_round_ratios(rows: Sequence, field: str, baseline: str) -> dict:
    """``{(model, system, round): row.field / baseline's field in the same model and round}``
    for the per-round rows (each with ``round``), where both were measured."""
    base = {(r.model, r.round): getattr(r, field) for r in rows if r.system == baseline}
    ratios = {}
    for r in rows:
        value, reference = getattr(r, field), base.get((r.model, r.round))
        if value is not None and reference:
            ratios[(r.model, r.system, r.round)] = value / reference
    return ratios
