"""bench/tsd_timeline.py: the stretches with no bucket update under way, from tsd's stamps of each
update and the trainer's phases, attributed to the phases they fall in."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import finetune_child  # noqa: E402
import tsd_timeline  # noqa: E402


def test_merge_joins_overlapping_and_touching_intervals_and_drops_empty_ones():
    assert tsd_timeline.merge([(5, 9), (0, 2), (1, 3), (3, 4), (7, 7), (10, 12)]) == [(0, 4), (5, 9), (10, 12)]
    assert tsd_timeline.merge([]) == []


def test_gaps_are_what_the_union_leaves_of_the_window():
    merged = [(0, 4), (5, 9), (10, 12)]
    assert tsd_timeline.gaps(merged, 0, 12) == [(4, 5), (9, 10)]
    assert tsd_timeline.gaps(merged, 2, 15) == [(4, 5), (9, 10), (12, 15)]
    assert tsd_timeline.gaps(merged, -3, 1) == [(-3, 0)]
    assert tsd_timeline.gaps([], 0, 5) == [(0, 5)]


def test_updates_counts_each_bucket_delivery_once_and_only_inside_the_window():
    # bucket, taken, began, ended, published, got
    tl = [(0, 1, 10, 20, 21, 22), (0, 1, 10, 20, 21, 30),  # waited for twice: one update
          (1, 2, 15, 25, 26, 27), (1, 40, 45, 50, 51, 52),  # two steps of bucket 1
          (2, 0, 0, 0, 0, 5),  # never stamped (an older daemon): ignored
          (3, 1, 5, 8, 9, 9)]  # began before the window
    assert sorted(tsd_timeline.updates(tl, 10, 100)) == [(10, 20), (15, 25), (45, 50)]


def test_idle_by_phase_attributes_each_gap_to_the_phases_it_overlaps():
    # Two steps of 100 units: forward [0, 40), backward [40, 80), step() [80, 100), then again.
    phases = [("forward", 0, 40), ("backward", 40, 80), ("step", 80, 100), ("between", 100, 100),
              ("forward", 100, 140), ("backward", 140, 180), ("step", 180, 200), ("drain", 200, 210)]
    # Updates run [0, 30), [50, 120), [150, 205): idle [30, 50) (10 in forward, 10 in backward),
    # [120, 150) (20 forward, 10 backward) and [205, 210) (5 in the drain).
    tl = [(0, 0, 0, 30, 31, 31), (1, 45, 50, 120, 121, 121), (0, 140, 150, 205, 206, 206)]
    # The stamps are nanoseconds: at a millisecond scale,
    # (A stamp of 0 means "never": the clock starts at 1000 units here.)
    big = [tuple((x + 1000) * 1_000_000 if i else x for i, x in enumerate(e)) for e in tl]
    big_phases = [(n, (a + 1000) * 1_000_000, (b + 1000) * 1_000_000) for n, a, b in phases]
    got = tsd_timeline.idle_by_phase(big, big_phases, steps=2)
    assert got["per_step_ms"] == {"forward": 15.0, "backward": 10.0, "step": 0.0, "between": 0.0, "drain": 2.5}
    assert got["total_ms"] == 27.5 and got["longest"][0] == {"ms": 30.0, "phase": "forward"}
    assert tsd_timeline.idle_by_phase([], big_phases, steps=2) is None
    assert tsd_timeline.idle_by_phase(big, [], steps=2) is None


def test_window_phases_run_back_to_back_from_the_first_settled_step():
    marks = [(0, 0, 10, 20, 30), (1, 35, 45, 55, 65), (2, 70, 80, 90, 100)]
    assert finetune_child.window_phases(marks, 1, 120) == [
        ("forward", 35, 45), ("backward", 45, 55), ("step", 55, 65), ("between", 65, 70),
        ("forward", 70, 80), ("backward", 80, 90), ("step", 90, 100), ("drain", 100, 120)]
