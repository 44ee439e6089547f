"""Sizes and dtypes, read the same way on both sides of the C++/Python line.

* Sizes: `parse_bytes("8GiB")` reads what tsd's settings read (daemon/ops/config.cc's ParseSize):
  IEC units are binary (`KiB`, `MiB`, `GiB`, `TiB`: powers of 1024), SI units are decimal (`KB`,
  `MB`, `GB`, `TB`: powers of 1000), a bare `K`/`M`/`G`/`T` is binary, as tsd reads it; case does
  not matter. tests/python/test_units.py checks the table against the daemon itself.
* Dtypes: the names and sizes of the dtypes tsd's optimizer takes come from the extension
  (`trainstream._C.DTYPES`, built from the C++ client's table), and so do the page size and the
  control page's size (`control_page_bytes()`).
"""
from __future__ import annotations

import re
from typing import Union

import torch

from . import _C  # type: ignore[attr-defined]  # the pybind11 extension

Size = Union[int, str, None]  # bytes, or e.g. "8GiB"

# Units of a size, lower-cased, as tsd's ParseSize takes them.
UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_MAX_BYTES = 1.8e19  # tsd refuses sizes at or above this (they do not fit in 64 bits)

# The page size tsd rounds every region to.
PAGE_BYTES: int = int(_C.PAGE_BYTES)

# name -> bytes per element, for the dtypes tsd's optimizer takes ("float32", "bfloat16", "float16").
DTYPE_BYTES: dict[str, int] = {str(k): int(v) for k, v in _C.DTYPES.items()}
# torch dtype -> tsd's name for it.
TSD_DTYPES: dict[torch.dtype, str] = {getattr(torch, name): name for name in DTYPE_BYTES}
# What wrap(moment_dtype=...) and wrap(param_dtype=...) accept, to tsd's names.
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
MOMENT_DTYPES = ("float32", "bfloat16")


def control_page_bytes(groups: int, buckets: int) -> int:
    """The size of an optimizer's control page (proto/control_page.h), before page rounding."""
    if groups < 0 or buckets < 0:
        raise ValueError(f"groups and buckets are counts >= 0, not {groups}, {buckets}")
    return int(_C.control_page_bytes(groups, buckets))


def parse_bytes(value: Size) -> int:
    """Bytes from an int or a string such as "8GiB", "512MiB", "1.5G", "2GB" (as tsd's settings
    read them: `GiB` and a bare `G` are 2**30, `GB` is 10**9). None is 0."""
    if value is None:
        return 0
    if isinstance(value, bool):
        raise TypeError(f"a size is bytes (an int) or a string such as '8GiB', not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return value
    if not isinstance(value, str):
        raise TypeError(f"a size is bytes (an int) or a string such as '8GiB', not {type(value).__name__}")
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*", value)
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"cannot read {value!r} as a size: use bytes or a number with one of the units B, KiB, "
                         f"MiB, GiB, TiB (binary; K, M, G, T alone too) or KB, MB, GB, TB (decimal), e.g. '8GiB'")
    n = float(m.group(1)) * UNITS[m.group(2).lower()]
    if n >= _MAX_BYTES:
        raise ValueError(f"the size {value!r} is too large")
    return int(n)


def format_bytes(n: int) -> str:
    """Human-readable bytes for messages: "1.50 GiB", "512.00 MiB", "4096 B"."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def tsd_dtype(dtype: Union[str, torch.dtype], what: str = "dtype") -> str:
    """tsd's name of a dtype its optimizer takes, from a torch dtype, a name or an alias
    ("bf16", "fp32", "fp16"). Anything else is a ValueError naming what is accepted."""
    if isinstance(dtype, torch.dtype):
        name = TSD_DTYPES.get(dtype)
    else:
        name = _ALIASES.get(str(dtype), str(dtype))
        name = name if name in DTYPE_BYTES else None
    if name is None:
        raise ValueError(f"{what} must be one of {', '.join(DTYPE_BYTES)} (or the torch dtypes), not {dtype!r}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of one of tsd's dtype names."""
    return getattr(torch, tsd_dtype(name))


def block_ranges(indices: list[int]) -> str:
    """Block indices as ranges, for messages: [0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, x in enumerate(indices):
        if start is None:
            start = x
        if i + 1 == len(indices) or indices[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x != start else f"{x}")
            start = None
    return ", ".join(out)
