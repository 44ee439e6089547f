"""`wrap(quantize=..., prefer=..., quant_block_size=...)`: checking the options and choosing the
format. "auto" quantizes only when the model's weights cannot fit in the device's usable VRAM
otherwise: none, then int8, then NF4 (`prefer="speed"`: NF4 as soon as it keeps every block in
VRAM, skipping int8). Only frozen linear weights of the block stack are quantized."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..planner import Budget
from .formats import absmax_count, check_block_size
from .model import quantizable_linears, quantize_model

__all__ = ["check_wrap_options", "weight_bytes", "choose", "apply_wrap_quantize"]

QUANTIZE = (None, "none", "auto", "int8", "nf4")
PREFER = ("exact", "speed")


def check_wrap_options(opts: dict[str, Any]) -> None:
    """ValueError for a bad quantize=, prefer= or quant_block_size= (before anything happens)."""
    if opts.get("quantize") not in QUANTIZE:
        raise ValueError(f"unknown quantize={opts.get('quantize')!r}: use 'auto', 'none', 'int8' or 'nf4'")
    if opts.get("prefer", "exact") not in PREFER:
        raise ValueError(f"prefer must be 'exact' or 'speed', not {opts.get('prefer')!r}")
    check_block_size("nf4" if opts.get("quantize") in ("nf4", "auto") else "int8", opts.get("quant_block_size", 64))


def weight_bytes(model: nn.Module, block_size: int = 64, frozen_only: bool = True) -> dict[str, int]:
    """Bytes of the model's parameters (each tensor once) with its quantizable weights kept
    ("none"), as int8, or as NF4 (codes plus fp32 absmax)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    q_full = q_numel = q_blocks = 0
    for _, _, lin in quantizable_linears(model, frozen_only):
        n = lin.weight.numel()
        q_full += n * lin.weight.element_size()
        q_numel += n
        q_blocks += absmax_count(n, block_size)
    rest = total - q_full
    return {"none": total, "int8": rest + q_numel + 4 * q_blocks, "nf4": rest + (q_numel + 1) // 2 + 4 * q_blocks}


def choose(sizes: dict[str, int], room: Optional[int], prefer: str = "exact") -> Optional[str]:
    """quantize="auto"'s choice for weights of `sizes` (weight_bytes) in `room` bytes of VRAM
    (None: no VRAM limit, e.g. a CPU run): None when they fit unquantized, else int8 if it fits
    (NF4 first with prefer="speed"), else NF4."""
    if room is None or sizes["none"] <= room:
        return None
    if prefer == "speed" and sizes["nf4"] <= room:
        return "nf4"
    return "int8" if sizes["int8"] <= room else "nf4"


def apply_wrap_quantize(model: nn.Module, opts: dict[str, Any], budget: Budget, device: torch.device) -> Optional[str]:
    """Quantizes `model`'s frozen block weights as wrap()'s options say; returns the format used
    (None: none)."""
    q, bs = opts.get("quantize"), int(opts.get("quant_block_size", 64))
    kind = q if q in ("int8", "nf4") else None
    if q == "auto":
        room = budget.vram_usable if device.type == "cuda" else None
        kind = choose(weight_bytes(model, bs), room, opts.get("prefer", "exact"))
    if kind is not None:
        quantize_model(model, kind, bs, frozen_only=True)
    return kind
