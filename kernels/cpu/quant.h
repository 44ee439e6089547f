// CPU quantize and dequantize kernels of tsd for frozen weights: NF4 (bitsandbytes' 4-bit
// NormalFloat layout) and int8 (TrainStream's symmetric blockwise format). Framework-free: the
// daemon builds weight stores with these, the Python layer and the tests call them too.
//
// Formats (exact; docs/quantization.md says the same with examples). A tensor of n elements is
// cut into blocks of `block_size` consecutive elements (the last block may be shorter). Per block:
//   absmax = max |x| over the block, in fp32 (inputs fp32, bf16 or fp16 are widened exactly).
//
//   nf4 (block_size a positive multiple of 2):
//     r = 1.0f / absmax (fp32); s = x * r (fp32; a zero x gives s = 0 even when r overflows to
//     +Inf for a tiny subnormal absmax); the code is the number of midpoints m[k] with s > m[k],
//     where m[k] = (kNf4Values[k] + kNf4Values[k+1]) / 2 in fp32 (a value on a midpoint takes the
//     lower code). A block whose absmax is 0 codes every element as 7 (the code of 0.0). Two codes
//     per byte, the element with the lower index in the high nibble; an odd n is padded with the
//     code 7 in the low nibble of the last byte. Codes take (n + 1) / 2 bytes.
//     Dequantized value: kNf4Values[code] * absmax in fp32, rounded to the output dtype.
//   int8 (block_size >= 1):
//     q = clamp(round_half_even(x * (127.0f / absmax)), -127, 127), the scale 127/absmax and the
//     product in fp32 (a zero x gives 0 even when the scale overflows); a block whose absmax is 0
//     codes all zeros. Codes are int8 bytes, n of them.
//     Dequantized value: float(q) * (absmax / 127.0f) in fp32, rounded to the output dtype.
// Rounding to bf16 / fp16 is round-to-nearest-even (kernels/cpu/bf16.h). Only finite inputs are
// quantized: an Inf or NaN is refused with an error naming the element and its block, and the
// outputs are then left untouched. Dequantize accepts any bytes and absmax values (IEEE
// arithmetic; the int8 byte -128, never produced by Quantize, gives -128 * scale).
//
// Every ISA (scalar, AVX2, AVX-512, chosen at run time as for AdamW: BestIsa(), TSD_KERNEL_ISA)
// produces bit-identical outputs; the scalar path is the reference.
//
// Splitting work: the Blocks variants process the block range [begin_block, end_block) of a whole
// tensor (buffers of the whole tensor are passed, offsets are computed here), so callers can hand
// disjoint block ranges to threads; results do not depend on the split.
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cpu/adamw.h"  // DType, Isa, BestIsa, IsaSupported
#include "kernels/cpu/quant_format.h"

