"""An independent NumPy reference of tsd's quantized formats (docs/quantization.md).

Written from the format's definition, not from the C++ code: NF4 codes come from a sorted search
over the fp32 midpoints (``np.searchsorted``), int8 rounding from ``np.rint``, conversions to
bf16 from torch. tests/python/test_quant_reference.py compares it with the C++ kernels
(build/lib/libtsd_quant.so) and bench/dequant_bnb.py uses it for nothing: it is test-only.
"""
from __future__ import annotations

import numpy as np
import torch

#: bitsandbytes' 16 NF4 code values, as fp32.
NF4_VALUES = np.array(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
     -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
     0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
     0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0],
    dtype=np.float32)

#: The 15 midpoints (a + b) / 2, computed in fp32.
NF4_MIDPOINTS = ((NF4_VALUES[:-1] + NF4_VALUES[1:]) / np.float32(2)).astype(np.float32)

#: The code of 0.0 (NF4 padding and zero blocks).
NF4_ZERO_CODE = 7

KINDS = ("nf4", "int8")


def _as_float32(x: torch.Tensor) -> np.ndarray:
    """The values of a CPU tensor (fp32, bf16 or fp16) as a flat fp32 array (exact)."""
    return x.detach().reshape(-1).to(torch.float32).numpy()


def _blocks(values: np.ndarray, block_size: int) -> np.ndarray:
    """values zero-padded to whole blocks, shape (blocks, block_size)."""
    n = values.shape[0]
    blocks = -(-n // block_size)
    padded = np.zeros(blocks * block_size, dtype=np.float32)
    padded[:n] = values
    return padded.reshape(blocks, block_size)


def quantize(x: torch.Tensor, kind: str, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes (uint8) and per-block absmax (fp32) of a CPU tensor, as the format defines them.

    Raises ValueError for an unknown kind, a block size that the kind does not accept, or a
    non-finite element.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}: use 'nf4' or 'int8'")
    if block_size < 1 or (kind == "nf4" and block_size % 2):
        raise ValueError(f"block size {block_size} is not valid for {kind}")
    values = _as_float32(x)
    n = values.shape[0]
    if not np.all(np.isfinite(values)):
        raise ValueError(f"element {int(np.argmin(np.isfinite(values)))} is not finite")
    if n == 0:
        return np.zeros(0, np.uint8), np.zeros(0, np.float32)
    blocks = _blocks(values, block_size)
    absmax = np.abs(blocks).max(axis=1).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        if kind == "nf4":
            factor = np.float32(1) / absmax
        else:
            factor = np.float32(127) / absmax
        scaled = np.where(blocks == 0, np.float32(0), blocks * factor[:, None]).astype(np.float32)
    if kind == "nf4":
        codes = np.searchsorted(NF4_MIDPOINTS, scaled.reshape(-1), side="left").astype(np.uint8)[:n]
        if n % 2:
            codes = np.append(codes, np.uint8(NF4_ZERO_CODE))
        packed = (codes[0::2] << 4) | codes[1::2]
        return packed.astype(np.uint8), absmax
    q = np.rint(np.clip(scaled, np.float32(-127), np.float32(127))).astype(np.int8)
    return q.reshape(-1)[:n].view(np.uint8), absmax


def dequantize(codes: np.ndarray, absmax: np.ndarray, kind: str, block_size: int, n: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The dequantized tensor (n elements of dtype): code value times the block's scale in fp32,
    then rounded to nearest even."""
    block = np.arange(n) // block_size
    with np.errstate(over="ignore"):  # int8 q * scale may round past the fp32 maximum to Inf
        return _dequantize_values(codes, absmax, kind, block, n, dtype)


def _dequantize_values(codes: np.ndarray, absmax: np.ndarray, kind: str, block: np.ndarray, n: int,
                       dtype: torch.dtype) -> torch.Tensor:
    if kind == "nf4":
        unpacked = np.empty(2 * codes.shape[0], dtype=np.uint8)
        unpacked[0::2] = codes >> 4
        unpacked[1::2] = codes & 0x0F
        values = NF4_VALUES[unpacked[:n]] * absmax[block]
    elif kind == "int8":
        scale = (absmax / np.float32(127)).astype(np.float32)
        values = codes[:n].view(np.int8).astype(np.float32) * scale[block]
    else:
        raise ValueError(f"unknown kind {kind!r}: use 'nf4' or 'int8'")
    return torch.from_numpy(values.astype(np.float32)).to(dtype)
