"""`QuantizedLinear`: an `nn.Linear` whose frozen weight is quantized.

Forward and backward dequantize the layer's weight into a workspace right before the matmul that
uses it, one layer at a time: no full-precision copy of the model's weights is ever held. On a GPU
the workspace comes from torch's caching allocator for the call and goes back to it as soon as the
matmul is queued, so the same cached block serves every layer and nothing is held between layers
(the peak of a step, at the loss, holds no dequantized weight: bitsandbytes' `Linear4bit` does the
same). On the CPU, where a large allocation is a fresh `mmap` and page faults on every call, one
workspace per dtype is kept, grown to the largest layer and reused (`workspace_bytes()`). Backward computes the input's
gradient (and the bias's, when the bias trains) and nothing for the frozen weight, so
activation checkpointing recomputes through it, and `eval()`/`generate()` and fp16/bf16 compute
(including autocast) work unchanged. It stays an `nn.Linear` subclass, so peft's
`get_peft_model` wraps it in its LoRA `Linear`; `merge_and_unload()` then writes the dequantized
base plus the delta into the weight, which becomes an ordinary full-precision one.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from .weight import QuantizedParameter, QuantizedWeight, quantized_of

__all__ = ["QuantizedLinear", "workspace_bytes"]

_workspaces: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_workspace_lock = threading.Lock()
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def _workspace(q: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """q dequantized in `dtype`, for immediate use on the current stream. On a GPU into a block of
    torch's caching allocator, returned when the caller drops it (the allocator orders its reuse
    after the work queued on this stream); elsewhere into the kept workspace of the device and
    dtype (valid until the next dequantize into it)."""
    if q.device.type == "cuda":
        return q.dequantize(out=torch.empty(q.numel, dtype=dtype, device=q.device))
    key = (q.device, dtype)
    with _workspace_lock:
        ws = _workspaces.get(key)
        if ws is None or ws.numel() < q.numel:
            ws = _workspaces[key] = torch.empty(q.numel, dtype=dtype, device=q.device)
    return q.dequantize(out=ws.narrow(0, 0, q.numel))


def workspace_bytes(device: Optional[Union[str, torch.device]] = None) -> int:
    """Bytes held between calls by the kept dequantize workspaces, of every device or of the
    device type or device given (a GPU keeps none: its workspace is a block of torch's caching
    allocator for the call)."""
    want = None if device is None else torch.device(device)

    def matches(d: torch.device) -> bool:
        return want is None or (d.type == want.type and (want.index is None or d.index == want.index))

    with _workspace_lock:
        return sum(w.numel() * w.element_size() for (d, _), w in _workspaces.items() if matches(d))


def _compute_dtype(x: torch.Tensor, q: QuantizedWeight) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype if x.dtype in _FLOAT else q.dtype


class _DequantLinear(torch.autograd.Function):
    """y = x @ W^T + b with W dequantized just before each use; no gradient for W."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: Optional[torch.Tensor], q: QuantizedWeight) -> torch.Tensor:
        dtype = _compute_dtype(x, q)
        ctx.q, ctx.dtype, ctx.x_dtype = q, dtype, x.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        w = _workspace(q, dtype)
        with torch.autocast(x.device.type, enabled=False):
            b = bias.to(dtype) if bias is not None else None
            return F.linear(x.to(dtype), w, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], None]:
        grad_x = grad_b = None
        if ctx.needs_input_grad[0]:
            w = _workspace(ctx.q, ctx.dtype)
            grad_x = grad.to(ctx.dtype).matmul(w).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, grad_b, None