namespace tsd::kernels {

// "nf4" or "int8" ("unknown" for other values).
const char* QuantKindName(QuantKind kind);

// Parses "nf4" / "int8"; anything else is InvalidArgument naming the accepted kinds.
absl::StatusOr<QuantKind> ParseQuantKind(std::string_view name);

// OK when `n` elements can be quantized with `block_size`: n >= 0, block_size >= 1, and for NF4
// block_size even. Otherwise InvalidArgument saying what was wrong.
absl::Status ValidateQuantShape(QuantKind kind, int64_t n, int64_t block_size);

// Number of blocks: ceil(n / block_size) (0 for n == 0). Shape must be valid.
int64_t QuantNumBlocks(int64_t n, int64_t block_size);

// Bytes of codes for n elements: (n + 1) / 2 for NF4, n for int8.
int64_t QuantCodeBytes(QuantKind kind, int64_t n);

// The buffers of one quantized tensor (views; nothing is owned). `codes` holds
// QuantCodeBytes(kind, n) bytes, `absmax` QuantNumBlocks(n, block_size) floats.
struct QuantizedView {
  QuantKind kind = QuantKind::kNf4;
  int64_t block_size = kDefaultQuantBlockSize;
  int64_t n = 0;  // elements of the whole tensor
  uint8_t* codes = nullptr;
  float* absmax = nullptr;
};

// Read-only counterpart of QuantizedView (for dequantize).
struct ConstQuantizedView {
  QuantKind kind = QuantKind::kNf4;
  int64_t block_size = kDefaultQuantBlockSize;
  int64_t n = 0;
  const uint8_t* codes = nullptr;
  const float* absmax = nullptr;
};

// Quantizes the out.n elements of `input` (of `dtype`) into out.codes and out.absmax. Errors
// (nothing is written then): an invalid shape or dtype, null buffers with n > 0, a non-finite
// element ("element 130 (block 2) of the input is +Inf: ..."). Uses `isa` (an unsupported one
// falls back to the best supported one below it).
absl::Status Quantize(const void* input, DType dtype, const QuantizedView& out,
                      Isa isa = BestIsa());

// Quantizes blocks [begin_block, end_block) of the tensor whose whole input is `input` and whole
// buffers are `out`; only those blocks' codes and absmax are written. 0 <= begin_block <=
// end_block <= QuantNumBlocks(out.n, out.block_size), else InvalidArgument. Disjoint block ranges
// may run concurrently (for NF4 every block starts on a byte boundary).
absl::Status QuantizeBlocks(const void* input, DType dtype, const QuantizedView& out,
                            int64_t begin_block, int64_t end_block, Isa isa = BestIsa());

// Dequantizes the whole tensor `in` into `output` (in.n elements of `dtype`).
absl::Status Dequantize(const ConstQuantizedView& in, void* output, DType dtype,
                        Isa isa = BestIsa());

// Dequantizes blocks [begin_block, end_block) of `in` into the matching elements of `output`
// (the whole output tensor's buffer).
absl::Status DequantizeBlocks(const ConstQuantizedView& in, void* output, DType dtype,
                              int64_t begin_block, int64_t end_block, Isa isa = BestIsa());

// ---------------------------------------------------------------------------------------------
// Tables and per-ISA entry points shared by the translation units (and the tests).
namespace detail {

// Per-ISA kernels. Quantize*: `input` points at the first element of a block, n > 0 elements
// follow (every one finite: the caller checked), `codes` at that block's first code byte,
// `absmax` at its absmax. Dequantize*: same layout, `output` at the first output element.
void QuantizeNf4Scalar(const void* input, DType dtype, int64_t n, int64_t block_size,
                       uint8_t* codes, float* absmax);
void QuantizeNf4Avx2(const void* input, DType dtype, int64_t n, int64_t block_size, uint8_t* codes,
                     float* absmax);
void QuantizeNf4Avx512(const void* input, DType dtype, int64_t n, int64_t block_size,
                       uint8_t* codes, float* absmax);
void QuantizeInt8Scalar(const void* input, DType dtype, int64_t n, int64_t block_size,
                        uint8_t* codes, float* absmax);
void QuantizeInt8Avx2(const void* input, DType dtype, int64_t n, int64_t block_size, uint8_t* codes,
                      float* absmax);
void QuantizeInt8Avx512(const void* input, DType dtype, int64_t n, int64_t block_size,
                        uint8_t* codes, float* absmax);
void DequantizeNf4Scalar(const uint8_t* codes, const float* absmax, int64_t n, int64_t block_size,
                         void* output, DType dtype);
void DequantizeNf4Avx2(const uint8_t* codes, const float* absmax, int64_t n, int64_t block_size,
                       void* output, DType dtype);
void DequantizeNf4Avx512(const uint8_t* codes, const float* absmax, int64_t n, int64_t block_size,
                         void* output, DType dtype);
void DequantizeInt8Scalar(const uint8_t* codes, const float* absmax, int64_t n, int64_t block_size,
                          void* output, DType dtype);
void DequantizeInt8Avx2(const uint8_t* codes, const float* absmax, int64_t n, int64_t block_size,
                        void* output, DType dtype);
void DequantizeInt8Avx512(const uint8_t* codes, const float* absmax, int64_t n, int64_t block_size,
                          void* output, DType dtype);

// Index of the first element of `input` (n elements of `dtype`) that is Inf or NaN, or -1.
int64_t FindNonFiniteScalar(const void* input, DType dtype, int64_t n);
int64_t FindNonFiniteAvx2(const void* input, DType dtype, int64_t n);
int64_t FindNonFiniteAvx512(const void* input, DType dtype, int64_t n);

}  // namespace detail
}  // namespace tsd::kernels
