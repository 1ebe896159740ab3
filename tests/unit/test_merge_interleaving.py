"""StepMerger under random interleavings, against a model of Rules 1-3 written with sets.

The hand-written cases in test_merge.py pin one ordering each.  Here a seeded generator
draws, per worker and step, which blocks go reliably and what becomes of every datagram
(on time, lost, one step late, two steps late, duplicated), shuffles a step's events with
the late ones of earlier steps (datagrams may overtake their PUSH; a PUSH_END never does),
and feeds them one by one or as runs, as the server's receiver does.  The model knows, from
the events alone, what each datagram's outcome is, when a step may close, and what the sum
must be; the values are small integers, so every dtype's sum is exact and the comparison
is equality.  float32 and bfloat16 datagrams take the compiled merge, float16 ones numpy's.
Several steps per part, so the recycled accumulators are reused: anything not zeroed before
reuse shows up in the sum.
"""
import itertools

import numpy as np
import pytest

from dgt.merge import Outcome, StepMerger
from dgt.partition import BlockLayout, FragmentLayout
from dgt.wire import BFLOAT16, Header, MsgType

N, B, FE = 10 * 1024 + 300, 1024, 350  # 11 blocks, 3 fragment slots each, the last has one
LAYOUT = FragmentLayout(BlockLayout(N, B), FE)
GRACE_S, TICK_S = 1.0, 1e-4  # a step's events all fit well inside one grace window
STEPS = 6
DTYPES = {1: np.float32, 2: np.float16, 10: BFLOAT16}
# What becomes of a datagram a worker announced, and how likely it is.
FATES = ("on_time", "lost", "late", "very_late")
FATE_P = (0.6, 0.2, 0.12, 0.08)


def _header(kind, rank, step, dtype_code, **fields):
    return Header(kind, rank=rank, channel=1, dtype=dtype_code, key=3, step=step, n_elems=N,
                  block_elems=B, frag_elems=FE, **fields)


def _draw_steps(rng, workers):
    """Per step and worker: values, reliable blocks, announced slots, datagram copies by the
    window (step) they arrive in."""
    plan = []
    for step in range(STEPS):
        per_worker = []
        for rank in range(workers):
            values = rng.integers(-8, 8, N).astype(np.float64)
            reliable = np.flatnonzero(rng.random(LAYOUT.blocks.n_blocks) < rng.random())
            udp_slots = LAYOUT.slots_of_blocks(
                np.setdiff1d(np.arange(LAYOUT.blocks.n_blocks), reliable))
            copies = []  # (window step, slot)
            for slot in udp_slots.tolist():
                fate = FATES[rng.choice(len(FATES), p=FATE_P)]
                window = {"on_time": step, "late": step + 1, "very_late": step + 2}.get(fate)
                if window is not None:
                    copies.append((window, slot))
                if fate == "on_time" and rng.random() < 0.15:
                    copies.append((step, slot))  # a replay inside the step
                if fate in ("on_time", "late") and rng.random() < 0.1:
                    copies.append((step + 1, slot))  # a replay after the close
            per_worker.append((values, reliable, udp_slots, copies))
        plan.append(per_worker)
    return plan


