"""tsd's CUDA NF4 dequantize beside bitsandbytes' ``dequantize_4bit`` and a device-to-device copy.

Run on a GPU machine with bitsandbytes importable and tsd built with CUDA::

    python3 bench/dequant_bnb.py --lib build-gpu/lib/libtsd_quant.so

It uses tsd's kernels through ``libtsd_quant.so`` (ctypes; kernels/capi/tsd_quant.h):

1. random bf16 weights (std 0.02) of ``--elements`` elements are quantized to NF4 by tsd's CPU
   kernel (block ``--block-size``, default 64, no double quantization);
2. tsd's CUDA kernel and ``bitsandbytes.functional.dequantize_4bit`` dequantize those codes and
   absmax to bf16 (and to fp16 and fp32 for the first 2^24 elements); the outputs must be
   bit-identical (exit status 1 otherwise), and tsd's CUDA output must equal tsd's CPU dequantize;
3. the median time of each over ``--iters`` runs, and of a copy of the same output size, give the
   bytes moved per second (codes + absmax read + output written; the copy: read + written).

For information it also reports how many of bitsandbytes' own ``quantize_4bit`` codes equal
tsd's (bitsandbytes decides by decimal midpoint constants, tsd by fp32 midpoints, so a value that
lies between the two can code differently). Prints one JSON line.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys

import torch


def load_lib(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.tsd_quant_quantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_char_p, ctypes.c_size_t]
    lib.tsd_quant_dequantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                         ctypes.c_char_p, ctypes.c_size_t]
    lib.tsd_quant_cuda_dequantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                              ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                              ctypes.c_int, ctypes.c_void_p]
    lib.tsd_quant_cuda_error_string.restype = ctypes.c_char_p
    lib.tsd_quant_cpu_isa.restype = ctypes.c_char_p
    if not lib.tsd_quant_has_cuda():
        sys.exit(f"{path} was built without CUDA: configure with the CUDA toolkit present")
    return lib


NF4, BF16 = 0, 1


def tsd_quantize(lib: ctypes.CDLL, w: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4 codes and absmax of a CPU bf16 tensor, by tsd's CPU kernel."""
    n = w.numel()
    codes = torch.empty((n + 1) // 2, dtype=torch.uint8)
    absmax = torch.empty(-(-n // block_size), dtype=torch.float32)
    err = ctypes.create_string_buffer(512)
    if lib.tsd_quant_quantize(NF4, w.data_ptr(), BF16, n, block_size, codes.data_ptr(), absmax.data_ptr(),
                              err, len(err)) != 0:
        sys.exit(f"tsd quantize failed: {err.value.decode()}")
    return codes, absmax


def tsd_dequantize_cpu(lib: ctypes.CDLL, codes: torch.Tensor, absmax: torch.Tensor, n: int,
                       block_size: int) -> torch.Tensor:
    out = torch.empty(n, dtype=torch.bfloat16)
    err = ctypes.create_string_buffer(512)
    if lib.tsd_quant_dequantize(NF4, codes.data_ptr(), absmax.data_ptr(), n, block_size, out.data_ptr(), BF16,
                                err, len(err)) != 0:
        sys.exit(f"tsd CPU dequantize failed: {err.value.decode()}")
    return out


DTYPE_CODE = {torch.float32: 0, torch.bfloat16: BF16, torch.float16: 2}


def tsd_dequantize_cuda(lib: ctypes.CDLL, codes: torch.Tensor, absmax: torch.Tensor, n: int, block_size: int,
                        out: torch.Tensor) -> None:
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    rc = lib.tsd_quant_cuda_dequantize(NF4, codes.data_ptr(), absmax.data_ptr(), n, block_size, out.data_ptr(),
                                       DTYPE_CODE[out.dtype], stream)
    if rc != 0:
        sys.exit(f"tsd CUDA dequantize failed: {lib.tsd_quant_cuda_error_string(rc).decode()}")


def median_ms(fn, iters: int, reps: int = 5) -> float:
    """Median over `iters` of the GPU time of `reps` back-to-back calls, divided by reps (so the
    host's launch overhead of one call is hidden behind the previous call's kernel)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / reps)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lib", default="build/lib/libtsd_quant.so", help="path of libtsd_quant.so (CUDA build)")
    parser.add_argument("--elements", type=int, default=1 << 30,
                        help="elements (bitsandbytes takes a 32-bit count: stay below 2^31)")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n, bs = args.elements, args.block_size
    if not 0 < n < 2**31 or n % 2:
        sys.exit("--elements must be even, positive and below 2^31 (bitsandbytes' limits)")

    import bitsandbytes
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    lib = load_lib(args.lib)
    torch.manual_seed(args.seed)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.02
    codes_cpu, absmax_cpu = tsd_quantize(lib, w.cpu(), bs)
    codes, absmax = codes_cpu.cuda(), absmax_cpu.cuda()

    out_tsd = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    out_bnb = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    out_copy = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    tsd_dequantize_cuda(lib, codes, absmax, n, bs, out_tsd)
    # bitsandbytes stores packed NF4 as (n/2, 1) uint8; a first dimension of 1 would transpose.
    dequantize_4bit(codes.view(-1, 1), absmax=absmax, out=out_bnb, blocksize=bs, quant_type="nf4")
    torch.cuda.synchronize()
    mismatches = int((out_tsd.view(torch.int16) != out_bnb.view(torch.int16)).sum())
    cpu_equal = torch.equal(tsd_dequantize_cpu(lib, codes_cpu, absmax_cpu, n, bs).view(torch.int16),
                            out_tsd.cpu().view(torch.int16))

    # fp16 and fp32 outputs too, on the first 2^24 elements.
    m = min(n, 1 << 24)
    other_dtypes_equal = True
    for dtype in (torch.float16, torch.float32):
        a = torch.empty(m, device="cuda", dtype=dtype)
        b = torch.empty(m, device="cuda", dtype=dtype)
        tsd_dequantize_cuda(lib, codes[: m // 2], absmax, m, bs, a)
        dequantize_4bit(codes[: m // 2].view(-1, 1), absmax=absmax[: -(-m // bs)], out=b, blocksize=bs,
                        quant_type="nf4")
        view = torch.int32 if dtype == torch.float32 else torch.int16
        other_dtypes_equal &= bool(torch.equal(a.view(view), b.view(view)))
        del a, b

    bnb_codes, bnb_state = quantize_4bit(w, blocksize=bs, quant_type="nf4", compress_statistics=False)
    codes_equal = float((bnb_codes.reshape(-1) == codes).float().mean())
    absmax_equal = bool(torch.equal(bnb_state.absmax.reshape(-1).float(), absmax))
    del bnb_codes, bnb_state

    tsd_ms = median_ms(lambda: tsd_dequantize_cuda(lib, codes, absmax, n, bs, out_tsd), args.iters)
    bnb_ms = median_ms(lambda: dequantize_4bit(codes.view(-1, 1), absmax=absmax, out=out_bnb, blocksize=bs,
                                               quant_type="nf4"), args.iters)
    copy_ms = median_ms(lambda: out_copy.copy_(out_tsd), args.iters)

    moved = n // 2 + absmax.numel() * 4 + n * 2
    copy_moved = 2 * n * 2
    gbps = lambda nbytes, ms: nbytes / (ms * 1e-3) / 1e9  # noqa: E731
    result = {
        "bench": "dequant_nf4_bf16_vs_bnb",
        "elements": n,
        "block_size": bs,
        "device": torch.cuda.get_device_name(),
        "bitsandbytes": bitsandbytes.__version__,
        "tsd_ms": round(tsd_ms, 4),
        "bnb_ms": round(bnb_ms, 4),
        "copy_ms": round(copy_ms, 4),
        "tsd_gbps": round(gbps(moved, tsd_ms), 1),
        "bnb_gbps": round(gbps(moved, bnb_ms), 1),
        "copy_gbps": round(gbps(copy_moved, copy_ms), 1),
        "tsd_share_of_copy": round(gbps(moved, tsd_ms) / gbps(copy_moved, copy_ms), 3),
        "bnb_share_of_copy": round(gbps(moved, bnb_ms) / gbps(copy_moved, copy_ms), 3),
        "tsd_speedup_vs_bnb": round(bnb_ms / tsd_ms, 3),
        "bnb_dequant_of_tsd_codes_bit_identical": mismatches == 0,
        "mismatched_elements": mismatches,
        "fp16_fp32_outputs_bit_identical": other_dtypes_equal,
        "tsd_cuda_equals_tsd_cpu": cpu_equal,
        "bnb_quantize_codes_equal_fraction": codes_equal,
        "bnb_quantize_absmax_equal": absmax_equal,
        "tsd_cpu_isa": lib.tsd_quant_cpu_isa().decode(),
    }
    print(json.dumps(result))
    return 0 if mismatches == 0 and cpu_equal and other_dtypes_equal else 1


if __name__ == "__main__":
    sys.exit(main())
