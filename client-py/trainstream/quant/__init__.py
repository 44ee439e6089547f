"""Quantized frozen weights (int8 and NF4) for LoRA bases (docs/quantization.md).

    from trainstream import quant
    codes, absmax = quant.quantize_tensor(w, "nf4", 64)          # the C++ kernels (libtsd_quant.so)
    w2 = quant.dequantize_reference(codes, absmax, "nf4", 64, w.numel(), torch.bfloat16)
    trainstream.quantize_model(model, "nf4")                      # block-stack linears -> QuantizedLinear
    quant.quantized_of(model.model.layers[0].self_attn.q_proj.weight).dequantize()

Modules: formats (the kernels through ctypes), weight (QuantizedWeight, QuantizedParameter,
quantized_of), linear (QuantizedLinear and its shared dequantize workspace), model
(quantize_model).
"""
from .formats import (KINDS, NF4_VALUES, cpu_isa, dequantize_into, dequantize_reference, has_cuda_kernels,
                      quantize_tensor)
from .linear import QuantizedLinear, workspace_bytes
from .model import quantizable_linears, quantize_model
from .weight import QuantizedParameter, QuantizedWeight, quantized_of

__all__ = ["KINDS", "NF4_VALUES", "quantize_tensor", "dequantize_reference", "dequantize_into", "cpu_isa",
           "has_cuda_kernels", "QuantizedWeight", "QuantizedParameter", "QuantizedLinear", "quantized_of",
           "quantize_model", "quantizable_linears", "workspace_bytes"]
