"""The schedule of weight paging, as pure functions: which paged block is copied to the device
when, how many are there at once, and how many bytes cross PCIe per optimizer step.

`WeightPager` (paging.weights) follows these rules; `simulate()` plays them for one micro-batch
without a model, so that the schedule can be checked on any machine and the pager's recorded
trace (`WeightPager.trace`) compared with it.

The rules, for the paged blocks `P` of a stack of `count` blocks and a prefetch depth `d`:

* forward: before the model runs, the first `d` paged blocks are fetched; before block `i` runs,
  it must be on the device (fetched now if it is not), and the next `d` paged blocks after `i`
  are fetched; after block `i` ran, it is dropped, except the last paged block when autograd
  records the forward (backward needs it first, so it stays: one crossing saved).
* backward (blocks in reverse order): when block `i`'s backward starts (or its recompute, with
  gradient checkpointing), the paged blocks above it whose backward ran are dropped, block `i`
  is fetched if it is not on the device, and the next `d` paged blocks below `i` are fetched. A
  block recomputed by checkpointing stays between its recompute and its backward (they are one
  use). At the end of the backward every block still on the device is dropped.

So at most `d + 1` paged blocks are on the device at once (the one in use and `d` ahead), and
each paged block crosses twice per micro-batch (forward, backward), except the last paged block
when it is kept from its forward to its backward (`crossings()`).
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

__all__ = ["ahead", "simulate", "crossings", "h2d_bytes_per_micro_batch", "h2d_bytes_per_step",
           "choose_depth", "check_depth", "MAX_DEPTH", "DEPTH_SHARE"]

# The deepest prefetch a run may ask for: more blocks in flight than this buy nothing (the copy
# stream is one queue) and cost a block of VRAM each.
MAX_DEPTH = 8
# prefetch_depth=None picks the largest depth (up to 3) whose in-flight blocks take at most this
# share of the usable VRAM.
DEPTH_SHARE = 0.1


def check_depth(depth: object) -> Optional[int]:
    """Refuses a malformed `prefetch_depth` (None: chosen from the budget; else an int in
    [1, MAX_DEPTH])."""
    if depth is None:
        return None
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"prefetch_depth (paged blocks copied ahead of the one in use) must be None (chosen from the "
                         f"budget) or an int in [1, {MAX_DEPTH}], not {depth!r}")
    return depth


def ahead(paged: Iterable[int], current: int, direction: int, depth: int) -> list[int]:
    """The `depth` paged blocks after `current` in `direction` (+1 forward, -1 backward), nearest
    first. `current` itself is never included; current=-1 forward (or count backward) gives the
    first ones."""
    if direction not in (1, -1):
        raise ValueError(f"direction is +1 (forward) or -1 (backward), not {direction!r}")
    if depth < 1:
        raise ValueError(f"depth must be at least 1, not {depth}")
    if direction > 0:
        order = sorted(i for i in set(paged) if i > current)
    else:
        order = sorted((i for i in set(paged) if i < current), reverse=True)
    return order[:depth]


def simulate(count: int, paged: Iterable[int], depth: int, keep_last: bool = True, backward: bool = True,
             recompute: bool = False) -> list[tuple[str, int]]:
    """One micro-batch of a stack of `count` blocks under the rules of the module docstring: the
    events ("fetch", i), ("use", i) (a forward), ("back", i) (a backward starts) and ("drop", i),
    in order. `keep_last`: autograd records the blocks' forward, so the last paged block stays
    for backward (False for an inference forward, or reentrant checkpointing, whose forward runs
    without grad); `backward`: a backward follows; `recompute`: gradient checkpointing, whose
    recompute of every block (resident ones too) marks its backward's start. Without it, only
    paged blocks mark theirs (the first of their weights autograd reads back)."""
    ps = sorted(set(paged))
    if any(not 0 <= i < count for i in ps):
        raise ValueError(f"paged blocks {ps} are not all in [0, {count})")
    loaded: set[int] = set()
    out: list[tuple[str, int]] = []

    def fetch(i: int) -> None:
        if i not in loaded:
            loaded.add(i)
            out.append(("fetch", i))

    def drop(i: int) -> None:
        if i in loaded:
            loaded.discard(i)
            out.append(("drop", i))

    for i in ahead(ps, -1, 1, depth):
        fetch(i)
    last = ps[-1] if ps else None
    for i in range(count):
        if i in ps:
            fetch(i)
        for j in ahead(ps, i, 1, depth):
            fetch(j)
        out.append(("use", i))
        if i in ps and not (keep_last and i == last):
            drop(i)
    if not backward:
        return out
    started: list[int] = []
    for i in reversed(range(count)):
        if i not in ps and not recompute:
            continue
        out.append(("back", i))
        for j in started:
            drop(j)
        started = []
        if i in ps:
            fetch(i)
            started.append(i)
        for j in ahead(ps, i, -1, depth):
            fetch(j)
    for j in sorted(loaded):
        drop(j)
    return out


def most_in_flight(events: Sequence[tuple[str, int]]) -> int:
    """The most blocks on the device at once in a sequence of ("fetch"/"drop", i) events."""
    now = top = 0
    for kind, _ in events:
        if kind == "fetch":
            now += 1
            top = max(top, now)
        elif kind == "drop":
            now -= 1
    return top


def crossings(paged: Iterable[int], keep_last: bool = True) -> dict[int, int]:
    """Copies to the device of each paged block per micro-batch: 2 (forward, backward; with
    gradient checkpointing the recompute and the backward share the second), 1 for the last
    paged block when it stays from its forward to its backward (`keep_last`)."""
    ps = sorted(set(paged))
    out = {i: 2 for i in ps}
    if ps and keep_last:
        out[ps[-1]] = 1
    return out


def h2d_bytes_per_micro_batch(block_bytes: Sequence[int], paged: Iterable[int], keep_last: bool = True) -> int:
    """Bytes copied host to device for the paged blocks' weights in one forward and backward."""
    return sum(n * int(block_bytes[i]) for i, n in crossings(paged, keep_last).items())


def h2d_bytes_per_step(block_bytes: Sequence[int], paged: Iterable[int], micro_batches: int = 1,
                       keep_last: bool = True) -> int:
    """Bytes copied host to device per optimizer step: crossings x the blocks' bytes x the
    micro-batches of a step (accumulation_steps)."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches is a whole number >= 1, not {micro_batches!r}")
    return micro_batches * h2d_bytes_per_micro_batch(block_bytes, paged, keep_last)


def choose_depth(block_bytes: Sequence[int], usable_vram: Optional[int], most: int = 3) -> int:
    """prefetch_depth=None: the largest depth up to `most` whose depth + 1 largest blocks take at
    most DEPTH_SHARE of the usable VRAM; 1 when there is no VRAM to plan for (a CPU device) or
    not even that fits."""
    if usable_vram is None or not block_bytes:
        return 1
    sizes = sorted((int(b) for b in block_bytes), reverse=True)
    best = 1
    for d in range(1, max(1, most) + 1):
        if sum(sizes[:d + 1]) <= math.floor(usable_vram * DEPTH_SHARE):
            best = d
    return best
