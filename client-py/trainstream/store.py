"""Weight stores: one read-only copy of a base model's weights in tsd's memory, shared by every
job on the node that opens the same checkpoint files (docs/stores.md).

`Client.open_store(files, ...)` opens the checkpoint's safetensors files here (read-only), sends
their descriptors to tsd, and gets the store back: tsd found it (reading no tensor data) or built
it (reading the files, quantizing the tensors asked for). Tensors of a `Store` are views of tsd's
sealed memory: reading them costs no copy; writing through one kills the process (SIGSEGV), so
`tensor(..., copy=True)` gives a private copy of anything that will be modified.

With tsd's `gpu_stores = true`, `Store.to_device("cuda:0")` maps the store's device copy: one copy
in that GPU's memory, made by tsd and shared by every job on the GPU (docs/stores.md, "Device
copies"); `use_device_copy(model)` points the quantized weights of a model that `load_model(...,
store=...)` built at it instead of copying them to the GPU.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Union

import torch

__all__ = ["Store", "StoreTensor", "StoreInfo", "DeviceCopyInfo", "DeviceStore", "use_device_copy"]

# safetensors dtype names -> torch dtypes (what a tensor kept as stored is viewed as).
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclasses.dataclass(frozen=True)
class DeviceCopyInfo:
    """A store's copy in one GPU's memory (tsd's `gpu_stores`): the GPU, the device memory it
    holds, the jobs that asked for it and how long it has been unused."""

    gpu_uuid: str
    bytes: int
    users: int
    idle_s: float


@dataclasses.dataclass(frozen=True)
class StoreInfo:
    """A store as `Client.stores()` (and `tsctl stores`) reports it; `device_copies` lists its
    copies in VRAM (empty unless tsd runs with `gpu_stores = true`)."""

    id: int
    source: str
    format: str
    block_size: int
    bytes: int
    users: int
    idle_s: float
    digest: str
    tensors: int
    device_copies: tuple[DeviceCopyInfo, ...] = ()

    def __post_init__(self) -> None:
        copies = tuple(c if isinstance(c, DeviceCopyInfo) else DeviceCopyInfo(**c) for c in self.device_copies)
        object.__setattr__(self, "device_copies", copies)


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

    def to_device(self, device: Union[str, int, torch.device, None] = None) -> "DeviceStore":
        """Maps the store's copy on GPU `device` (default: the current CUDA device), which tsd
        makes on first request and shares with every job on that GPU. Needs tsd's
        `gpu_stores = true`; refused with `FailedPrecondition` otherwise, and without a CUDA
        driver here or there. The GPU is named to tsd by its UUID, so CUDA_VISIBLE_DEVICES may
        differ between tsd and this process."""
        if self._client is None:
            raise ValueError(f"store {self.id} was closed: open it again before asking for its device copy")
        from . import _C  # type: ignore[attr-defined]  # the pybind11 extension
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        if dev.type != "cuda":
            raise ValueError(f"a device copy lives on a CUDA device, not {dev}")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        handle = self._client._c.open_device_store(self.id, _C.gpu_uuid(index))
        return DeviceStore(handle, self)

    def close(self) -> None:
        """The job stops using the store (tsd keeps it warm for store_keep); views stay valid."""
        if self._client is not None:
            self._client.close_store(self.id)
            self._client = None

    def __repr__(self) -> str:
        return (f"<trainstream.Store {self.id} {self.info.format} {self.info.bytes} bytes, "
                f"{len(self.tensors)} tensors{', built here' if self.built else ''}>")


class DeviceStore:
    """A store's device copy mapped into this process on one GPU (`Store.to_device`). Its tensors
    are CUDA views of the one copy every job on the GPU shares: no VRAM of this process's own.
    The mapping is read-only where the driver allows (`read_only`; else `access_note` says why
    not): never write through these views, a write would change every job's base."""

    def __init__(self, handle: Any, store: Store) -> None:
        self._h = handle
        self.store = store
        self.device = torch.device("cuda", int(handle.device))
        self.gpu_uuid = str(handle.gpu_uuid)
        self.read_only = bool(handle.read_only)
        self.access_note = str(handle.access_note)
        self.size = int(handle.size)

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name` as stored, on the GPU (a view of the shared copy)."""
        t = self.store._get(name)
        if t.quantized:
            raise ValueError(f"tensor {name!r} is stored quantized ({self.store.info.format}): use quantized({name!r})")
        dtype = _DTYPES.get(t.dtype)
        if dtype is None:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which torch cannot view")
        return self._h.bytes(t.offset, t.bytes).view(dtype).view(t.shape)

    def quantized(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes (uint8) and absmax (fp32) of quantized tensor `name`, on the GPU."""
        t = self.store._get(name)
        if not t.quantized:
            raise ValueError(f"tensor {name!r} is stored as {t.dtype}, not quantized: use tensor({name!r})")
        return self._h.bytes(t.offset, t.bytes), self._h.bytes(t.absmax_offset, 4 * t.absmax_count).view(torch.float32)

    def __repr__(self) -> str:
        return (f"<trainstream.DeviceStore of store {self.store.id} on {self.device} ({self.gpu_uuid}), "
                f"{self.size} bytes, {'read-only' if self.read_only else 'read-write'}>")


def use_device_copy(model: torch.nn.Module, device: Union[str, int, torch.device, None] = None) -> DeviceStore:
    """Points every quantized weight of `model` (built by `load_model(..., store=...)`) at the
    store's shared device copy on `device` instead of a private copy in this process's VRAM, and
    returns the mapping (kept alive by the weights). Move the rest of the model with
    `model.to(device)` afterwards: the quantized weights already live there and are not copied."""
    from .quant.linear import QuantizedLinear
    from .quant.weight import QuantizedParameter, QuantizedWeight

    store = getattr(model, "_ts_store", None)
    if not isinstance(store, Store):
        raise ValueError("use_device_copy needs a model that load_model(..., store=client) built over a tsd store")
    dev = store.to_device(device)
    placed = 0
    for name, module in model.named_modules():
        q = module.quantized if isinstance(module, QuantizedLinear) else None
        t = store.tensors.get(f"{name}.weight")
        if q is None or t is None or not t.quantized:
            continue
        codes, absmax = dev.quantized(t.name)
        module._parameters["weight"] = QuantizedParameter.of(
            QuantizedWeight(codes, absmax, q.kind, q.block_size, q.shape, q.dtype))
        placed += 1
    if placed == 0:
        raise ValueError(f"the model has no quantized weights from store {store.id}: load it with quantize='nf4' or 'int8'")
    setattr(model, "_ts_device_store", dev)
    return dev
