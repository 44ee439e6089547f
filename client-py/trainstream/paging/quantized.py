"""Quantized frozen weights of paged blocks (`trainstream.quant`: int8 / NF4 codes and absmax).

A `QuantizedLinear` of a paged block keeps its codes and absmax in host memory lent by tsd: the
`QuantizedWeight`'s own buffers when they are there already (quantized into a region of the job,
or mapped from a store), else a block of the weight pager's arena. Its parameter then stands for
a `PagedQuantizedWeight`, a `QuantizedWeight` whose `codes` and `absmax` are the device copies the
pager brings ahead of the block's forward and backward and drops after use. Reading them (the
layer's dequantize, in forward or in backward) makes sure the copy arrived first: a read in
backward is how the pager learns that the block's backward started, as unpacking a saved dense
weight is for dense blocks. The layer computes exactly what it computes unpaged: the same codes
and absmax, dequantized by the same kernel.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import torch

from ..memory import HostBlock
from ..quant.weight import _DATA, QuantizedWeight

if TYPE_CHECKING:
    from .weights import WeightPager

__all__ = ["PagedQuantizedWeight", "set_placeholder", "host_buffers"]


class PagedQuantizedWeight(QuantizedWeight):
    """A quantized weight of paged block `index` of `pager` (see the module docstring).
    `host_codes`/`host_absmax` are its copy in tsd's memory (`lease`: the pager's arena block
    that holds them, None when they are the buffers of `origin`, kept alive here); `dev_codes`/
    `dev_absmax` the device copy while the block is on the device (None otherwise)."""

    __slots__ = ("pager", "index", "host_codes", "host_absmax", "dev_codes", "dev_absmax", "origin", "lease",
                 "host_reads")

    def __init__(self, pager: "WeightPager", index: int, origin: QuantizedWeight, host_codes: torch.Tensor,
                 host_absmax: torch.Tensor, lease: Optional[HostBlock]) -> None:
        # QuantizedWeight.__init__ is not called: codes and absmax are properties here.
        self.kind, self.block_size, self.shape, self.dtype = origin.kind, origin.block_size, origin.shape, origin.dtype
        self.host_block = None
        self.pager: Optional["WeightPager"] = pager
        self.index = index
        self.host_codes, self.host_absmax = host_codes, host_absmax
        self.dev_codes: Optional[torch.Tensor] = None
        self.dev_absmax: Optional[torch.Tensor] = None
        self.origin: Optional[QuantizedWeight] = None if lease is not None else origin
        self.lease = lease
        self.host_reads = False  # state_dict(): the buffers are read from tsd's memory, nothing is copied

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        pager = self.pager
        if pager is None or self.host_reads:
            return self.host_codes, self.host_absmax
        pager._quantized_use(self)
        assert self.dev_codes is not None and self.dev_absmax is not None
        return self.dev_codes, self.dev_absmax

    @property  # type: ignore[override]
    def codes(self) -> torch.Tensor:
        return self._buffers()[0]

    @codes.setter
    def codes(self, value: torch.Tensor) -> None:
        raise AttributeError("the codes of a paged quantized weight are the pager's: unpage its block first")

    @property  # type: ignore[override]
    def absmax(self) -> torch.Tensor:
        return self._buffers()[1]

    @absmax.setter
    def absmax(self, value: torch.Tensor) -> None:
        raise AttributeError("the absmax of a paged quantized weight is the pager's: unpage its block first")

    @property
    def device(self) -> torch.device:
        return self.pager.device if self.pager is not None else self.host_codes.device

    @property
    def nbytes(self) -> int:
        return self.host_codes.numel() + 4 * self.host_absmax.numel()

    def to(self, device: Union[str, torch.device, None] = None, dtype: Optional[torch.dtype] = None,
           non_blocking: bool = False) -> "QuantizedWeight":
        dev = torch.device(device) if device is not None else self.device
        if dev == self.device and dtype in (None, self.dtype):
            return self
        raise RuntimeError(f"block {self.index} is paged (its quantized weights live in tsd's memory and visit "
                           f"{self.device} only while used): call unwrap_session(model).pager.unpage({self.index}) "
                           f"before moving or casting it, or move the model before trainstream.wrap()")

    def __repr__(self) -> str:
        return (f"PagedQuantizedWeight({self.kind}, shape={tuple(self.shape)}, block_size={self.block_size}, "
                f"dtype={self.dtype}, block {self.index}, {self.nbytes} bytes in tsd memory"
                f"{', on ' + str(self.device) + ' now' if self.dev_codes is not None else ''})")


def set_placeholder(param: torch.nn.Parameter, q: QuantizedWeight, device: torch.device) -> None:
    """Makes quantized parameter `param`'s storage-less placeholder live on `device` (a model
    passed on the CPU has its paged weights' placeholders there; `.device` of a parameter must
    say where the layer computes)."""
    t = torch.empty(q.shape, dtype=q.dtype, device=device)
    t.untyped_storage().resize_(0)
    with torch._C.DisableTorchFunctionSubclass():
        _DATA.__set__(param, t)


def host_buffers(q: QuantizedWeight) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """q's own codes and absmax when they can be paged from where they are (host memory lent by
    tsd, or pinned), else None (the pager copies them into its arena)."""
    codes, absmax = q.codes, q.absmax
    if codes.device.type != "cpu":
        return None
    if q.host_block is not None or (codes.is_pinned() and absmax.is_pinned()):
        return codes, absmax
    return None
