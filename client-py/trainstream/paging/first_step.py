"""The first forward's head check of weight paging (`param_offload="auto"`).

The block planner's first plan is made at `wrap()`, before any batch is seen: beside the weights it
keeps a reserve for activations (`blockplan.ACTIVATION_RESERVE`, a quarter of the usable VRAM).
A language model's output head and loss do not fit such a guess: their logits take tokens x
vocabulary x `HEAD_BYTES_PER_LOGIT` bytes at the end of the forward (5.8 GiB for Qwen2.5 at 8x512),
and with every block's weights resident a run under an 8 GiB cap ran out of VRAM there in its
first step, before the planner had measured anything.

`install(session, model)` registers a forward pre-hook on the model, for a run whose first plan
pages nothing. At the first forward with gradients, it reads the batch's tokens (`input_ids` or
`inputs_embeds`, by keyword or first positional argument) and, when the memory allocated now plus
the head's bytes plus what is in flight would pass the planner's target, pages every block for
that step, as the planner's probe does when its first plan pages any (`MemoryPlanner.probe_paged`):
the step then measures the activations beside the fewest resident weights, and the measured peaks
move blocks back. The hook removes itself after that forward.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from ..compiled import eager
from ..units import format_bytes
from .activations import HEAD_BYTES_PER_LOGIT, head_bytes, output_rows

if TYPE_CHECKING:
    from ..engine import Session


def batch_tokens(args: tuple, kwargs: dict[str, Any]) -> Optional[int]:
    """The tokens of a language model's batch: `input_ids`' elements, or `inputs_embeds`' rows
    (by keyword, else the first positional argument as ids); None when neither is a tensor."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
        return ids.numel()
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor) and embeds.dim() >= 2:
        return embeds.numel() // embeds.shape[-1]
    return None


def install(session: "Session", model: nn.Module) -> None:
    """Registers the head check (see the module docstring) when the first plan pages nothing and
    the model has an output head; keeps the handle in `session.head_check`."""
    pager, plan, rows = session.pager, session.planner, output_rows(model)
    if pager is None or plan is None or pager.paged or not session.cuda or rows is None:
        return

    def check(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():
            return  # an evaluation forward: the first training one is checked
        handle.remove()
        session.head_check = None
        tokens = batch_tokens(args, kwargs)
        if tokens is None or pager.paged or pager.closed or plan.steps:
            return
        head = head_bytes(rows, tokens)
        allocated = torch.cuda.memory_allocated(session.device)
        need = allocated + head + plan.inflight_bytes
        if need <= plan.target:
            return
        everything = set(range(len(pager.blocks)))
        pager.move_to(everything)
        pager.install()
        session.events.append(
            f"memory plan: the first step pages all {len(everything)} blocks: its {tokens:,} tokens' logits and loss "
            f"take about {format_bytes(head)} ({rows:,} outputs x {HEAD_BYTES_PER_LOGIT} bytes each), and with "
            f"{format_bytes(allocated)} allocated that passes the target {format_bytes(plan.target)}; the next steps "
            f"move blocks back by the measured peak")

    # Eager under torch.compile, as the pagers' hooks are: it swaps parameters' storage.
    handle = model.register_forward_pre_hook(eager(check), with_kwargs=True)
    session.head_check = handle
