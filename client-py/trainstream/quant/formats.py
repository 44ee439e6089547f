"""tsd's quantized formats (docs/quantization.md), through the C++ kernels of libtsd_quant.so.

`quantize_tensor` and `dequantize_reference` call the CPU kernels (the best ISA of this CPU, or
$TSD_KERNEL_ISA); `dequantize_into` also runs the CUDA kernels on torch's current stream when the
library was built with them. The library is found at $TSD_QUANT_LIB, next to this package
(`setup.py` ships it there), or in the repository's build/lib/.

Formats: `nf4` (bitsandbytes' NF4 code values, two codes per byte, the lower index in the high
nibble, an fp32 absmax per block) and `int8` (symmetric, `round_half_even(x * 127 / absmax)`, an
fp32 absmax per block). Every kernel is bit-exact with the scalar reference.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import os
import threading
from typing import Optional

import torch

__all__ = ["KINDS", "NF4_VALUES", "quantize_tensor", "dequantize_reference", "dequantize_into", "check_kind",
           "check_block_size", "codes_bytes", "absmax_count", "cpu_isa", "has_cuda_kernels"]

#: bitsandbytes' 16 NF4 code values (the `quant_map` of its NF4 checkpoints).
NF4_VALUES = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)

#: The formats, most precise first.
KINDS = ("int8", "nf4")
_KIND_ID = {"nf4": 0, "int8": 1}
_DTYPE_ID = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ERR_LEN = 512

_lib: Optional[ctypes.CDLL] = None
_lib_lock = threading.Lock()


def _candidates() -> list[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    package = os.path.dirname(here)
    root = os.path.dirname(os.path.dirname(package))
    env = os.environ.get("TSD_QUANT_LIB")
    out = [env] if env else []
    return out + [os.path.join(package, "libtsd_quant.so"), os.path.join(root, "build", "lib", "libtsd_quant.so"),
                  os.path.join(root, "build-py", "lib", "libtsd_quant.so")]


def _load() -> ctypes.CDLL:
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        tried = _candidates()
        path = next((p for p in tried if os.path.exists(p)), None)
        if path is None:
            raise RuntimeError(f"trainstream.quant needs libtsd_quant.so (tsd's quantization kernels) and found none at "
                               f"{tried}: build it (`ninja -C build tsd_quant`), reinstall client-py, or set "
                               f"$TSD_QUANT_LIB to its path")
        lib = ctypes.CDLL(path)
        lib.tsd_quant_quantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.tsd_quant_quantize.restype = ctypes.c_int
        lib.tsd_quant_dequantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                             ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p,
                                             ctypes.c_size_t]
        lib.tsd_quant_dequantize.restype = ctypes.c_int
        lib.tsd_quant_cpu_isa.restype = ctypes.c_char_p
        lib.tsd_quant_has_cuda.restype = ctypes.c_int
        lib.tsd_quant_cuda_dequantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                  ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        lib.tsd_quant_cuda_dequantize.restype = ctypes.c_int
        lib.tsd_quant_cuda_error_string.argtypes = [ctypes.c_int]
        lib.tsd_quant_cuda_error_string.restype = ctypes.c_char_p
        _lib = lib
        return lib


def cpu_isa() -> str:
    """The ISA the CPU kernels use: "scalar", "avx2" or "avx512"."""
    return str(_load().tsd_quant_cpu_isa().decode())


def has_cuda_kernels() -> bool:
    """Whether libtsd_quant.so was built with the CUDA dequantize kernels."""
    return bool(_load().tsd_quant_has_cuda())


def check_kind(kind: str) -> str:
    """`kind` if it is a format ("int8" or "nf4"), else ValueError saying which are."""
    if not isinstance(kind, str) or kind not in _KIND_ID:
        raise ValueError(f"unknown quantization kind {kind!r}: use 'int8' or 'nf4'")
    return kind


def check_block_size(kind: str, block_size: int) -> int:
    """`block_size` as an int if `kind` accepts it (a positive integer; even for nf4)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, not {block_size!r}")
    if kind == "nf4" and block_size % 2:
        raise ValueError(f"nf4 packs two codes per byte: block_size must be a positive multiple of 2, not {block_size}")
    return int(block_size)


def codes_bytes(kind: str, numel: int) -> int:
    """Bytes of codes for `numel` elements."""
    return (numel + 1) // 2 if kind == "nf4" else numel