class Model:
    """What Rules 1-3 say, kept with sets and float64 sums."""

    def __init__(self, workers, mode):
        self.workers, self.mode = workers, mode
        self.delivered = {}  # step -> per worker: slots merged on time or sent reliably
        self.late_taken = {}  # step -> per worker: late slots already added (diff mode)

    def open(self, step, plan):
        w = self.workers
        self.step = step
        self.pushed, self.ended = [False] * w, [False] * w
        self.on_time = [set() for _ in range(w)]
        self.expected = [len(udp) for _, _, udp, _ in plan[step]]
        self.late_values = np.zeros(N)
        self.late_blocks = set()
        self.udp_late = np.zeros(w, np.int64)
        self.last_end_s = None
        self.late_taken[step - 1] = [set() for _ in range(w)]

    def closable(self):
        return all(self.ended) and all(
            len(got) >= want for got, want in zip(self.on_time, self.expected))

    def outcome(self, rank, step, slot, plan):
        """The outcome of a datagram arriving now, with the model updated for it."""
        if step == self.step:
            if slot in self.on_time[rank]:
                return Outcome.DUPLICATE
            self.on_time[rank].add(slot)
            return Outcome.MERGED
        if self.mode == "diff" and step == self.step - 1:
            if slot in self.delivered[step][rank] or slot in self.late_taken[step][rank]:
                return Outcome.DUPLICATE
            self.late_taken[step][rank].add(slot)
            start, stop = LAYOUT.frag_range(*divmod(slot, LAYOUT.frags_per_block))
            self.late_values[start:stop] += plan[step][rank][0][start:stop]
            self.late_blocks.add(slot // LAYOUT.frags_per_block)
            self.udp_late[rank] += 1
            return Outcome.LATE_MERGED
        self.udp_late[rank] += 1
        return Outcome.LATE_DROPPED

    def close(self, plan):
        """The expected total, missing slots and touched blocks of the open step."""
        fpb, w = LAYOUT.frags_per_block, self.workers
        delivered = np.zeros((w, LAYOUT.n_slots), bool)
        sums = np.zeros((w, N))
        for rank, (values, reliable, _, _) in enumerate(plan[self.step]):
            slots = np.concatenate([LAYOUT.slots_of_blocks(reliable),
                                    np.array(sorted(self.on_time[rank]), np.int64)])
            delivered[rank, slots] = True
            for slot in slots.tolist():
                start, stop = LAYOUT.frag_range(*divmod(slot, fpb))
                sums[rank, start:stop] = values[start:stop]
        total = sums.sum(axis=0)
        if self.mode == "rescale":
            counts = delivered.sum(axis=0)
            for slot in np.flatnonzero((counts > 0) & (counts < w)).tolist():
                start, stop = LAYOUT.frag_range(*divmod(slot, fpb))
                total[start:stop] *= w / counts[slot]
        total += self.late_values
        self.delivered[self.step] = [set(np.flatnonzero(row).tolist()) for row in delivered]
        touched = delivered.reshape(w, -1, fpb).any(axis=(0, 2))
        touched[sorted(self.late_blocks)] = True
        return total, LAYOUT.valid_slots & ~delivered, touched


def _events(plan, step, rng):
    """Step ``step``'s window: its PUSHes and end markers, its datagrams and the late ones of
    the two steps before, shuffled; a worker's PUSH_END stays after its PUSH."""
    events = []
    for rank, (_, _, udp, _) in enumerate(plan[step]):
        events.append(("push", rank, step, None))
        if len(udp):
            events.append(("end", rank, step, None))
    for earlier in range(max(0, step - 2), step + 1):
        for rank, (_, _, _, copies) in enumerate(plan[earlier]):
            events += [("data", rank, earlier, slot) for window, slot in copies
                       if window == step]
    order = rng.permutation(len(events))
    events = [events[i] for i in order]
    for rank in range(len(plan[step])):
        kinds = [i for i, e in enumerate(events) if e[1] == rank and e[2] == step
                 and e[0] in ("push", "end")]
        if len(kinds) == 2 and events[kinds[0]][0] == "end":
            events[kinds[0]], events[kinds[1]] = events[kinds[1]], events[kinds[0]]
    return events


def _runs(events, rng, batched):
    """Consecutive datagrams of one (rank, step) grouped into runs of random length."""
    groups = []
    for event in events:
        last = groups[-1] if groups else None
        if batched and event[0] == "data" and last and last[0][0] == "data" \
                and last[0][1:3] == event[1:3] and rng.random() < 0.8:
            last.append(event)
        else:
            groups.append([event])
    return groups


def _feed_data(merger, run, plan, dtype_code):
    _, rank, step, _ = run[0]
    values = plan[step][rank][0]
    slots = np.array([slot for *_, slot in run], np.int64)
    blocks, frags = np.divmod(slots, LAYOUT.frags_per_block)
    starts, stops = LAYOUT.slot_ranges(slots)
    rows = np.zeros((len(run), FE), DTYPES[dtype_code])
    for i, (start, stop) in enumerate(zip(starts, stops)):
        rows[i, :stop - start] = values[start:stop]
    header = _header(MsgType.DATA, rank, step, dtype_code)
    if len(run) == 1:  # the one-datagram entry point, as a bytes payload
        header = header._replace(block=int(blocks[0]), frag=int(frags[0]))
        return {merger.add_fragment(header, rows[0, :stops[0] - starts[0]].tobytes(), 0.0): 1}
    return merger.add_fragments(header, blocks, frags, rows, stops - starts)


@pytest.mark.parametrize("mode", ["drop", "diff", "rescale"])
@pytest.mark.parametrize("dtype_code", sorted(DTYPES))
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_random_interleavings_merge_what_the_rules_say(mode, dtype_code, batched, seed):
    rng = np.random.default_rng([seed, dtype_code, int(batched), ("drop", "diff", "rescale").index(mode)])
    workers = 1 + seed % 3
    plan = _draw_steps(rng, workers)
    merger = StepMerger(workers, receive_mode=mode, grace_s=GRACE_S, error_feedback=True)
    model = Model(workers, mode)
    expected_counts = dict.fromkeys((Outcome.MERGED, Outcome.DUPLICATE, Outcome.LATE_MERGED,
                                     Outcome.LATE_DROPPED), 0)
    clock = itertools.count()
    now = 0.0
    for step in range(STEPS):
        model.open(step, plan)
        for run in _runs(_events(plan, step, rng), rng, batched):
            now = next(clock) * TICK_S
            if rng.random() < 0.2 and not model.closable():
                assert merger.poll(now) == [], f"step {step} closed before Rule 1 allows"
            kind, rank, event_step, _ = run[0]
            values, reliable, udp, _ = plan[event_step][rank]
            header = _header(MsgType.PUSH, rank, step, dtype_code, block=len(reliable),
                             udp_expected=len(udp))
            if kind == "push":
                payload = LAYOUT.blocks.gather(values.astype(DTYPES[dtype_code]), reliable)
                merger.add_push(header, reliable, [payload] if len(reliable) else [], now)
                model.pushed[rank] = True
                if not len(udp):
                    model.ended[rank], model.last_end_s = True, now
            elif kind == "end":
                merger.add_push_end(header._replace(type=MsgType.PUSH_END), now)
                model.ended[rank], model.last_end_s = True, now
            else:
                want = {}
                for _, r, s, slot in run:
                    outcome = model.outcome(r, s, slot, plan)
                    want[outcome] = want.get(outcome, 0) + 1
                got = _feed_data(merger, run, plan, dtype_code)
                assert got == want, f"step {step}: outcomes of {run}"
                for outcome, count in want.items():
                    expected_counts[outcome] += count
        # Halfway through the grace window a step closes if and only if it is complete.
        closed = merger.poll(model.last_end_s + GRACE_S / 2)
        assert len(closed) == int(model.closable()), f"step {step}: complete = {model.closable()}"
        if not closed:
            closed = merger.poll(model.last_end_s + GRACE_S)
        clock = itertools.count(int((model.last_end_s + GRACE_S) / TICK_S) + 1)
        result, = closed
        total, missing, touched = model.close(plan)
        assert result.step == step
        np.testing.assert_array_equal(result.total.astype(np.float64), total)
        np.testing.assert_array_equal(result.merged.astype(np.float64), total)
        np.testing.assert_array_equal(result.missing, missing)
        np.testing.assert_array_equal(result.touched_blocks, touched)
        assert result.udp_expected.tolist() == model.expected
        assert result.udp_merged.tolist() == [len(s) for s in model.on_time]
        assert result.udp_late.tolist() == model.udp_late.tolist()
    assert {k: merger.counters.get(k, 0) for k in expected_counts} == expected_counts
    # The draw exercised what it is meant to: losses, late arrivals and replays.
    assert expected_counts[Outcome.DUPLICATE] and expected_counts[Outcome.MERGED]
    assert expected_counts[Outcome.LATE_MERGED if mode == "diff" else Outcome.LATE_DROPPED]
