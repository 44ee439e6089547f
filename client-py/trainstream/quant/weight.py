"""`QuantizedWeight` (a frozen weight in int8 or NF4) and `QuantizedParameter` (the parameter
that stands for it in a module: the right shape, dtype and device, no storage).

A quantized parameter holds no full-precision storage (`untyped_storage().nbytes() == 0`) and
never requires grad; `quantized_of(param)` gives the `QuantizedWeight` behind it. Reading it
through torch (an op, `.data`) gives the dequantized values, so code that touches a layer's
weight directly (peft's `merge()`: `weight.data += delta`) still works: assigning `.data` makes
the parameter an ordinary full-precision one again (it stops being quantized), except that a
tensor of another dtype is taken as a cast: the weight stays quantized and computes in that dtype.
In-place writes into `.data` are lost (it is a fresh dequantized tensor each time).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from .formats import (absmax_count, check_block_size, check_kind, codes_bytes, dequantize_into, quantize_tensor)

__all__ = ["QuantizedWeight", "QuantizedParameter", "quantized_of"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DATA = next(c.__dict__["data"] for c in torch.Tensor.__mro__ if "data" in c.__dict__)
# Tensor methods that read no element: they run on the placeholder itself.
_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.stride,
             torch.Tensor.untyped_storage, torch.Tensor.data_ptr, torch.Tensor.element_size,
             torch.Tensor.is_contiguous, torch.Tensor.is_floating_point, torch.Tensor.is_complex,
             torch.Tensor.requires_grad_, torch.Tensor.get_device, torch.Tensor.__hash__, torch.Tensor.__len__,
             torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook}


class QuantizedWeight:
    """A weight of `shape` quantized as `kind` ("int8" or "nf4") in blocks of `block_size`:
    `codes` (uint8) and `absmax` (fp32, one per block) on one device. `dtype` is the dtype the
    model computes in (what `dequantize()` gives by default). `host_block` is the tsd memory the
    buffers live in (a `trainstream.memory.HostBlock`), or None for process memory."""

    __slots__ = ("codes", "absmax", "kind", "block_size", "shape", "dtype", "host_block", "__weakref__")

    def __init__(self, codes: torch.Tensor, absmax: torch.Tensor, kind: str, block_size: int,
                 shape: Sequence[int], dtype: torch.dtype, host_block: Any = None) -> None:
        check_kind(kind)
        self.block_size = check_block_size(kind, block_size)
        self.kind, self.shape, self.dtype = kind, torch.Size(shape), dtype
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"a quantized weight dequantizes to fp32, bf16 or fp16, not {dtype}")
        n = self.shape.numel()
        if codes.dtype != torch.uint8 or codes.numel() != codes_bytes(kind, n):
            raise ValueError(f"{kind} codes of {n} elements are {codes_bytes(kind, n)} uint8 values, not "
                             f"{codes.numel()} {codes.dtype} values")
        if absmax.dtype != torch.float32 or absmax.numel() != absmax_count(n, self.block_size):
            raise ValueError(f"{n} elements in blocks of {self.block_size} have {absmax_count(n, self.block_size)} "
                             f"fp32 absmax values, not {absmax.numel()} {absmax.dtype} values")
        if codes.device != absmax.device:
            raise ValueError(f"codes and absmax must be on one device, not {codes.device} and {absmax.device}")
        self.codes, self.absmax = codes.reshape(-1).contiguous(), absmax.reshape(-1).contiguous()
        self.host_block = host_block
        if host_block is not None:
            weakref.finalize(self, host_block.release)

    @classmethod
    def quantize(cls, w: torch.Tensor, kind: str, block_size: int = 64, dtype: Optional[torch.dtype] = None,
                 host: Any = None) -> "QuantizedWeight":
        """Quantizes `w` (on the CPU kernels). The result lives on w's device, or with `host`
        (a `trainstream.memory.HostArena` or other HostMemory) in a block of host memory it lends.
        `dtype` defaults to w's dtype."""
        codes, absmax = quantize_tensor(w, kind, block_size)
        q = cls.from_buffers(codes, absmax, kind, block_size, w.shape, dtype or w.dtype, host=host)
        return q if host is not None or w.device.type == "cpu" else q.to(w.device)

    @classmethod
    def from_buffers(cls, codes: torch.Tensor, absmax: torch.Tensor, kind: str, block_size: int,
                     shape: Sequence[int], dtype: torch.dtype, host: Any = None) -> "QuantizedWeight":
        """A QuantizedWeight over existing buffers; with `host`, copied into a block of it."""
        if host is None:
            return cls(codes, absmax, kind, block_size, shape, dtype)
        off = -(-codes.numel() // 16) * 16
        block = host.alloc(off + 4 * absmax.numel())
        try:
            hc = block.data.narrow(0, 0, codes.numel())
            ha = block.data.narrow(0, off, 4 * absmax.numel()).view(torch.float32)
            hc.copy_(codes.reshape(-1))
            ha.copy_(absmax.reshape(-1))
            return cls(hc, ha, kind, block_size, shape, dtype, host_block=block)
        except BaseException:
            block.release()
            raise

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        """Bytes of codes and absmax."""
        return self.codes.numel() + 4 * self.absmax.numel()

    def to(self, device: Union[str, torch.device, None] = None, dtype: Optional[torch.dtype] = None,
           non_blocking: bool = False) -> "QuantizedWeight":
        """This weight on `device` (its buffers copied there) and/or computing in `dtype`."""
        dev = torch.device(device) if device is not None else self.device
        if dev == self.device:
            return QuantizedWeight(self.codes, self.absmax, self.kind, self.block_size, self.shape,
                                   dtype or self.dtype, host_block=None) if dtype not in (None, self.dtype) else self
        return QuantizedWeight(self.codes.to(dev, non_blocking=non_blocking),
                               self.absmax.to(dev, non_blocking=non_blocking), self.kind, self.block_size,
                               self.shape, dtype or self.dtype)

    def dequantize(self, dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The dequantized weight (of `shape`, in `dtype`, default the model's) on this weight's
        device: the CPU kernels, or the CUDA kernels on torch's current stream. With `out` (a
        contiguous tensor of numel() elements on this device), written there and returned."""
        if out is None:
            out = torch.empty(self.shape, dtype=dtype or self.dtype, device=self.device)
        elif dtype is not None and out.dtype != dtype:
            raise ValueError(f"out is {out.dtype}, not the requested {dtype}")
        if out.numel() != self.numel:
            raise ValueError(f"out has {out.numel()} elements; this weight has {self.numel}")
        dequantize_into(self.codes, self.absmax, self.kind, self.block_size, out)
        return out.view(self.shape)

    def __repr__(self) -> str:
        return (f"QuantizedWeight({self.kind}, shape={tuple(self.shape)}, block_size={self.block_size}, "
                f"dtype={self.dtype}, device={self.device}, {self.nbytes} bytes"
                f"{', in tsd memory' if self.host_block is not None else ''})")


def _placeholder(q: QuantizedWeight) -> torch.Tensor:
    """A tensor of q's shape, dtype and device whose storage holds no bytes."""
    t = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    t.untyped_storage().resize_(0)
    return t


def _dequantized(x: Any) -> Any:
    if isinstance(x, QuantizedParameter):
        q = x._ts_quantized
        return q.dequantize() if q is not None else x
    if isinstance(x, (list, tuple)):
        return type(x)(_dequantized(v) for v in x)
    return x


class QuantizedParameter(nn.Parameter):
    """The frozen parameter of a quantized layer (see the module docstring). Create it with
    `QuantizedParameter.of(q)`."""

    _ts_quantized: Optional[QuantizedWeight]

    @staticmethod
    def of(q: QuantizedWeight) -> "QuantizedParameter":
        p = QuantizedParameter(_placeholder(q), requires_grad=False)
        p._ts_quantized = q
        return p

    def __deepcopy__(self, memo: dict[int, Any]) -> "QuantizedParameter":
        q = self._ts_quantized
        if q is None:
            return nn.Parameter(self.data.clone(), requires_grad=self.requires_grad)  # type: ignore[return-value]
        copy = QuantizedWeight(q.codes.clone(), q.absmax.clone(), q.kind, q.block_size, q.shape, q.dtype)
        memo[id(self)] = out = QuantizedParameter.of(copy)
        return out

    def __reduce_ex__(self, proto: Any) -> Any:
        raise TypeError("a quantized parameter is not pickled: save the model's state_dict() (its codes and absmax)")

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        self = args[0] if args else None
        q = self._ts_quantized if isinstance(self, QuantizedParameter) else None
        name = getattr(func, "__name__", "")
        if getattr(func, "__self__", None) is _DATA:
            if name == "__get__" and q is not None:
                return q.dequantize()
            if name == "__set__" and isinstance(self, QuantizedParameter) and q is not None:
                value = args[1]
                if (isinstance(value, torch.Tensor) and value.dtype != q.dtype and value.dtype in _FLOAT_DTYPES
                        and value.shape == q.shape):
                    # a cast (`p.data = p.data.to(torch.float32)`, as peft's prepare_model_for_kbit_training
                    # does): the weight stays quantized and computes in the new dtype
                    moved = q.to(dtype=value.dtype)
                    with torch._C.DisableTorchFunctionSubclass():
                        func(self, _placeholder(moved))
                    self._ts_quantized = moved
                    return None
                self._ts_quantized = None  # full-precision values of its dtype replace the quantized ones
        elif func is torch.Tensor.__repr__ and q is not None:
            return f"QuantizedParameter({q.kind}, shape={tuple(q.shape)}, dtype={q.dtype}, device={q.device})"
        elif name not in ("__get__", "__set__") and func not in _METADATA:
            args, kwargs = _dequantized(tuple(args)), {k: _dequantized(v) for k, v in kwargs.items()}
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def quantized_of(param: Any) -> Optional[QuantizedWeight]:
    """The QuantizedWeight behind a quantized frozen parameter, else None."""
    return param._ts_quantized if isinstance(param, QuantizedParameter) else None