def absmax_count(numel: int, block_size: int) -> int:
    """Blocks (fp32 absmax values) for `numel` elements."""
    return -(-numel // block_size)


def _raise(rc: int, err: ctypes.Array[ctypes.c_char], what: str) -> None:
    if rc != 0:
        raise ValueError(f"{what}: {err.value.decode(errors='replace')}")


def quantize_tensor(w: torch.Tensor, kind: str, block_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes `w` (fp32, bf16 or fp16, any device, any shape; read in row-major order) into
    `(codes, absmax)`: uint8 codes ((numel + 1) // 2 bytes for nf4, numel for int8) and fp32
    absmax (one per block), both on the CPU. Raises ValueError for an unknown kind, a bad block
    size, a dtype other than those, or a non-finite element (nothing is returned then)."""
    check_kind(kind)
    block_size = check_block_size(kind, block_size)
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"quantize_tensor takes a torch.Tensor, not {type(w).__name__}")
    if w.dtype not in _DTYPE_ID:
        raise ValueError(f"quantize_tensor takes fp32, bf16 or fp16 tensors, not {w.dtype}")
    src = w.detach()
    if src.device.type != "cpu":
        src = src.cpu()
    src = src.contiguous()
    n = src.numel()
    codes = torch.empty(codes_bytes(kind, n), dtype=torch.uint8)
    absmax = torch.empty(absmax_count(n, block_size), dtype=torch.float32)
    if n == 0:
        return codes, absmax
    lib, es = _load(), src.element_size()
    per_code = 2 if kind == "nf4" else 1  # elements per code byte (block sizes are even)

    def part(start: int, count: int) -> tuple[int, ctypes.Array[ctypes.c_char]]:
        # Blocks are independent: a range that starts on a block boundary gives the same codes and
        # absmax as the whole call gives for it. ctypes lets go of the GIL during the call.
        err = ctypes.create_string_buffer(_ERR_LEN)
        rc = lib.tsd_quant_quantize(_KIND_ID[kind], src.data_ptr() + start * es, _DTYPE_ID[src.dtype], count,
                                    block_size, codes.data_ptr() + start // per_code,
                                    absmax.data_ptr() + (start // block_size) * 4, err, _ERR_LEN)
        return rc, err

    chunk = max(1, QUANTIZE_CHUNK // block_size) * block_size
    starts = range(0, n, chunk)
    threads = min(len(starts), _quantize_threads())
    if threads <= 1:
        results = [part(0, n)]
    else:
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="trainstream-quantize") as pool:
            results = list(pool.map(lambda s0: part(s0, min(chunk, n - s0)), starts))
    if any(rc != 0 for rc, _ in results):
        # A range's message counts elements from its own start: the whole call names the element.
        rc, err = part(0, n) if len(results) > 1 else results[0]
        _raise(rc, err, f"cannot quantize this tensor to {kind} (shape {tuple(w.shape)})")
    return codes, absmax


# quantize_tensor splits a tensor into ranges of this many elements (whole blocks) and quantizes
# them on up to _quantize_threads() threads: one thread quantizes about 1.1 G elements/s on the
# development machine's AVX-512, so a 14B base took about 12 s on one.
QUANTIZE_CHUNK = 1 << 23


def _quantize_threads() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(16, cpus))


def _check_buffers(codes: torch.Tensor, absmax: torch.Tensor, kind: str, block_size: int, numel: int) -> None:
    if codes.dtype != torch.uint8 or absmax.dtype != torch.float32:
        raise ValueError(f"codes must be uint8 and absmax float32, not {codes.dtype} and {absmax.dtype}")
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be an integer >= 0, not {numel!r}")
    if codes.numel() < codes_bytes(kind, numel) or absmax.numel() < absmax_count(numel, block_size):
        raise ValueError(f"{numel} elements of {kind} in blocks of {block_size} need {codes_bytes(kind, numel)} code "
                         f"bytes and {absmax_count(numel, block_size)} absmax values; got {codes.numel()} and "
                         f"{absmax.numel()}")
    if not (codes.is_contiguous() and absmax.is_contiguous()):
        raise ValueError("codes and absmax must be contiguous")


def dequantize_into(codes: torch.Tensor, absmax: torch.Tensor, kind: str, block_size: int, out: torch.Tensor) -> torch.Tensor:
    """Dequantizes `out.numel()` elements into `out` (contiguous fp32, bf16 or fp16). All three
    on the CPU: the CPU kernels. All three on one CUDA device: the CUDA kernels, asynchronously on
    torch's current stream of that device. Returns `out`."""
    check_kind(kind)
    block_size = check_block_size(kind, block_size)
    n = out.numel()
    _check_buffers(codes, absmax, kind, block_size, n)
    if out.dtype not in _DTYPE_ID or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32, bf16 or fp16 tensor, not {out.dtype}")
    if not (codes.device == absmax.device == out.device):
        raise ValueError(f"codes, absmax and out must be on one device, not {codes.device}, {absmax.device}, "
                         f"{out.device}")
    if n == 0:
        return out
    lib = _load()
    if out.device.type == "cpu":
        err = ctypes.create_string_buffer(_ERR_LEN)
        rc = lib.tsd_quant_dequantize(_KIND_ID[kind], codes.data_ptr(), absmax.data_ptr(), n, block_size,
                                      out.data_ptr(), _DTYPE_ID[out.dtype], err, _ERR_LEN)
        _raise(rc, err, f"cannot dequantize {kind}")
        return out
    if out.device.type != "cuda":
        raise ValueError(f"dequantize runs on the CPU or a CUDA device, not {out.device}")
    if not lib.tsd_quant_has_cuda():
        raise RuntimeError("this libtsd_quant.so was built without CUDA: rebuild it on a machine with nvcc "
                           "(cmake finds CUDA and builds kernels/cuda) to dequantize on the GPU")
    with torch.cuda.device(out.device):
        stream = torch.cuda.current_stream(out.device).cuda_stream
        rc = lib.tsd_quant_cuda_dequantize(_KIND_ID[kind], codes.data_ptr(), absmax.data_ptr(), n, block_size,
                                           out.data_ptr(), _DTYPE_ID[out.dtype], stream)
    if rc != 0:
        raise RuntimeError(f"CUDA dequantize of {kind} failed: {lib.tsd_quant_cuda_error_string(rc).decode()}")
    return out


def dequantize_reference(codes: torch.Tensor, absmax: torch.Tensor, kind: str, block_size: int, numel: int,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dequantized values of `numel` elements (a flat tensor of `dtype` on codes' device):
    the code value times the block's scale in fp32, then rounded to `dtype`."""
    if dtype not in _DTYPE_ID:
        raise ValueError(f"dequantize gives fp32, bf16 or fp16, not {dtype}")
    out = torch.empty(numel, dtype=dtype, device=codes.device)
    return dequantize_into(codes.contiguous(), absmax.contiguous(), kind, block_size, out)
