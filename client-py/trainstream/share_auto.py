"""`wrap(optimizer_gpu_fraction="auto")`: the GPU share chosen from a measured step.

At wrap() the share's VRAM would have to be guessed before any activation exists: the weights are
known, the activations are not (they depend on the batch, the sequence, the loss, checkpointing
and paging). A fixed reserve for them was measured wrong by a factor of two on Qwen2.5-1.5B 8x512
(the run peaks at 18.2 GiB with 6 GiB of it expected), and the first forward ran out of VRAM. So
"auto" registers every parameter in tsd, lets the first step run there, and only then, from the
step's measured VRAM peak, moves the optimizer of the parameters that fit into the GPU share:

- the room is the usable VRAM less the measured peak less `blockplan.MARGIN` of it (the margin
  the block planner keeps), and the share takes the last-finishing parameters that fit in it,
  passing over one that does not (a tied embedding larger than the room, first in line) for the
  next ones, each costing what `gpushare.vram_cost` counts (its fp32 moments, fp32 gradient and, for a
  working copy that is not fp32, its master) -- the same choice `gpushare.choose` makes;
- the moved parameters' masters, moments and step counts come from a snapshot of just their
  buckets (the daemon's save_state with a bucket list), so the
  run goes on exactly (torch's AdamW from then on for them: within 1e-6 of tsd's, not bitwise);
  tsd stops receiving their gradients and retires their buckets (the daemon's retire_buckets:
  it refuses their deliveries from then on and returns the pages of their moments, accumulator
  and, where the working copy is not fp32, masters to the pool; their gradient and parameter
  slots stay, mapped and pinned by this process), and the share's gradient norm joins tsd's commit through the norm bucket wrap()
  registered for this;
- when every parameter fits, it is `offload="auto"`'s switch (`optim.switch_to_device`): the job's
  memory in tsd is released;
- the decision waits for a step whose memory plan is settled: the weight planner
  (`param_offload="auto"`) done, `activation_offload="auto"`'s pages refined (activation_auto.py),
  and, where it began paging or changed what it pages or recomputes after the step before, one
  more step measured with that (torch's peak is reset for it; `activation_auto.settled`).

Data parallel keeps the estimate at wrap() (`gpushare.vram_room`): the node's ranks share one
registration and agree on the share before it exists.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from . import activation_auto, gpushare
from .blockplan import MARGIN
from .paging.activations import ActivationProfiler
from .units import format_bytes

if TYPE_CHECKING:
    from .engine import Session
    from .optim import TsdAdamW

__all__ = ["Pending", "maybe_decide"]


@dataclasses.dataclass
class Pending:
    """What wrap() left for the decision: the trainable parameters with their working copies'
    bytes per element in wrap()'s bucket order, the ids that must stay in tsd (pageable blocks),
    the moment dtype the host-time estimate assumes, and the step after which activation_offload's
    change it last said it waits for."""

    trainable: Sequence[tuple[torch.Tensor, int]]
    excluded: frozenset[int]
    moment_dtype: str
    told_wait: int = -1


def maybe_decide(opt: "TsdAdamW") -> None:
    """After a step: decides "auto"'s share when the step's memory plan was settled (see the module
    docstring), else waits for the next step. Decides once."""
    s = opt._session
    pending: Optional[Pending] = s.auto_share
    if pending is None or not s.offloading:
        s.auto_share = None
        return
    if s.planner is not None and not getattr(s.planner, "done", False):
        return  # the weight planner is still moving blocks: its peak is not the run's yet
    if isinstance(s.act_pager, ActivationProfiler) or s.act_refine is not None:
        return  # activation_offload="auto" has not decided yet, or will bring pages back first
    if not activation_auto.settled(s):
        # It changed what is paged or recomputed after this step: measure one step with it.
        if pending.told_wait != s.activations_changed_at:
            pending.told_wait = s.activations_changed_at
            s.events.append(f"optimizer_gpu_fraction=auto: decides after the next step (activation_offload=auto "
                            f"changed what is paged or recomputed after step {s.activations_changed_at}; the peak "
                            f"with it is measured first)")
        return
    s.auto_share = None
    budget, peak = s.measured_vram()
    usable = budget.vram_usable
    if usable is None:
        s.events.append("optimizer_gpu_fraction=auto: no VRAM budget (the device is the CPU): everything stays in tsd")
        return
    room = max(0, usable - peak - int(usable * MARGIN))
    in_tsd = [(p, w) for p, w in pending.trainable if id(p) in s.by_param]
    choice = gpushare.choose("auto", in_tsd, room, pending.excluded, pending.moment_dtype, prefix=False)
    measured = (f"after step {s.steps}: measured peak {format_bytes(peak)} of {format_bytes(usable)} usable VRAM, "
                f"{format_bytes(room)} left less a {MARGIN:.0%} margin")
    if not choice.ids:
        s.events.append(f"optimizer_gpu_fraction=auto {measured}: no parameter's optimizer fits there; "
                        f"everything stays in tsd")
        return
    if len(choice.ids) == len(in_tsd):
        from .optim import switch_to_device  # the switch of offload="auto" (optim imports this module)
        switch_to_device(opt, f"optimizer_gpu_fraction=auto {measured}: every parameter's optimizer fits")
        return
    move(opt, choice.ids)
    left = choice.total - choice.numel
    host_s = left * gpushare.host_bytes_per_param(pending.moment_dtype) / gpushare.host_bandwidth()
    s.events.append(f"optimizer_gpu_fraction=auto {measured}: moved {choice.numel:,} of the {choice.total:,} "
                    f"parameters tsd held ({choice.numel / max(1, choice.total):.0%}) to the device, "
                    f"{format_bytes(choice.vram_bytes)} of VRAM; tsd's share takes about {host_s * 1e3:.1f} ms of "
                    f"host time per step"
                    + (f"; passed over {choice.passed} tensors too large for that room" if choice.passed else ""))


def move(opt: "TsdAdamW", ids: frozenset[int]) -> None:
    """Moves the optimizer of the parameters in `ids` (tsd buckets, none paged) into the GPU share,
    with their state as tsd has it now; tsd takes no more gradients for them."""
    s: "Session" = opt._session
    moving = [ps for ps in s.params if id(ps.param) in ids and ps.bucket not in s.moved]
    # Only their state: a whole snapshot of a 7B job would be 84 GB of file for a few GB moved.
    per_bucket = s.read_state([ps.bucket for ps in moving])  # waits for every update first (idle)
    assert not any(ps.paged for ps in moving), "a paged parameter's only copy is its tsd slot"
    if s.share is None:
        s.share = gpushare.GpuShare(s.device, len(opt.param_groups))
    items = []
    for ps in moving:
        if ps.hook is not None:
            ps.hook.remove()
            ps.hook = None
        s.by_param.pop(id(ps.param), None)
        s.moved.add(ps.bucket)
        master, m, v, step = per_bucket[ps.bucket]
        items.append((ps.param, ps.group, ps.index, master, m, v, step))
    s.share.adopt(items, opt.param_groups)
    for ps in moving:
        s.share.by_param[id(ps.param)].orig_dtype = ps.orig_dtype  # unwrap() gives that back
    s.share.hook_gradients()
    opt._share_state()
    # tsd takes no more gradients for them: it gives their moments' memory back to the pool.
    released, _ = s.handle.retire_buckets(sorted(ps.bucket for ps in moving))
    s.retired_bytes += int(released)
    s.events.append(f"optimizer_gpu_fraction=auto: tsd retired the {len(moving)} moved buckets and returned "
                    f"{format_bytes(int(released))} of host memory to the pool")
