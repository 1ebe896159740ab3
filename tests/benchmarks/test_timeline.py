"""The timeline summary of DGT_TRACE files, against hand-computed medians."""
import json

import pytest

from benchmarks.timeline import key_summary, load_events, main, part_times, step_summary


def ev(t, role, index, event, key, part, step, rank):
    return {"t": t, "role": role, "index": index, "event": event, "key": key, "part": part,
            "step": step, "rank": rank}


def one_part(key, part, step, push, arrive, queued, received):
    """The events of one (key, part, step) for two workers: push/arrive/received by rank."""
    events = []
    for rank in (0, 1):
        events.append(ev(push[rank], "worker", rank, "push", key, part, step, rank))
        events.append(ev(arrive[rank], "server", 0, "arrive", key, part, step, rank))
        events.append(ev(received[rank], "worker", rank, "reply", key, part, step, rank))
    events.append(ev(queued - 0.001, "server", 0, "close", key, part, step, -1))
    events.append(ev(queued, "server", 0, "reply", key, part, step, -1))
    return events


def two_keys_three_steps():
    """Step s starts at 1.0 * s; key 7 first, key 3 after it; rank 1 pushes 0.05 s late."""
    events = []
    for step in range(3):
        t0 = float(step)
        events += one_part(7, 0, step, push=[t0, t0 + 0.05], arrive=[t0 + 0.02, t0 + 0.10],
                           queued=t0 + 0.11, received=[t0 + 0.13, t0 + 0.15])
        # key 3's way down is slower by 0.01 s a step: medians take the middle step
        events += one_part(3, 0, step, push=[t0 + 0.2, t0 + 0.25],
                           arrive=[t0 + 0.3, t0 + 0.3], queued=t0 + 0.32,
                           received=[t0 + 0.4 + 0.01 * step, t0 + 0.38])
    return events


def test_key_rows_split_each_round_trip_into_up_server_and_down():
    rows = key_summary(part_times(two_keys_three_steps()))
    assert [r["key"] for r in rows] == [7, 3]  # push order within the step
    first, second = rows
    assert first["parts"] == 1
    assert first["pushed_after_ms"] == pytest.approx(0.0)
    assert first["up_ms"] == pytest.approx(50.0)  # last arrival 0.10 - last push 0.05
    assert first["at_server_ms"] == pytest.approx(10.0)
    assert first["down_ms"] == pytest.approx(40.0)  # last reply 0.15 - queued 0.11
    assert first["round_trip_ms"] == pytest.approx(100.0)
    assert second["pushed_after_ms"] == pytest.approx(200.0)
    assert second["down_ms"] == pytest.approx(90.0)  # 0.41 - 0.32, the middle step
    assert second["round_trip_ms"] == pytest.approx(160.0)  # 0.41 - 0.25


def test_step_rows_give_lag_span_and_the_gap_before_the_next_step():
    summary = step_summary(part_times(two_keys_three_steps()))
    assert summary["steps"] == 3
    assert summary["lag_ms"] == pytest.approx(50.0)
    assert summary["span_ms"] == pytest.approx(410.0)  # 0.41 in the middle step
    # the next step's first push (s + 1.0) minus this step's last reply (s + 0.40 / 0.41)
    assert summary["gap_ms"] == pytest.approx((0.60 + 0.59) / 2 * 1000)


def test_warm_up_and_incomplete_steps_are_left_out():
    events = two_keys_three_steps()
    # step 2 loses worker 1's reply of key 3 (the job ended): not a complete step
    events = [e for e in events if not (e["step"] == 2 and e["key"] == 3 and e["event"] == "reply"
                                        and e["rank"] == 1)]
    summary = step_summary(part_times(events), warmup=1)
    assert summary["steps"] == 1  # step 0 is warm-up, step 2 is incomplete
    assert summary["span_ms"] == pytest.approx(410.0)
    assert summary["gap_ms"] is None  # step 2 was incomplete: no gap after step 1
    rows = {r["key"]: r for r in key_summary(part_times(events), warmup=1)}
    assert rows[3]["down_ms"] == pytest.approx(90.0)  # step 1 only: step 2 lacks a reply
    assert rows[7]["down_ms"] == pytest.approx(40.0)  # steps 1 and 2


def test_cli_reads_a_directory_and_refuses_bad_lines(tmp_path, capsys):
    trace = tmp_path / "trace"
    trace.mkdir()
    events = two_keys_three_steps()
    by_file = {}
    for e in events:
        by_file.setdefault(f"{e['role']}{e['index']}.jsonl", []).append(e)
    for name, lines in by_file.items():
        (trace / name).write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert len(load_events([str(trace)])) == len(events)
    assert main([str(trace), "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "| 7 | 1 | 0.0 | 100.0 | 50.0 | 10.0 | 40.0 |" in out
    assert "| 50.0 | 410.0 | 595.0 |" in out
    (trace / "bad.jsonl").write_text("{not json\n")
    assert main([str(trace)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty)]) == 2
    assert "DGT_TRACE" in capsys.readouterr().err


def test_parts_are_filed_under_their_workers_training_step_not_their_own_count():
    """A fused bucket's own count starts a round late: its push number s belongs to training
    step s + 1, which the pushes' ``round`` says; without a round the count stands."""
    events = two_keys_three_steps()
    for e in events:
        if e["key"] == 3:
            e["step"] -= 1  # key 3 counts from -1 ... i.e. one behind key 7
        if e["event"] == "push":
            e["round"] = int(e["t"])  # steps start at 0.0, 1.0, 2.0
    parts = part_times(events)
    assert {s for (k, _, s) in parts if k == 3} == {0, 1, 2}
    summary = step_summary(parts)
    assert summary["steps"] == 3 and summary["span_ms"] == pytest.approx(410.0)
    for e in events:
        e.pop("round", None)
    assert {s for (k, _, s) in part_times(events) if k == 3} == {-1, 0, 1}
