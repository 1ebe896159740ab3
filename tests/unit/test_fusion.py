"""The fusion planner: learned order, buckets per server and dtype, and the way out."""
import pytest

from dgt.fusion import FUSED_KEY_BASE, Call, FusionPlanner


def two_servers(key, n_elems):
    return None if n_elems >= 10_000 else key % 2  # big keys are cut into parts


STEP = [Call(0, 100, "float32"), Call(1, 50_000, "float32"), Call(2, 300, "float32"),
        Call(3, 400, "float32"), Call(4, 200, "float32"), Call(5, 900, "float32"),
        Call(6, 100, "int32"), Call(7, 100, "float32"), Call(8, 500, "float16"),
        Call(9, 500, "float16")]


def run(planner, calls):
    return [planner.place(call) for call in calls]


def test_first_step_is_learned_then_small_keys_share_buckets_per_server_and_dtype():
    planner = FusionPlanner(1000, two_servers)
    assert all(result == (None, False) for result in run(planner, STEP))
    assert not planner.active
    placed = run(planner, STEP)  # the second step: buckets from now on
    assert planner.active and not any(broke for _, broke in placed)
    buckets = {b.key: [c.key for c in b.members] for b in planner.buckets}
    # server 0: 0, 2, 4 (100+300+200) then 8 alone (float16) -> dropped;
    # server 1: 3 (400) + 5 (900) > 1000 -> 3 alone, 5 + 7 together; 9 alone (float16).
    assert sorted(buckets.values()) == [[0, 2, 4], [5, 7]]
    assert sorted(buckets) == [FUSED_KEY_BASE, FUSED_KEY_BASE + 1]
    slots = {call.key: slot for call, (slot, _) in zip(STEP, placed)}
    for key in (1, 3, 6, 8, 9):  # big, alone, not float, alone in its dtype
        assert slots[key] is None
    assert [(slots[k].index, slots[k].last) for k in (0, 2, 4)] == [(0, False), (1, False),
                                                                   (2, True)]
    assert slots[0].bucket is slots[4].bucket
    assert slots[0].bucket.offsets == [0, 100, 400, 600]
    for bucket in planner.buckets:
        assert bucket.n_elems <= 1000


def test_the_same_calls_give_the_same_buckets_on_every_worker():
    plans = []
    for _ in range(2):
        planner = FusionPlanner(1000, two_servers)
        run(planner, STEP * 3)
        plans.append([(b.key, b.server, [c.key for c in b.members]) for b in planner.buckets])
    assert plans[0] == plans[1]


@pytest.mark.parametrize("change", ["missing", "reordered", "resized"])
def test_a_changed_step_stops_fusion_for_good(change):
    planner = FusionPlanner(1000, two_servers)
    run(planner, STEP * 2)
    step = list(STEP)
    if change == "missing":
        del step[3]
    elif change == "reordered":
        step[2], step[3] = step[3], step[2]
    else:
        step[4] = Call(4, 201, "float32")
    placed = run(planner, step)
    broke_at = [i for i, (_, broke) in enumerate(placed) if broke]
    assert len(broke_at) == 1
    assert all(slot is None for slot, _ in placed[broke_at[0]:])
    assert planner.stopped and "changed" in planner.stop_reason
    assert run(planner, STEP) == [(None, False)] * len(STEP)


def test_a_key_pushed_twice_while_learning_stops_fusion():
    planner = FusionPlanner(1000, two_servers)
    assert run(planner, STEP[:3] + [STEP[2]])[-1] == (None, True)
    assert planner.stopped


def test_zero_capacity_never_fuses_and_nothing_small_enough_stops():
    planner = FusionPlanner(0, two_servers)
    assert planner.stopped and run(planner, STEP * 2) == [(None, False)] * 20
    planner = FusionPlanner(1000, lambda key, n: key)  # every key on its own server
    run(planner, STEP * 2)
    assert planner.stopped and planner.buckets == []
