"""What a wrapped model's client tells tsd about each step, for `tsctl top` (tsd shows it and never
acts on it): how long `step()` waited for tsd, and the bytes the weight and activation pagers moved
in the step. It is written on the job's control page (`Optimizer.report_step`), no call is made.

The weight pager measures each step's copies itself (`last_step_h2d_bytes`, set by its
`after_step()`, which runs before the report). The activation pager counts bytes cumulatively
(until its `reset_stats()`); a step's traffic is the growth since the previous report. Weights only
move host to device (trained ones are updated in tsd's slots); activations are paged out (device to
host) and back (host to device), so each paged byte counts once each way.
"""
from __future__ import annotations

import time
import weakref
from typing import Any

# The activation pager's counter at each session's previous report.
_last: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def _growth(now: int, before: int) -> int:
    return now - before if now >= before else now  # reset_stats() restarted the counter


def report_step(session: Any, started: float) -> None:
    """Reports the step `session` (an `engine.Session`) just finished: `started` is the
    `time.perf_counter()` at which its `step()` began waiting for tsd."""
    handle = session.handle
    report = getattr(handle, "report_step", None)
    if report is None:  # an extension built before the report existed
        return
    moved = (session.pager.last_step_h2d_bytes or 0) if session.pager is not None else 0
    paged = session.act_pager.paged_bytes if session.act_pager is not None else 0
    out = _growth(paged, _last.get(session, 0))
    _last[session] = paged
    report(max(0.0, time.perf_counter() - started), moved + out, out)
