"""The block planner of weight paging (trainstream.blockplan, re-exported by trainstream.planner):
TrainStream's decision tests, pure arithmetic on budgets, run on the CPU."""
import pytest

from trainstream.blockplan import ACTIVATION_RESERVE, MARGIN, fraction_paged
from trainstream.planner import Budget, MemoryPlanner, spread

GiB = 1 << 30


def budget(vram_gib, ram_gib=64):
    # TrainStream's Budget also had pin_budget: tsd's pool and the job's quota are that here.
    return Budget(vram_total=int(vram_gib * GiB), vram_usable=int(vram_gib * GiB), ram_total=int(ram_gib * GiB),
                  ram_available=int(ram_gib * GiB))


def test_spread_is_even_and_exact():
    assert spread(0, list(range(10))) == []
    assert spread(10, list(range(10))) == list(range(10))
    s = spread(4, list(range(16)))
    assert len(s) == 4 and all(b - a == 4 for a, b in zip(s, s[1:]))
    assert len(spread(7, list(range(48)))) == 7
    assert spread(2, [9, 1, 5, 7]) == [1, 7]  # a subset of what it is given, sorted
    assert spread(-1, [1, 2]) == [] and spread(3, []) == []


@pytest.mark.parametrize("vram,expect_paged", [(80, 0), (24, None), (8, None), (4, None)])
def test_static_plan_follows_the_vram_budget(vram, expect_paged):
    """48 blocks of 0.55 GiB (Qwen2.5-14B in bf16) and 3 GiB outside them."""
    blocks = [int(0.55 * GiB)] * 48
    p = MemoryPlanner(budget(vram), blocks, fixed_vram=3 * GiB, inflight_bytes=GiB // 2)
    paged = p.initial_paged()
    assert any("memory plan:" in e for e in p.events)
    if expect_paged == 0:
        assert paged == set()  # an 80 GB card holds the whole model
        return
    resident = 48 - len(paged)
    usable = 0.9 * vram * GiB
    assert 3 * GiB + resident * 0.55 * GiB < usable  # what stays resident fits
    if vram >= 24:
        assert resident >= 20  # most of a 24 GB card is used for weights
    assert len(paged) == len(set(paged)) and all(0 <= i < 48 for i in paged)
    # What stays resident, plus two paged blocks in flight, the fixed part and the activation
    # reserve, fits the usable VRAM; one more resident block would not.
    reserve = ACTIVATION_RESERVE * usable
    assert resident == 0 or 3 * GiB + GiB // 2 + reserve + (resident + 2) * 0.55 * GiB <= usable
    if 0 < resident < 48:
        assert 3 * GiB + GiB // 2 + reserve + (resident + 3) * 0.55 * GiB > usable


def test_static_plan_spreads_the_paged_blocks():
    p = MemoryPlanner(budget(24), [int(0.55 * GiB)] * 48, fixed_vram=3 * GiB, inflight_bytes=GiB // 2)
    paged = sorted(p.initial_paged())
    gaps = {b - a for a, b in zip(paged, paged[1:])}
    assert max(gaps) - min(gaps) <= 1  # evenly spaced, not the first or last blocks in a run


def test_the_usable_vram_is_the_smaller_of_vram_usable_and_the_headroom_of_the_total():
    # A measured budget already holds the headroom (and a set_per_process_memory_fraction cap) in
    # vram_usable; TrainStream's tests pass the raw size, which the planner caps at 90%.
    p = MemoryPlanner(Budget(vram_total=100, vram_usable=50), [1] * 4)
    assert p.usable == 50
    assert MemoryPlanner(Budget(vram_total=100, vram_usable=100), [1] * 4).usable == 90
    assert MemoryPlanner(Budget(vram_usable=77), [1] * 4).usable == 77


def test_refinement_moves_blocks_in_with_headroom_and_out_when_full():
    blocks = [GiB // 2] * 20
    p = MemoryPlanner(budget(16), blocks, fixed_vram=2 * GiB, inflight_bytes=GiB // 4)
    paged = set(range(0, 20, 2))  # 10 paged
    grown = p.refine(peak=6 * GiB, paged=paged)  # lots of headroom
    assert grown is not None and grown < paged
    shrunk = p.refine(peak=int(15.5 * GiB), paged=grown)  # too close to the budget
    assert shrunk is not None and shrunk > grown
    assert not p.done
    p.refine(peak=int(13.5 * GiB), paged=shrunk)
    assert not p.done  # one steady step does not settle it
    p.refine(peak=int(13.5 * GiB), paged=shrunk)
    assert p.done  # two steady steps settle the plan
    assert any(e.startswith("memory plan settled: ") and "of 20 blocks resident" in e for e in p.events)


def test_refinement_moves_in_only_what_fits_and_keeps_the_rest_spread():
    blocks = [100] * 10
    p = MemoryPlanner(Budget(vram_usable=2000), blocks)  # target 1900
    paged = {0, 2, 4, 6, 8}
    # Measured 1700 with 5 paged (two of them on the device at a time): 2 more resident fit.
    new = p.refine(1700, paged)
    assert new is not None and new < paged
    assert p._estimate(1700, paged, new) <= p.target
    assert p._estimate(1700, paged, set(list(new)[1:])) > p.target  # one more in would not fit
    assert len(new) == 3 and max(new) - min(new) >= 4  # the rest stays spread
    # A peak over the target pages the fewest blocks that bring it under.
    out = p.refine(2100, new)
    assert out is not None and out > new and p._estimate(2100, new, out) <= p.target
    assert p.steady == 0 and not p.done


def test_moving_the_last_paged_blocks_in_is_not_credited_their_copies_in_flight():
    """The measured peak may have held fewer paged copies than depth + 1 (at the loss, none), so
    a plan with fewer copies in flight is not credited the difference; one with more is charged."""
    p = MemoryPlanner(Budget(vram_usable=2000), [100] * 10)  # target 1900, depth 1: 2 copies
    paged = {0, 5}
    # Measured 1750 with 2 paged. All resident: 200 more resident bytes; the 2 copies might not
    # have been on the device at the peak, so the estimate is 1950 (crediting them gave 1750).
    assert p._estimate(1750, paged, set()) == 1950
    assert p.refine(1750, paged) == {0}  # one moves in (1850); both would not surely fit
    # Paging more: the copies in flight stay 2 (depth + 1): only the resident bytes change.
    assert p._estimate(1750, paged, {0, 3, 5, 8}) == 1550
    # From 1 paged (1 copy) to 3 paged (2 copies): one more copy is charged.
    assert p._estimate(1000, {5}, {1, 5, 8}) == 1000 - 200 + 100


def test_a_step_at_the_target_is_steady_and_every_block_paged_stays_paged_when_over():
    p = MemoryPlanner(Budget(vram_usable=1000), [100] * 6)
    assert p.refine(int(1000 * (1 - MARGIN)), {0, 2, 4}) is None
    assert p.refine(5000, set(range(6))) is None  # nothing left to page: steady, no change possible
    assert p.done


def test_the_watchdog_pages_one_block_per_grown_step():
    p = MemoryPlanner(Budget(vram_usable=1000), [100] * 6)
    p.done = True
    assert p.observe(900, {0}) is None  # under the target: nothing
    new = p.observe(5000, {0})
    assert new is not None and len(new) == 2 and 0 in new
    assert any("memory watchdog" in e and "paged block" in e for e in p.events)
    assert p.observe(5000, set(range(6))) is None  # nothing left to page: it says so
    assert "every block is already paged" in p.events[-1]
    assert len(p.take_events()) == 2 and p.events == []


def test_remeasure_refines_a_settled_plan_again_moving_several_blocks_at_once():
    """What the activations hold changed (activation_offload="auto" recomputes instead of paging):
    a settled plan refines again from the next peak, paging as many blocks as that peak needs in one
    move (the watchdog would page one per step, each move waiting for every update), then settles."""
    p = MemoryPlanner(Budget(vram_usable=1000), [100] * 6)
    p.remeasure("not settled yet")
    assert not p.done and p.events == []  # refining already: nothing to say
    for _ in range(2):
        assert p.observe(900, {0}) is None
    assert p.done
    p.take_events()
    p.remeasure("activation_offload=auto changed what is paged or recomputed after step 4")
    assert not p.done and p.steady == 0
    assert "measured again from the next step (activation_offload=auto changed" in p.events[-1]
    new = p.observe(1250, {0})  # 300 over the target (950): at least three more blocks, at once
    assert new is not None and 0 in new and len(new - {0}) >= 3, p.events
    assert any("memory plan refined" in e for e in p.events)
    assert p.observe(940, new) is None and p.observe(940, new) is None and p.done


def test_planner_inputs_are_checked():
    with pytest.raises(ValueError, match="no VRAM"):
        MemoryPlanner(Budget(ram_total=1), [1])
    with pytest.raises(ValueError, match="at least one block"):
        MemoryPlanner(budget(8), [])
    with pytest.raises(ValueError, match="bytes"):
        MemoryPlanner(budget(8), [1, -1])
    with pytest.raises(ValueError, match="depth"):
        MemoryPlanner(budget(8), [1], depth=0)


def test_fraction_pages_a_spread_share():
    assert fraction_paged(0.5, 8) == [0, 2, 4, 6]
    assert fraction_paged(1.0, 3) == [0, 1, 2]
    assert fraction_paged(0.01, 48) == [0]
    for bad in (0.0, 1.5, -0.1, float("nan"), True):
        with pytest.raises(ValueError, match="fraction"):
            fraction_paged(bad, 8)


def test_the_first_step_pages_every_block_when_the_plan_pages_any_then_refine_moves_them_back():
    """A first step that runs out of memory ends the run, and its activations are unknown before
    it: when the budget's plan pages anything, the first step pages everything, and refine moves
    in what the measured peak leaves room for."""
    blocks = [int(0.55 * GiB)] * 48
    p = MemoryPlanner(budget(24), blocks, fixed_vram=3 * GiB, inflight_bytes=GiB // 2)
    planned = p.initial_paged()
    assert 0 < len(planned) < 48
    first = p.probe_paged(planned)
    assert first == set(range(48)) and any("first step pages all 48" in e for e in p.events)
    # Step 1 measured 3 GiB outside + 2 blocks in flight + 4 GiB of activations.
    peak = 3 * GiB + 2 * int(0.55 * GiB) + 4 * GiB
    after = p.refine(peak, first)
    assert after is not None and len(after) < len(planned)  # the measurement leaves more room than the guess
    assert p._estimate(peak, first, after) <= p.target
    # A plan that pages nothing is kept as it is.
    roomy = MemoryPlanner(budget(80), blocks, fixed_vram=3 * GiB)
    assert roomy.probe_paged(roomy.initial_paged()) == set()
