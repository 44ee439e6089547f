"""Durations as tsd's options take them: a number of seconds, or text such as "10m", "30s",
"1h", "500ms" or "1h30m" (the daemon's own settings read the same forms)."""
from __future__ import annotations

import math
import numbers
import re
from typing import Optional, Union

Duration = Union[int, float, str, None]  # seconds, or e.g. "10m"

_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)")


def parse_duration(value: Duration, what: str = "duration") -> float:
    """Seconds in `value` (None: 0). Raises ValueError, saying what forms are accepted, for a
    negative, non-finite or unreadable value."""
    if value is None:
        return 0.0
    if isinstance(value, bool):
        raise ValueError(f"{what} must be seconds or a duration such as '10m', not {value!r}")
    if isinstance(value, numbers.Real):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        seconds = _parse_text(text)
        if seconds is None:
            raise ValueError(f"{what}={value!r} is not a duration: write seconds (600) or e.g. '10m', '30s', '1h', "
                             f"'500ms', '1h30m'")
    else:
        raise ValueError(f"{what} must be seconds or a duration such as '10m', not {type(value).__name__}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what}={value!r} must be a finite duration >= 0")
    return seconds


def _parse_text(text: str) -> Optional[float]:
    if not text:
        return None
    try:
        return float(text)  # plain seconds, as text
    except ValueError:
        pass
    total, at = 0.0, 0
    for m in _PART.finditer(text):
        if m.start() != at:
            return None
        total += float(m.group(1)) * _UNITS[m.group(2)]
        at = m.end()
    return total if at == len(text) else None
