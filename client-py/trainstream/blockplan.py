"""The block planner of weight paging (`wrap(param_offload="auto")`): which blocks of the model's
repeated stack keep their weights in VRAM and which are paged from tsd's memory.

`MemoryPlanner` is pure arithmetic on bytes; it measures nothing and moves nothing. The weight
pager (`trainstream.paging.weights`) asks it three things:

* `initial_paged()`: before the first step, from the budget alone. The usable VRAM (the budget's
  `vram_usable`, at most `VRAM_HEADROOM` of `vram_total`) less what stays outside the blocks
  (`fixed_vram`: embeddings, head, what the device already holds, cuBLAS's workspaces), less what is in flight
  (`inflight_bytes`: a block's gradients on their way to tsd), less a reserve for the
  activations (`ACTIVATION_RESERVE` of the usable VRAM: the first step has not measured them yet)
  is what the resident blocks may take. When some blocks are paged, `depth + 1` of them are on
  the device at once (the one in use and the ones prefetched), so that much is set aside too. The
  paged blocks are spread evenly over the stack (`spread`), so that every copy has a few resident
  blocks' compute to hide behind.
* `refine(peak, paged)`: after each of the first steps, from the step's measured peak. With
  headroom (the peak plus a block stays under the target, `MARGIN` below the usable VRAM) it
  moves as many blocks into VRAM as fit; over the target it pages the fewest blocks that bring
  the peak back under it; otherwise the step is steady. Two steady steps in a row settle the plan
  (`done`).
* `watch(peak, paged)`: once settled, the watchdog: when a later step peaks over the target (a
  longer sequence, a larger batch), it pages one more block per step.
* `remeasure(why)`: what the activations hold changed (activation_offload="auto"'s refinement
  brought pages back or recomputes them): the plan refines again from the next step's peak, as
  after the first steps, and settles again.

Every decision is appended to `events` as a sentence (the session moves them to its own log),
with the PCIe traffic the plan costs: `h2d_bytes_per_step(paged)`, each paged block's crossings
per micro-batch (`paging.schedule.crossings`: forward and backward, once for the last paged
block) times its bytes times the micro-batches of an optimizer step (accumulation_steps).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Sequence

from .paging import schedule
from .units import block_ranges, format_bytes

if TYPE_CHECKING:  # planner.py re-exports this module's names: no import of it at load time
    from .planner import Budget

__all__ = ["MemoryPlanner", "spread", "ACTIVATION_RESERVE", "MARGIN"]

# The share of the usable VRAM the initial plan keeps for activations it has not measured yet.
ACTIVATION_RESERVE = 0.25
# The target of refinement and of the watchdog: this share of the usable VRAM stays free.
MARGIN = 0.05
# Steady steps in a row that settle the plan.
STEADY_STEPS = 2


def spread(n: int, indices: Sequence[int]) -> list[int]:
    """`n` of `indices`, evenly spaced over them (sorted): spread(4, range(16)) == [0, 4, 8, 12].
    n <= 0 gives [], n >= len(indices) all of them."""
    pool = sorted(indices)
    if n <= 0 or not pool:
        return []
    if n >= len(pool):
        return pool
    step = len(pool) / n
    return [pool[int(k * step)] for k in range(n)]


class MemoryPlanner:
    """Decides which blocks are paged; see the module docstring. `block_bytes[i]` is the VRAM
    block i's weights take when resident; `fixed_vram` what the run holds outside the blocks;
    `inflight_bytes` what is in flight besides (gradients on their way to tsd); `depth` how many
    paged blocks are prefetched ahead of the one in use; `micro_batches` the forward and backward
    passes per optimizer step. `done` is True once the plan settled (settable: a test or a
    caller may declare it settled). `steady` counts steady steps."""

    def __init__(self, budget: "Budget", block_bytes: Sequence[int], fixed_vram: int = 0, inflight_bytes: int = 0,
                 depth: int = 1, micro_batches: int = 1) -> None:
        if not block_bytes:
            raise ValueError("the planner needs the bytes of at least one block")
        if any(int(b) < 0 for b in block_bytes) or fixed_vram < 0 or inflight_bytes < 0:
            raise ValueError("block_bytes, fixed_vram and inflight_bytes are bytes (>= 0)")
        if depth < 1:
            raise ValueError(f"depth (paged blocks prefetched ahead) must be at least 1, not {depth}")
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches (accumulation_steps) must be a whole number >= 1, not {micro_batches!r}")
        from .planner import VRAM_HEADROOM

        limits = [x for x in (budget.vram_usable,
                              None if budget.vram_total is None else int(budget.vram_total * VRAM_HEADROOM))
                  if x is not None]
        if not limits:
            raise ValueError("the budget has no VRAM (vram_usable or vram_total): weight paging plans for a GPU")
        self.budget = budget
        self.usable = min(limits)
        self.block_bytes = [int(b) for b in block_bytes]
        self.fixed_vram = int(fixed_vram)
        self.inflight_bytes = int(inflight_bytes)
        self.depth = int(depth)
        self.micro_batches = micro_batches
        self.target = self.usable - round(self.usable * MARGIN)
        self.done = False
        self.steady = 0
        self.steps = 0
        self.settled_peak: Optional[int] = None
        self.events: list[str] = []

    # ---- arithmetic
    @property
    def count(self) -> int:
        return len(self.block_bytes)

    def buffers(self, paged: set[int]) -> int:
        """VRAM the paged blocks take while in use and prefetched: the largest depth + 1 of them."""
        if not paged:
            return 0
        sizes = sorted((self.block_bytes[i] for i in paged), reverse=True)
        return sum(sizes[:self.depth + 1])

    def resident_bytes(self, paged: set[int]) -> int:
        return sum(b for i, b in enumerate(self.block_bytes) if i not in paged)

    def h2d_bytes_per_step(self, paged: set[int]) -> int:
        """PCIe bytes (host to device) per optimizer step with `paged` paged."""
        return schedule.h2d_bytes_per_step(self.block_bytes, paged, self.micro_batches)

    def describe(self, paged: set[int]) -> str:
        n = self.count
        out = (f"{n - len(paged)} of {n} blocks resident ({format_bytes(self.resident_bytes(paged))}), "
               f"{len(paged)} paged{' (' + block_ranges(sorted(paged)) + ')' if paged else ''}")
        if paged:
            per_mb = schedule.h2d_bytes_per_micro_batch(self.block_bytes, paged)
            out += (f", {format_bytes(self.h2d_bytes_per_step(paged))} H2D per step ({format_bytes(per_mb)} per "
                    f"micro-batch x {self.micro_batches}: 2 crossings per paged block, 1 for the last; prefetch "
                    f"depth {self.depth})")
        return out

    # ---- decisions
    def initial_paged(self) -> set[int]:
        """The plan before any step: as many blocks resident as fit beside the fixed part, what is
        in flight and the activation reserve; the rest paged, spread evenly."""
        room = self.usable - self.fixed_vram - self.inflight_bytes - int(self.usable * ACTIVATION_RESERVE)
        everything = list(range(self.count))
        if self.resident_bytes(set()) <= room:
            paged: set[int] = set()
        else:
            paged = set(everything)
            for k in range(1, self.count + 1):  # the fewest paged blocks whose plan fits
                cand = set(spread(k, everything))
                if self.resident_bytes(cand) + self.buffers(cand) <= room:
                    paged = cand
                    break
        self.events.append(f"memory plan: {self.describe(paged)}, from the budget: usable VRAM "
                           f"{format_bytes(self.usable)}, {format_bytes(self.fixed_vram)} outside the blocks, "
                           f"{format_bytes(self.inflight_bytes)} in flight, "
                           f"{format_bytes(int(self.usable * ACTIVATION_RESERVE))} kept for activations; refined "
                           f"from the first steps' peaks")
        return paged

    def probe_paged(self, planned: set[int]) -> set[int]:
        """The blocks paged in the first step. When the budget's plan pages nothing, that plan.
        Otherwise every block: the activation reserve is a guess (nothing says how large a batch
        comes), and a first step that runs out of memory ends the run, while one with every block
        paged measures the activations beside the fewest resident weights; `refine` then moves in
        as many blocks as that measured peak leaves room for."""
        if not planned:
            return set()
        everything = set(range(self.count))
        if planned != everything:
            self.events.append(f"memory plan: the first step pages all {self.count} blocks to measure the "
                               f"activations safely (the budget's plan kept {self.count - len(planned)} resident); "
                               f"the next steps move blocks back by the measured peak")
        return everything

    def _estimate(self, peak: int, paged: set[int], new: set[int]) -> int:
        """The peak a step would reach with `new` paged, from one measured with `paged`. The
        resident blocks' difference counts in full. Of the paged blocks' copies in flight, only an
        increase is charged: the measured peak held at most `buffers(paged)` of them and maybe
        fewer (a peak at the loss, between the forward's last paged block and the backward's first,
        may hold one or none), so a plan with fewer copies in flight is not credited the
        difference. Crediting it would overestimate the room by up to depth + 1 blocks exactly when
        the last paged blocks move in."""
        return (peak - self.resident_bytes(paged) + self.resident_bytes(new)
                + max(0, self.buffers(new) - self.buffers(paged)))

    def _move_in(self, peak: int, paged: set[int]) -> set[int]:
        """The smallest subset of `paged` (spread over it) that keeps the estimate under the target."""
        order = sorted(paged)
        for keep in range(0, len(order)):
            cand = set(spread(keep, order))
            if self._estimate(peak, paged, cand) <= self.target:
                return cand
        return set(paged)

    def _page_out(self, peak: int, paged: set[int], at_most: Optional[int] = None) -> set[int]:
        """`paged` plus the fewest resident blocks (spread over them) that bring the estimate
        under the target (at most `at_most` more)."""
        resident = [i for i in range(self.count) if i not in paged]
        limit = len(resident) if at_most is None else min(at_most, len(resident))
        cand = set(paged)
        for extra in range(1, limit + 1):
            cand = set(paged) | set(spread(extra, resident))
            if self._estimate(peak, paged, cand) <= self.target:
                return cand
        return cand

    def refine(self, peak: int, paged: set[int]) -> Optional[set[int]]:
        """After a step of the first ones: the new paged set, or None when the step was steady
        (the plan stays). Two steady steps in a row set `done`."""
        paged = set(paged)
        self.steps += 1
        new: Optional[set[int]] = None
        if peak > self.target:
            cand = self._page_out(peak, paged)
            if cand != paged:
                new = cand
                why = f"step {self.steps} peaked at {format_bytes(peak)} > target {format_bytes(self.target)}"
        elif paged:
            cand = self._move_in(peak, paged)
            if cand != paged:
                new = cand
                why = (f"step {self.steps} peaked at {format_bytes(peak)}: headroom under the target "
                       f"{format_bytes(self.target)}")
        if new is not None:
            self.steady = 0
            self.events.append(f"memory plan refined: {self.describe(new)} ({why})")
            return new
        self.steady += 1
        if self.steady >= STEADY_STEPS and not self.done:
            self.done = True
            self.settled_peak = peak
            self.events.append(f"memory plan settled: {self.describe(paged)}; step {self.steps} peaked at "
                               f"{format_bytes(peak)} of {format_bytes(self.usable)} usable VRAM")
        return None

    def watch(self, peak: int, paged: set[int]) -> Optional[set[int]]:
        """Once settled: when a step peaks over the target, one more block is paged (None: no change)."""
        paged = set(paged)
        self.steps += 1
        if peak <= self.target:
            return None
        new = self._page_out(peak, paged, at_most=1)
        if new == paged:
            self.events.append(f"memory watchdog: step {self.steps} peaked at {format_bytes(peak)} > target "
                               f"{format_bytes(self.target)} and every block is already paged; lower the batch or "
                               f"sequence length, or page activations (activation_offload=)")
            return None
        added = sorted(new - paged)
        self.events.append(f"memory watchdog: step {self.steps} peaked at {format_bytes(peak)} > target "
                           f"{format_bytes(self.target)}: paged block {', '.join(map(str, added))}; "
                           f"{self.describe(new)}")
        return new

    def remeasure(self, why: str) -> None:
        """Something besides the weights changed what the steps hold in VRAM (`why`): a settled plan
        goes back to refining, so that the next step's peak moves as many blocks as it needs at
        once, then settles again. The watchdog would page one block per step: measured on the H100
        (Qwen2.5-1.5B, 8x512, a 12 GiB cap), recomputing 27 blocks instead of paging their
        activations raised the peak, and the watchdog paged four more blocks, one step at a time,
        each move then waiting in `step()` for every update tsd owed the model."""
        if not self.done:
            return
        self.done = False
        self.steady = 0
        self.events.append(f"memory plan: measured again from the next step ({why}); it may move several blocks at "
                           f"once, then settles again")

    def observe(self, peak: int, paged: set[int]) -> Optional[set[int]]:
        """`refine` until the plan settled, the watchdog after."""
        return self.watch(peak, paged) if self.done else self.refine(peak, paged)

    def take_events(self) -> list[str]:
        out, self.events = self.events, []
        return out


def fraction_paged(fraction: float, count: int) -> list[int]:
    """The blocks a `param_offload` fraction pages: ceil(fraction * count), spread evenly."""
    if isinstance(fraction, bool) or not 0.0 < float(fraction) <= 1.0 or not math.isfinite(float(fraction)):
        raise ValueError(f"param_offload as a fraction must be in (0, 1], not {fraction!r}")
    return spread(min(count, math.ceil(float(fraction) * count)), range(count))
