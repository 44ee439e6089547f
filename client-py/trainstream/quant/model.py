"""`quantize_model`: quantizes the frozen linear weights of a model's repeated block stack."""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

from ..paging.activations import find_blocks
from .formats import check_block_size, check_kind
from .linear import QuantizedLinear

__all__ = ["quantize_model", "quantizable_linears"]


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
    `model`. Raises ValueError for an unknown kind, a bad block size or a non-finite weight,
    before it changes anything."""
    check_kind(kind)
    block_size = check_block_size(kind, block_size)
    targets = quantizable_linears(model, frozen_only)
    made = []
    for parent, attr, linear in targets:  # quantize all first: an error leaves the model untouched
        try:
            layer = QuantizedLinear.from_linear(linear, kind, block_size,
                                                host=host if linear.weight.device.type == "cpu" else None)
        except ValueError as e:
            raise ValueError(f"cannot quantize {type(parent).__name__}.{attr}: {e}") from None
        made.append((parent, attr, layer))
    for parent, attr, layer in made:
        setattr(parent, attr, layer)
    return model
