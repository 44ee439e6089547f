"""Progress of long operations on a terminal: one line on stderr, rewritten in place, and nothing
at all when stderr is not a terminal (a log file, a pipe, a batch job), so logs stay clean.

    with Progress("save_state", total=nbytes, unit="bytes", poll=lambda: os.fstat(fd).st_size):
        handle.save_state(fd)          # one blocking call: the line shows the file growing
    with Progress("wrap: registering", total=len(buckets)) as bar:
        for b in buckets:
            ...
            bar.advance()

The line appears only once the operation has run for `delay` seconds (short ones print nothing)
and is refreshed at most every `interval` seconds by a daemon thread, which also calls `poll()`
where one is given (for a call that blocks inside the daemon) and shows the elapsed time. When
the operation ends the line is finished with its totals and a newline.

`TRAINSTREAM_PROGRESS=0` turns the lines off everywhere, `TRAINSTREAM_PROGRESS=1` turns them on even
when stderr is not a terminal; `enabled=` overrides both for one operation.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from types import TracebackType
from typing import Any, Callable, Iterator, Optional, Sequence, TextIO, TypeVar

from .units import format_bytes

__all__ = ["Progress", "progress_enabled", "track"]

T = TypeVar("T")

_ENV = "TRAINSTREAM_PROGRESS"


def progress_enabled(stream: Optional[TextIO] = None, enabled: Optional[bool] = None) -> bool:
    """Whether progress lines go to `stream` (default stderr): `enabled` when given, else
    $TRAINSTREAM_PROGRESS ("0" off, "1" on), else whether the stream is a terminal."""
    if enabled is not None:
        return bool(enabled)
    env = os.environ.get(_ENV, "").strip().lower()
    if env in ("0", "false", "no", "off"):
        return False
    if env in ("1", "true", "yes", "on"):
        return True
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


class Progress:
    """One long operation's progress line (see the module's docstring). `total` and the counts
    are items, or bytes with `unit="bytes"`; `total=None` shows only the count and the time;
    `counted=False` (an operation nothing counts, without `poll`) shows the total and the time.
    Thread-safe: `advance()` may be called from any thread."""

    def __init__(self, what: str, total: Optional[int] = None, unit: str = "items", *,
                 poll: Optional[Callable[[], int]] = None, counted: bool = True, enabled: Optional[bool] = None,
                 stream: Optional[TextIO] = None, delay: float = 0.5, interval: float = 0.2) -> None:
        if unit not in ("items", "bytes"):
            raise ValueError(f"Progress unit is 'items' or 'bytes', not {unit!r}")
        self.what, self.total, self.unit = what, total, unit
        self._counted = counted or poll is not None
        self.done = 0
        self._poll = poll
        self._stream = sys.stderr if stream is None else stream
        self.enabled = progress_enabled(self._stream, enabled)
        self._delay, self._interval = float(delay), float(interval)
        self._start = time.monotonic()
        self._shown = False
        self._closed = False
        self._failed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if self.enabled:
            self._thread = threading.Thread(target=self._tick, name="trainstream-progress", daemon=True)
            self._thread.start()

    def advance(self, n: int = 1) -> None:
        """Counts `n` more items (or bytes) done."""
        with self._lock:
            self.done += int(n)

    def _amount(self, n: int) -> str:
        return format_bytes(n) if self.unit == "bytes" else f"{n:,}"

    def _line(self, final: bool) -> str:
        elapsed = time.monotonic() - self._start
        done = self._amount(self.done)
        if not self._counted:  # one blocking call with nothing to count: its size and the time
            text = self.what if self.total is None else f"{self.what}: {self._amount(self.total)}"
        elif self.total is not None:
            pct = f" ({100.0 * self.done / self.total:.0f}%)" if self.total > 0 else ""
            text = f"{self.what}: {done} of {self._amount(self.total)}{pct}"
        else:
            text = f"{self.what}: {done}"
        end = (", failed" if self._failed else ", done") if final else ""
        return f"{text}, {elapsed:.1f} s{end}"

    def _render(self, final: bool) -> None:
        if self._poll is not None:
            try:
                polled = int(self._poll())
            except (OSError, ValueError):
                polled = None
            if polled is not None:
                self.done = max(self.done, min(polled, self.total) if self.total is not None else polled)
        line = self._line(final)
        try:
            self._stream.write("\r\033[K" + line + ("\n" if final else ""))
            self._stream.flush()
        except (OSError, ValueError):
            self.enabled = False  # the terminal went away: stay quiet from now on
        self._shown = True

    def _tick(self) -> None:
        if self._stop.wait(self._delay):
            return
        while True:
            with self._lock:
                if self._closed:
                    return
                self._render(final=False)
            if self._stop.wait(self._interval):
                return

    def close(self, failed: bool = False) -> None:
        """Ends the operation: stops the refresh and, where a line was shown, finishes it
        ("done", or "failed" when `failed`)."""
        self._failed = failed
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.enabled and (self._shown or time.monotonic() - self._start >= self._delay):
                self._render(final=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.close(failed=exc_type is not None)


def track(items: Sequence[T], what: str, size: Optional[Callable[[T], int]] = None, unit: str = "items",
          **kwargs: Any) -> Iterator[T]:
    """Yields `items` with a progress line of them (`size(item)` each, in `unit`, else 1 each);
    the line is finished when the loop ends, or marked failed when it is left early."""
    total = sum(size(x) for x in items) if size is not None else len(items)
    bar = Progress(what, total, unit, **kwargs)
    failed = True
    try:
        for x in items:
            yield x
            bar.advance(size(x) if size is not None else 1)
        failed = False
    finally:
        bar.close(failed=failed)
