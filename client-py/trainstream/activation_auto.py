"""`activation_offload="auto"` after its first decision: the blocks it paged (or recomputes) that
the settled plan has room for keep their activations on the device again, once.

The decision after the first step (`optim.decide_activation_offload`) pages for a peak it could
only estimate. When the first step began paging by itself, it keeps as many bytes paged as that
step did (the weight planner answers for the measured peak's excess), and that step's target held a
reserve for the language model's head taken before any logits existed. Measured on the H100
(Qwen2.5-1.5B, 8x512, a 16 GiB cap): 27 of 28 blocks paged, 10.97 GiB out and back every step, for a
peak of 10.34 GiB of the 14.40 GiB usable. The 3.3 GiB left idle would have held 8 of those blocks,
about 7 GB less host-memory and PCIe traffic per step, and the forward waited on those copies.

So once the memory plan has settled (`param_offload="auto"`: the weight planner `done`) and a step
has run with the pages, the measured peak's room under the usable VRAM less the planner's margin
takes back the last paged blocks (made last, needed first in backward) whose saved bytes fit in it
(`planner.activations_to_keep`). It decides once. The GPU share (`optimizer_gpu_fraction="auto"`)
decides after it, with one step measured with the new pages (share_auto.py). Results are bit-
identical either way: paging moves the saved tensors, it does not change them.

With `activation_recompute="auto"` (the default) the first decision recomputes the blocks it
would page (`optim.recompute_first`), and this refinement stops recomputing the last of them the
settled peak has room for, by the same rule; a block whose forward updates state stays paged.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from . import planner
from .blockplan import MARGIN
from .paging.activations import page_blocks, trim_pages_host
from .paging.recompute import recompute_blocks, state_in_forward, stop_recomputing

if TYPE_CHECKING:
    from .engine import Session

__all__ = ["Refine", "changed", "maybe_refine", "settled", "stateful"]


@dataclasses.dataclass
class Refine:
    """What the decision after the first step leaves for the refinement: the model's block stack
    (`name`, `blocks`), the blocks it took off the device (`chosen`, indices into `blocks`: paged,
    or recomputed when `recomputing`), the bytes each block saved (the profiler's measurement), the
    pager's `min_bytes`, the pager it installed for them (None when recomputing) and the step after
    which it did (`after_step`)."""

    model: nn.Module
    name: Optional[str]
    blocks: list[nn.Module]
    chosen: list[int]
    block_bytes: list[int]
    min_bytes: int
    pager: Any
    after_step: int
    recomputing: bool = False  # activation_recompute="auto": `chosen` are recomputed, not paged


def changed(session: "Session") -> None:
    """Records that what is paged or recomputed changed after this step: torch's peak restarts so
    that the next step measures the new layout, the weight planner (param_offload="auto") refines
    its settled plan again from that step, and the decisions made from a measured peak wait for
    it (`settled`; the GPU share and offload="auto"'s switch also wait for the weight plan to
    settle again)."""
    session.activations_changed_at = session.steps
    if session.cuda and session.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(session.device)
    weights_plan = getattr(session, "planner", None)
    if weights_plan is not None and hasattr(weights_plan, "remeasure"):
        # The weight plan was settled with the old layout: it refines again (blockplan.remeasure).
        weights_plan.remeasure(f"activation_offload=auto changed what is paged or recomputed after step "
                               f"{session.steps}")
        session.events.extend(weights_plan.take_events())


def settled(session: "Session") -> bool:
    """Whether the last step's measured peak is the settled activations': the decision after the
    first step and the refinement are made, and a step has run since either changed anything.
    Before, the GPU share (share_auto) and offload="auto"'s switch wait: measured on the H100
    (Qwen2.5-7B, 4x512, a 32 GiB cap), the share took the 9.1 GiB of room the step before had left
    while the refinement gave 8.9 GiB of it to blocks whose activations came back, and the next
    forward ran out of VRAM."""
    return session.act_refine is None and session.steps > session.activations_changed_at


def stateful(blocks: list[nn.Module], indices: list[int]) -> str:
    """Why blocks `indices` of `blocks` must not be recomputed ("" if nothing says so): the first
    whose forward updates state a recompute would update twice a step (recompute.state_in_forward)."""
    for i in indices:
        what = state_in_forward(blocks[i])
        if what:
            return f"block {i}'s {what} would be updated twice a step"
    return ""


def maybe_refine(session: "Session") -> None:
    """After a step: brings back the paged (or recomputed) blocks the measured peak leaves room
    for, when a step has run with them and the weight plan (if any) has settled; else waits for the
    next step. Decides once; a pager installed since, or recomputes changed, by anything else
    cancels it."""
    pending: Optional[Refine] = getattr(session, "act_refine", None)
    if pending is None:
        return
    if pending.recomputing:
        done = session.recompute
        if done is None or not set(pending.chosen) <= set(done.indices):
            session.act_refine = None  # the recomputes were changed by something else
            return
    elif session.act_pager is not pending.pager:
        session.act_refine = None  # the pages were changed by something else: nothing to refine
        return
    weights_plan = getattr(session, "planner", None)
    if weights_plan is not None and not getattr(weights_plan, "done", False):
        return  # the weight planner is still moving blocks: its peak is not the run's yet
    if session.steps <= pending.after_step:
        return  # no step has run with the pages yet
    session.act_refine = None
    budget, peak = session.measured_vram()
    usable = budget.vram_usable
    if usable is None:
        return
    kept, back, why = planner.activations_to_keep(peak, usable, pending.chosen, pending.block_bytes, MARGIN,
                                                  recomputed=pending.recomputing)
    head = f"activation_offload=auto after step {session.steps}: {why}"
    if pending.recomputing:
        _recompute_fewer(session, pending, back, head)
        return
    recompute = bool(kept) and getattr(session, "recompute_auto", False)
    unsafe = stateful(pending.blocks, kept) if recompute else ""
    if unsafe:
        # Recomputing such a block would update its state twice a step: the pages stay.
        session.events.append(f"activation_recompute=auto: the paged blocks stay paged, not recomputed: {unsafe}")
        recompute = False
    if not back and not recompute:
        session.events.append(f"{head}; the pages stay as they are")
        return
    old: Any = pending.pager
    session.act_pager = None
    old.remove()
    changed(session)
    if recompute:
        recompute_blocks(session, pending.blocks, kept, why=f" (activation_recompute=auto: instead of paging them; {head})")
        kept = []
    elif kept:
        page_blocks(session, pending.model, pending.name, pending.blocks, kept, why=f" ({head})",
                    min_bytes=pending.min_bytes)
    else:
        session.events.append(f"{head}; no block's activations are paged from now on")
    session.activation_host_bytes = sum(pending.block_bytes[i] for i in kept)
    trim_pages_host(session, session.activation_host_bytes, "fewer blocks paged after the refinement")


def _recompute_fewer(session: "Session", pending: Refine, back: list[int], head: str) -> None:
    """The refinement of blocks the first decision recomputes: those of them the settled peak has
    room for (`back`) keep their saved activations from the next step on; the rest stay recomputed."""
    if not back:
        session.events.append(f"{head}; the recomputed blocks stay recomputed")
        return
    changed(session)
    stop_recomputing(session, back, why=f" ({head})")
