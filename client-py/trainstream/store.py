"""Weight stores: one read-only copy of a base model's weights in tsd's memory, shared by every
job on the node that opens the same checkpoint files (docs/stores.md).

`Client.open_store(files, ...)` opens the checkpoint's safetensors files here (read-only), sends
their descriptors to tsd, and gets the store back: tsd found it (reading no tensor data) or built
it (reading the files, quantizing the tensors asked for). Tensors of a `Store` are views of tsd's
sealed memory: reading them costs no copy; writing through one kills the process (SIGSEGV), so
`tensor(..., copy=True)` gives a private copy of anything that will be modified.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

__all__ = ["Store", "StoreTensor", "StoreInfo"]

# safetensors dtype names -> torch dtypes (what a tensor kept as stored is viewed as).
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclasses.dataclass(frozen=True)
class StoreInfo:
    """A store as `Client.stores()` (and `tsctl stores`) reports it."""

    id: int
    source: str
    format: str
    block_size: int
    bytes: int
    users: int
    idle_s: float
    digest: str
    tensors: int


@dataclasses.dataclass(frozen=True)
class StoreTensor:
    """One tensor of a store: its checkpoint dtype and shape, and where its bytes lie (the data as
    stored, or the codes followed by one fp32 absmax per block when `quantized`)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    quantized: bool
    offset: int
    bytes: int
    absmax_offset: int
    absmax_count: int


class Store:
    """A weight store mapped read-only into this process (from `Client.open_store`)."""

    def __init__(self, handle: Any, client: Any) -> None:
        self._h = handle
        self._client = client
        self.info = StoreInfo(**handle.status)
        self.tensors: dict[str, StoreTensor] = {
            t["name"]: StoreTensor(name=t["name"], dtype=t["dtype"], shape=tuple(int(d) for d in t["shape"]),
                                   quantized=bool(t["quantized"]), offset=int(t["offset"]), bytes=int(t["bytes"]),
                                   absmax_offset=int(t["absmax_offset"]), absmax_count=int(t["absmax_count"]))
            for t in handle.tensors}

    @property
    def id(self) -> int:
        return int(self._h.id)

    @property
    def built(self) -> bool:
        """True when this open built the store (False: it existed, and no tensor data was read)."""
        return bool(self._h.built)

    def _get(self, name: str) -> StoreTensor:
        t = self.tensors.get(name)
        if t is None:
            raise KeyError(f"store {self.id} holds no tensor {name!r} ({len(self.tensors)} tensors)")
        return t

    def tensor(self, name: str, copy: bool = False) -> torch.Tensor:
        """Tensor `name` as stored (its checkpoint dtype and shape): a read-only view of the store,
        or a private copy with copy=True. A quantized tensor has no such form: see `quantized`."""
        t = self._get(name)
        if t.quantized:
            raise ValueError(f"tensor {name!r} is stored quantized ({self.info.format}): use quantized({name!r})")
        dtype = _DTYPES.get(t.dtype)
        if dtype is None:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which torch cannot view")
        view = self._h.bytes(t.offset, t.bytes).view(dtype).view(t.shape)
        return view.clone() if copy else view

    def quantized(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes (uint8) and absmax (fp32, one per block) of quantized tensor `name`: read-only
        views of the store."""
        t = self._get(name)
        if not t.quantized:
            raise ValueError(f"tensor {name!r} is stored as {t.dtype}, not quantized: use tensor({name!r})")
        codes = self._h.bytes(t.offset, t.bytes)
        absmax = self._h.bytes(t.absmax_offset, 4 * t.absmax_count).view(torch.float32)
        return codes, absmax

    def numel(self, name: str) -> int:
        return math.prod(self._get(name).shape)

    def close(self) -> None:
        """The job stops using the store (tsd keeps it warm for store_keep); views stay valid."""
        if self._client is not None:
            self._client.close_store(self.id)
            self._client = None

    def __repr__(self) -> str:
        return (f"<trainstream.Store {self.id} {self.info.format} {self.info.bytes} bytes, "
                f"{len(self.tensors)} tensors{', built here' if self.built else ''}>")
