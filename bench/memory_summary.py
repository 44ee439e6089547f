#!/usr/bin/env python3
"""What held the GPU's memory when a run failed: a short text summary of a CUDA allocator snapshot
(`torch.cuda.memory._dump_snapshot`, as `finetune_bench.py` writes with
`TSD_BENCH_MEMORY_HISTORY=DIR`), small enough to read in a call's output when the snapshot itself is
too large to bring back from the GPU machine.

    python3 bench/memory_summary.py SNAPSHOT.pickle [--top 25] [--trace 40]

It prints the live (allocated) memory grouped by the innermost Python frame of the code that
allocated it (the frames of torch's own modules are skipped, so the line is the model's or
trainstream's), the largest groups first, with the count and sizes of their blocks; then the last
allocator events before the failure (allocations, frees, the out-of-memory), each with its frame.
"""
from __future__ import annotations

import argparse
import pickle
from collections import defaultdict
from typing import Any, Iterable, Optional

# Frames in these paths are torch's machinery, not the code that asked for the memory.
_SKIP = ("/torch/", "/contextlib.py", "/functools.py")


def frame_of(frames: Iterable[dict[str, Any]], depth: int = 1) -> str:
    """The `depth` innermost frames outside torch's own modules, as "file:line name"."""
    out: list[str] = []
    for f in frames or ():
        name = str(f.get("filename", "??"))
        if not name.endswith(".py") or any(s in name for s in _SKIP):  # C++ frames, torch's modules
            continue
        short = "/".join(name.split("/")[-2:])
        out.append(f"{short}:{f.get('line', 0)} {f.get('name', '')}")
        if len(out) == depth:
            break
    return " < ".join(out) if out else "(no Python frame)"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def summarize(snapshot: dict[str, Any], top: int = 25, trace: int = 40, depth: int = 2,
              device: Optional[int] = None) -> str:
    """The summary of `snapshot` as text (see the module docstring)."""
    lines: list[str] = []
    groups: dict[str, list[int]] = defaultdict(list)
    reserved = active = 0
    for seg in snapshot.get("segments", []):
        if device is not None and seg.get("device") != device:
            continue
        reserved += int(seg.get("total_size", 0))
        for blk in seg.get("blocks", []):
            if blk.get("state") != "active_allocated":
                continue
            size = int(blk.get("size", 0))
            active += size
            groups[frame_of(blk.get("frames", []), depth)].append(size)
    lines.append(f"reserved {_mib(reserved)}, allocated {_mib(active)} in "
                 f"{sum(len(v) for v in groups.values())} blocks")
    lines.append("live memory by where it was allocated (largest first):")
    ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    for where, sizes in ranked[:top]:
        lines.append(f"  {_mib(sum(sizes)):>14}  {len(sizes):5d} x (max {_mib(max(sizes))})  {where}")
    rest = ranked[top:]
    if rest:
        lines.append(f"  {_mib(sum(sum(v) for _, v in rest)):>14}  in {len(rest)} more places")
    traces = snapshot.get("device_traces", [])
    for dev, events in enumerate(traces):
        if device is not None and dev != device or not events:
            continue
        lines.append(f"the last {min(trace, len(events))} of {len(events)} allocator events on device {dev}:")
        for e in events[-trace:]:
            lines.append(f"  {e.get('action', '?'):>14} {_mib(int(e.get('size', 0))):>12}  "
                         f"{frame_of(e.get('frames', []), depth)}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("snapshot", help="a pickle written by torch.cuda.memory._dump_snapshot")
    ap.add_argument("--top", type=int, default=25, help="places to list (default 25)")
    ap.add_argument("--trace", type=int, default=40, help="last allocator events to list (default 40)")
    ap.add_argument("--depth", type=int, default=2, help="frames outside torch per place (default 2)")
    a = ap.parse_args()
    with open(a.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    print(summarize(snapshot, a.top, a.trace, a.depth))


if __name__ == "__main__":
    main()
