"""PriorityOutbox: most urgent first, arrival order within a priority, a full socket keeps
its message first in line."""
from dgt.transport.outbox import PriorityOutbox


def drain(outbox, destination, capacity=None):
    sent = []

    def try_send(message):
        if capacity is not None and len(sent) >= capacity:
            return False
        sent.append(message)
        return True

    outbox.flush(destination, try_send)
    return sent


def test_most_urgent_first_and_arrival_order_within_a_priority():
    outbox = PriorityOutbox()
    # gluon's order of pushes out of backward: last layers (low priority) first
    for name, priority in [("fc8.0", -7), ("fc8.1", -7), ("fc6", -5), ("conv1", 0),
                           ("fc8.end", -7), ("hello", 2 ** 31 - 1)]:
        outbox.put("server0", priority, name)
    assert drain(outbox, "server0") == ["hello", "conv1", "fc6", "fc8.0", "fc8.1", "fc8.end"]
    assert len(outbox) == 0 and outbox.destinations() == []


def test_arrival_order_when_priorities_are_off():
    outbox = PriorityOutbox(by_priority=False)
    for name, priority in [("a", -7), ("b", 0), ("c", 5), ("d", -1)]:
        outbox.put(0, priority, name)
    assert drain(outbox, 0) == ["a", "b", "c", "d"]


def test_full_socket_keeps_the_message_and_later_urgent_ones_pass():
    outbox = PriorityOutbox()
    for index in range(5):
        outbox.put(1, -3, f"big{index}")
    assert drain(outbox, 1, capacity=2) == ["big0", "big1"]
    assert outbox.waiting(1) == 3
    outbox.put(1, 0, "urgent")
    assert drain(outbox, 1) == ["urgent", "big2", "big3", "big4"]


def test_destinations_are_independent():
    outbox = PriorityOutbox()
    outbox.put("w0", 0, "x")
    outbox.put("w1", 0, "y")
    outbox.put("w1", 1, "z")
    assert sorted(outbox.destinations()) == ["w0", "w1"]
    assert drain(outbox, "w1") == ["z", "y"]
    assert outbox.destinations() == ["w0"] and len(outbox) == 1
