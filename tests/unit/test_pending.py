"""Pending results: parts, errors, callbacks, and a call made of several calls."""
import numpy as np
import pytest

from dgt.errors import StepTimeout
from dgt.pending import Pending


def test_finishes_after_its_last_part_and_runs_callbacks_once():
    pending = Pending("push", np.arange(3), parts=2, timeout_s=1.0)
    seen = []
    pending.add_done_callback(seen.append)
    pending._part_done()
    assert not pending.done() and seen == []
    pending._part_done()
    assert pending.done() and seen == [pending]
    np.testing.assert_array_equal(pending.wait(), np.arange(3))
    late = []
    pending.add_done_callback(late.append)  # already finished: called at once
    assert late == [pending]


def test_wait_is_bounded_and_names_the_call():
    with pytest.raises(StepTimeout, match="pull of key 7: no reply within 0.01 s"):
        Pending("pull of key 7", None, parts=1, timeout_s=1.0).wait(0.01)


def test_all_of_waits_for_every_call_even_after_an_error():
    children = [Pending(f"part {i}", None, parts=1, timeout_s=1.0) for i in range(3)]
    result = np.zeros(2)
    combined = Pending.all_of("bucket", children, result, timeout_s=1.0)
    children[1]._fail(RuntimeError("server 1 gone"))
    children[0]._part_done()
    assert not combined.done()  # part 2 may still read its buffer
    children[2]._fail(RuntimeError("server 2 gone"))
    assert combined.done()
    assert str(combined.error()) == "server 1 gone"  # the first error
    with pytest.raises(RuntimeError, match="server 1 gone"):
        combined.wait()


def test_all_of_succeeds_with_its_result_and_of_nothing_at_once():
    children = [Pending("a", None, 1, 1.0), Pending("b", None, 1, 1.0)]
    result = np.ones(4)
    combined = Pending.all_of("bucket", children, result, 1.0)
    for child in children:
        child._part_done()
    assert combined.error() is None and combined.wait() is result
    assert Pending.all_of("empty", [], None, 1.0).done()
