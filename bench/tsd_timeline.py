"""Where tsd's optimizer threads have nothing to do, from the control page's stamps.

For each bucket update it waits for, the Python client can record tsd's stamps of it
(`Session.timeline`: when tsd took the delivery, began and ended the work, published it; the
control page's CLOCK_MONOTONIC nanoseconds) and when its own wait returned. The benchmark marks
the trainer's phases on the same clock (forward, backward, step(), the loop's own work between
steps). Here the update intervals are merged; a gap in their union is a stretch with no bucket's
work under way, and each gap is attributed to the phases it overlaps. A gap in `step` includes
the commit's own sums of squares (they carry no stamps).
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

Interval = tuple[int, int]
# One entry of Session.timeline: bucket, taken, began, ended, published, got (ns).
Entry = tuple[int, int, int, int, int, int]
# A phase of the trainer: name, start and end (ns).
Phase = tuple[str, int, int]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of `intervals` as sorted, disjoint intervals (empty ones dropped)."""
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def gaps(merged: Sequence[Interval], start: int, end: int) -> list[Interval]:
    """The parts of [start, end) that no interval of `merged` (sorted, disjoint) covers."""
    out: list[Interval] = []
    at = start
    for a, b in merged:
        if b <= at:
            continue
        if a >= end:
            break
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < end:
        out.append((at, end))
    return out


def overlap(a: Interval, b: Interval) -> int:
    """The length of the intersection of two intervals (0 when they do not meet)."""
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def updates(timeline: Iterable[Entry], start: int, end: int) -> list[Interval]:
    """The work intervals (began, ended) of the distinct updates (bucket, taken) that began in
    [start, end); a bucket waited for twice counts once."""
    seen: dict[tuple[int, int], Interval] = {}
    for b, taken, began, ended, _published, _got in timeline:
        if began and ended >= began and start <= began < end:
            seen[(b, taken)] = (began, ended)
    return list(seen.values())


def idle_by_phase(timeline: Iterable[Entry], phases: Sequence[Phase],
                  steps: int) -> Optional[dict[str, object]]:
    """Per step, the milliseconds of each phase name with no update under way, their total, and
    the three longest gaps (milliseconds and the phase holding most of each). `phases` cover the
    window in order; None when nothing was recorded."""
    if not phases or steps <= 0:
        return None
    start, end = phases[0][1], phases[-1][2]
    work = updates(timeline, start, end)
    if not work:
        return None
    holes = gaps(merge(work), start, end)
    per: dict[str, float] = {}
    for name, _a, _b in phases:
        per.setdefault(name, 0.0)
    longest: list[tuple[float, str]] = []
    for h in holes:
        share = {name: 0 for name in per}
        for name, a, b in phases:
            share[name] += overlap(h, (a, b))
        for name, ns in share.items():
            per[name] += ns / 1e6
        longest.append(((h[1] - h[0]) / 1e6, max(share, key=lambda n: share[n])))
    longest.sort(reverse=True)
    return {"per_step_ms": {k: round(v / steps, 2) for k, v in per.items()},
            "total_ms": round(sum(per.values()) / steps, 2),
            "updates": len(work),
            "longest": [{"ms": round(ms, 2), "phase": name} for ms, name in longest[:3]]}
