"""The schedule of weight paging (trainstream.paging.schedule), pure: which paged block is copied to
the device when, how many are there at once, the PCIe bytes a plan costs per optimizer step, and
the prefetch depth chosen from the budget. No daemon, no GPU."""
import itertools

import pytest

from trainstream.blockplan import MemoryPlanner
from trainstream.paging import schedule
from trainstream.planner import Budget

GiB = 1 << 30
MiB = 1 << 20


def fetches(events):
    return [i for kind, i in events if kind == "fetch"]


def check_invariants(count, paged, depth, events):
    loaded = set()
    paged = set(paged)
    for k, (kind, i) in enumerate(events):
        if kind == "fetch":
            assert i in paged, f"fetched resident block {i}"
            assert i not in loaded, f"block {i} fetched twice without a drop"
            loaded.add(i)
        elif kind == "drop":
            assert i in loaded
            loaded.discard(i)
        elif kind == "use" and i in paged:
            assert i in loaded, f"block {i} used before its copy ({events[:k + 1]})"
        assert len(loaded) <= depth + 1, f"{len(loaded)} blocks on the device with depth {depth}: {events[:k + 1]}"
    assert not loaded, f"blocks {loaded} are left on the device after the micro-batch"


def test_ahead_gives_the_next_paged_blocks_in_each_direction():
    paged = [1, 3, 4, 7, 9]
    assert schedule.ahead(paged, -1, 1, 1) == [1]
    assert schedule.ahead(paged, -1, 1, 3) == [1, 3, 4]
    assert schedule.ahead(paged, 3, 1, 2) == [4, 7]      # the current block is never included
    assert schedule.ahead(paged, 5, 1, 2) == [7, 9]      # from a resident block
    assert schedule.ahead(paged, 9, 1, 2) == []
    assert schedule.ahead(paged, 10, -1, 2) == [9, 7]
    assert schedule.ahead(paged, 7, -1, 3) == [4, 3, 1]
    assert schedule.ahead(paged, 1, -1, 3) == []
    with pytest.raises(ValueError, match="direction"):
        schedule.ahead(paged, 0, 0, 1)
    with pytest.raises(ValueError, match="depth"):
        schedule.ahead(paged, 0, 1, 0)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_the_schedule_fetches_depth_blocks_ahead_in_forward_and_backward_order(depth):
    events = schedule.simulate(8, range(8), depth)
    check_invariants(8, range(8), depth, events)
    assert schedule.most_in_flight(events) == depth + 1
    # forward fetches in index order, backward in reverse; block 7 (the last) is not fetched again
    assert fetches(events) == list(range(8)) + list(range(6, -1, -1))
    # the model's pre-hook fetches the first `depth` blocks; block 0's, the one `depth` after it
    first_use = events.index(("use", 0))
    assert events[:depth] == [("fetch", i) for i in range(depth)]
    assert fetches(events[:first_use]) == list(range(depth + 1))
    # when block k's backward starts, the block depth below it is fetched (the nearer ones are there)
    at = events.index(("back", 5))
    nxt = events.index(("back", 4))
    assert fetches(events[at:nxt]) == [5 - depth]  # the others are on the device already


def test_depth_one_is_the_single_block_lookahead():
    events = schedule.simulate(4, [0, 1, 2, 3], 1)
    assert [e for e in events if e[0] != "use" and e[0] != "back"] == [
        ("fetch", 0), ("fetch", 1), ("drop", 0), ("fetch", 2), ("drop", 1), ("fetch", 3), ("drop", 2),
        ("fetch", 2), ("drop", 3), ("fetch", 1), ("drop", 2), ("fetch", 0), ("drop", 1), ("drop", 0)]


@pytest.mark.parametrize("count,depth", [(6, 1), (6, 2), (9, 3), (5, 4)])
def test_every_paged_set_keeps_depth_plus_one_blocks_at_most(count, depth):
    """Every subset of the blocks, training with and without checkpointing, reentrant, eval."""
    for n in range(count + 1):
        for paged in itertools.combinations(range(count), n):
            for kw in (dict(), dict(recompute=True), dict(keep_last=False, recompute=True),
                       dict(keep_last=False, backward=False)):
                events = schedule.simulate(count, paged, depth, **kw)
                check_invariants(count, paged, depth, events)
                if paged:
                    assert schedule.most_in_flight(events) <= min(depth + 1, len(paged))
                # crossings: what simulate fetched equals what the plan counts
                if kw.get("backward", True):
                    want = schedule.crossings(paged, keep_last=kw.get("keep_last", True))
                    got = {i: fetches(events).count(i) for i in paged}
                    assert got == want, (paged, kw)


