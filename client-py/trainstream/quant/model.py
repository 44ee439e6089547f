"""`quantize_model`: quantizes the frozen linear weights of a model's repeated block stack."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..paging.activations import find_blocks
from .formats import check_block_size, check_kind
from .linear import QuantizedLinear

__all__ = ["quantize_model", "quantizable_linears"]

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def quantizable_linears(model: nn.Module, frozen_only: bool = False) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) of each linear layer `quantize_model` would quantize: inside the
    repeated block stack (trainstream.paging's block finder: the largest nn.ModuleList of blocks),
    not already quantized, with a weight no other module shares and that is frozen. When nothing
    in the model is frozen yet (a fresh model about to get adapters), every block linear counts as
    the frozen base, unless `frozen_only`."""
    _, blocks = find_blocks(model)
    if blocks is None:
        return []
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    any_frozen = frozen_only or any(not p.requires_grad for p in model.parameters())
    out = []
    for parent in blocks.modules():
        for attr, child in parent.named_children():
            if type(child) is not nn.Linear:  # subclasses (quantized layers, adapters' own kinds) are left alone
                continue
            w = child.weight
            if owners.get(id(w), 0) != 1 or w.dtype.is_floating_point is False:
                continue
            if any_frozen and w.requires_grad:
                continue  # trained (an adapter's weight, or a layer the user trains)
            out.append((parent, attr, child))
    return out


def quantize_model(model: nn.Module, kind: str, block_size: int = 64, host: Optional[Any] = None,
                   frozen_only: bool = False) -> nn.Module:
    """Quantizes, in place, the frozen linear weights of `model`'s repeated block stack to `kind`
    ("int8" or "nf4", blocks of `block_size` elements); embeddings, the output layer, norms,
    biases and trained weights are left as they are (in a model with nothing frozen yet, every
    block linear counts as the frozen base, unless `frozen_only`). Each layer becomes a `QuantizedLinear` on the
    same device whose weight no longer requires grad. With `host` (a trainstream.memory.HostArena
    of a tsd job), the quantized buffers of CPU layers live in the host memory it lends. Returns
    `model`.

    Raises ValueError for an unknown kind, a bad block size or a non-finite weight, before it
    changes anything. Layers are then quantized one at a time, each full-precision weight released
    as soon as its layer is replaced (unless something else still holds it), so the peak is the
    model plus one layer's codes rather than the model plus all of them; on a GPU the freed cache
    is returned to the device at the end. Only a failure to allocate can stop it midway, and that
    error says how many layers were quantized by then."""
    check_kind(kind)
    block_size = check_block_size(kind, block_size)
    targets = quantizable_linears(model, frozen_only)
    for parent, attr, linear in targets:  # everything that can be refused is checked first
        w = linear.weight.detach()
        if w.dtype not in _FLOAT:
            raise ValueError(f"cannot quantize {type(parent).__name__}.{attr}: quantize_model takes fp32, bf16 or "
                             f"fp16 weights, not {w.dtype}")
        if w.numel() and not bool(torch.isfinite(w).all()):
            raise ValueError(f"cannot quantize {type(parent).__name__}.{attr}: its weight has a non-finite element "
                             f"(NaN or infinity); nothing was quantized")
    cuda = False
    done = 0
    while targets:
        parent, attr, linear = targets.pop(0)
        cuda = cuda or linear.weight.device.type == "cuda"
        try:
            layer = QuantizedLinear.from_linear(linear, kind, block_size,
                                                host=host if linear.weight.device.type == "cpu" else None)
        except ValueError as e:
            raise ValueError(f"cannot quantize {type(parent).__name__}.{attr} after {done} layer(s) were: {e}") from None
        except (RuntimeError, MemoryError) as e:
            raise type(e)(f"quantize_model stopped at {type(parent).__name__}.{attr} after quantizing {done} of "
                          f"{done + 1 + len(targets)} layers: {e}") from e
        setattr(parent, attr, layer)
        del linear, layer
        done += 1
    if cuda:
        torch.cuda.empty_cache()
    return model