class QuantizedLinear(nn.Linear):
    """A linear layer with a quantized frozen weight (`quantized_of(layer.weight)`) and an
    ordinary bias (if any). Make one with `QuantizedLinear.from_linear(linear, kind)` or from a
    `QuantizedWeight`."""

    def __init__(self, quantized: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> None:
        nn.Module.__init__(self)
        if len(quantized.shape) != 2:
            raise ValueError(f"a linear layer's weight is 2-D, not of shape {tuple(quantized.shape)}")
        self.out_features, self.in_features = int(quantized.shape[0]), int(quantized.shape[1])
        self.weight = QuantizedParameter.of(quantized)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            if bias.shape != (self.out_features,):
                raise ValueError(f"the bias of a {self.in_features}->{self.out_features} layer has shape "
                                 f"({self.out_features},), not {tuple(bias.shape)}")
            self.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: str, block_size: int = 64, host: Any = None) -> "QuantizedLinear":
        """`linear` with its weight quantized (the bias is shared, not copied)."""
        q = QuantizedWeight.quantize(linear.weight.detach(), kind, block_size, host=host)
        return cls(q, linear.bias)

    @property
    def quantized(self) -> Optional[QuantizedWeight]:
        """The quantized weight, or None once full-precision values replaced it (a merge)."""
        return quantized_of(self.weight)

    def reset_parameters(self) -> None:
        """Nothing to initialise: the weight is given (quantized)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        q = self.quantized
        if q is None:
            return F.linear(input, self.weight, self.bias)
        out: torch.Tensor = _DequantLinear.apply(input, self.bias, q)
        return out

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "QuantizedLinear":
        q = self.quantized
        if q is None:
            super()._apply(fn, recurse)
            return self
        probe = fn(torch.empty(0, dtype=q.dtype, device=q.device))
        weight = self._parameters["weight"]
        self._parameters["weight"] = None
        try:
            super()._apply(fn, recurse)
        finally:
            self._parameters["weight"] = weight
        dtype = probe.dtype if probe.dtype in _FLOAT else q.dtype
        if probe.device != q.device or dtype != q.dtype:
            self._parameters["weight"] = QuantizedParameter.of(q.to(probe.device, dtype))
        return self

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        """The bitsandbytes layout: `weight` (uint8 codes), `weight.absmax`, and the format as
        JSON in `weight.quant_state.bitsandbytes__nf4` (`trainstream__int8` for int8)."""
        q = self.quantized
        if q is None:
            super()._save_to_state_dict(destination, prefix, keep_vars)
            return
        destination[prefix + "weight"] = q.codes.view(-1, 1)
        destination[prefix + "weight.absmax"] = q.absmax
        if q.kind == "nf4":
            from .formats import NF4_VALUES
            destination[prefix + "weight.quant_map"] = torch.tensor(NF4_VALUES, dtype=torch.float32)
        state = {"quant_type": q.kind, "blocksize": q.block_size, "dtype": str(q.dtype).replace("torch.", ""),
                 "shape": list(q.shape)}
        key = "bitsandbytes__nf4" if q.kind == "nf4" else "trainstream__int8"
        destination[prefix + "weight.quant_state." + key] = torch.tensor(list(json.dumps(state).encode()),
                                                                         dtype=torch.uint8)
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        """Reads what `_save_to_state_dict` writes (codes, absmax, quant_state: kept as they are),
        or a full-precision `weight` of the layer's shape (quantized with this layer's format)."""
        q = self.quantized
        if q is None:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
            return
        key = prefix + "weight"
        mine = {k: v for k, v in state_dict.items() if k == key or k.startswith(key + ".")}
        try:
            new = self._weight_from(mine, key, q)
        except ValueError as e:
            error_msgs.append(f"{key}: {e}")
            new = None
        if key not in mine:
            missing_keys.append(key)
        rest = {k: v for k, v in state_dict.items() if k.startswith(prefix) and k not in mine}
        weight = self._parameters["weight"]
        self._parameters["weight"] = None
        try:
            super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
        finally:
            self._parameters["weight"] = weight
        if new is not None:
            self._parameters["weight"] = QuantizedParameter.of(new)

    @staticmethod
    def _weight_from(entries: dict[str, torch.Tensor], key: str, q: QuantizedWeight) -> Optional[QuantizedWeight]:
        if key not in entries:
            return None
        w = entries[key]
        states = [k for k in entries if ".quant_state." in k]
        if not states:
            if tuple(w.shape) != tuple(q.shape):
                raise ValueError(f"a weight of shape {tuple(w.shape)} does not fit a layer of shape {tuple(q.shape)}")
            return QuantizedWeight.quantize(w.to(q.device), q.kind, q.block_size, dtype=q.dtype)
        state = json.loads(bytes(entries[states[0]].cpu().tolist()).decode())
        if list(state.get("shape", [])) != list(q.shape):
            raise ValueError(f"the quantized weight has shape {state.get('shape')}; the layer is {list(q.shape)}")
        if key + ".absmax" not in entries or key + ".nested_absmax" in entries:
            raise ValueError("a quantized weight needs its absmax (and no double quantization)")
        return QuantizedWeight(w.reshape(-1).to(q.device), entries[key + ".absmax"].to(q.device, torch.float32),
                               str(state["quant_type"]), int(state["blocksize"]), q.shape, q.dtype)

    def extra_repr(self) -> str:
        q = self.quantized
        fmt = f", {q.kind}, block_size={q.block_size}" if q is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{fmt}"
