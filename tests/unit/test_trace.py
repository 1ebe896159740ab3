"""DGT_TRACE's writer: one JSON line per event, nothing at all when off."""
import json

from dgt.trace import NO_TRACE, open_tracer


def test_an_empty_template_traces_nothing():
    tracer = open_tracer("", "worker", 0)
    assert tracer is NO_TRACE and not tracer.enabled
    tracer.record("push", 1, 0, 0, 0)
    tracer.close()


def test_events_go_to_the_file_of_their_role_and_index(tmp_path):
    tracer = open_tracer(str(tmp_path / "{role}-{index}.jsonl"), "server", 3)
    assert tracer.enabled
    tracer.record("arrive", 7, 2, 5, 1)
    tracer.record("push", 7, 2, 5, 1, t=12.5, handed=12.75)
    tracer.close()
    tracer.record("reply", 7, 2, 5, 1)  # after close: dropped, not an error
    lines = [json.loads(line) for line in (tmp_path / "server-3.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and tracer.events == 2
    first, second = lines
    assert {k: first[k] for k in ("role", "index", "event", "key", "part", "step", "rank")} == \
        {"role": "server", "index": 3, "event": "arrive", "key": 7, "part": 2, "step": 5,
         "rank": 1}
    assert first["t"] > 0 and "handed" not in first
    assert second["t"] == 12.5 and second["handed"] == 12.75