def test_checkpointing_keeps_a_block_between_recompute_and_backward():
    """With recompute every block's recompute marks its backward; a paged block is fetched once
    for both (the recompute's use and the backward's) and dropped only when the block below starts."""
    events = schedule.simulate(4, [1, 2], 1, recompute=True)
    back2, back1 = events.index(("back", 2)), events.index(("back", 1))
    assert ("drop", 2) not in events[back2:back1]
    assert events.index(("drop", 2)) > back1
    assert fetches(events).count(2) == 1  # the last paged block stays from its forward
    assert fetches(events).count(1) == 2


def test_h2d_bytes_per_step_counts_crossings_blocks_and_micro_batches():
    sizes = [100, 200, 300, 400]
    assert schedule.crossings([]) == {}
    assert schedule.crossings([0, 2]) == {0: 2, 2: 1}
    assert schedule.crossings([0, 2], keep_last=False) == {0: 2, 2: 2}
    assert schedule.h2d_bytes_per_micro_batch(sizes, [0, 2]) == 2 * 100 + 300
    assert schedule.h2d_bytes_per_step(sizes, [0, 2], micro_batches=4) == 4 * (2 * 100 + 300)
    assert schedule.h2d_bytes_per_step(sizes, [], micro_batches=4) == 0
    assert schedule.h2d_bytes_per_step(sizes, range(4), 1, keep_last=False) == 2 * sum(sizes)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="micro_batches"):
            schedule.h2d_bytes_per_step(sizes, [0], bad)


def test_the_settled_plan_reports_its_h2d_bytes_per_step():
    sizes = [256 * MiB] * 48
    planner = MemoryPlanner(Budget(vram_usable=12 * GiB), sizes, fixed_vram=1 * GiB, depth=2, micro_batches=4)
    paged = planner.initial_paged()
    assert paged and len(paged) < 48
    per_step = planner.h2d_bytes_per_step(paged)
    assert per_step == 4 * (2 * len(paged) - 1) * 256 * MiB
    peak = planner.target - 128 * MiB  # no room for one more resident block, under the target: steady
    assert planner.refine(peak, paged) is None and planner.refine(peak, paged) is None
    settled = [e for e in planner.take_events() if e.startswith("memory plan settled")]
    assert len(settled) == 1
    msg = settled[0]
    assert f"{48 - len(paged)} of 48 blocks resident" in msg
    assert "H2D per step" in msg and "x 4" in msg and "prefetch depth 2" in msg
    from trainstream.units import format_bytes
    assert format_bytes(per_step) in msg
    with pytest.raises(ValueError, match="micro_batches"):
        MemoryPlanner(Budget(vram_usable=GiB), sizes, micro_batches=0)


def test_the_planner_sets_aside_depth_plus_one_blocks_in_flight():
    sizes = [100 * MiB] * 20
    shallow = MemoryPlanner(Budget(vram_usable=2 * GiB), sizes, depth=1)
    deep = MemoryPlanner(Budget(vram_usable=2 * GiB), sizes, depth=3)
    assert deep.buffers({1, 2, 3, 4, 5}) == 4 * 100 * MiB
    assert shallow.buffers({1, 2, 3, 4, 5}) == 2 * 100 * MiB
    assert len(deep.initial_paged()) >= len(shallow.initial_paged())


def test_choose_depth_from_the_budget_and_check_depth():
    sizes = [100 * MiB] * 10
    assert schedule.choose_depth(sizes, None) == 1                # a CPU device
    assert schedule.choose_depth(sizes, 1 * GiB) == 1             # 2 blocks are more than 10% of 1 GiB
    assert schedule.choose_depth(sizes, 3 * GiB) == 2             # 3 x 100 MiB <= 307 MiB
    assert schedule.choose_depth(sizes, 80 * GiB) == 3            # at most 3
    assert schedule.choose_depth([], 80 * GiB) == 1
    assert schedule.check_depth(None) is None
    assert schedule.check_depth(2) == 2
    for bad in (0, -1, 2.0, True, "2", schedule.MAX_DEPTH + 1):
        with pytest.raises(ValueError, match="prefetch_depth"):
            schedule.check_depth(bad)
