// Public entry points of the CPU quantize/dequantize kernels: argument checks, the scan that
// refuses non-finite inputs before anything is written, block-range offsets, and the run-time
// choice of the ISA path (the same selection as the AdamW kernels, kernels/cpu/dispatch.cc).
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/quant.h"
#include "proto/status_macros.h"

namespace tsd::kernels {
namespace {

// The best supported ISA not above `isa`.
Isa Supported(Isa isa) {
  if (isa == Isa::kAvx512 && !IsaSupported(Isa::kAvx512)) isa = Isa::kAvx2;
  if (isa == Isa::kAvx2 && !IsaSupported(Isa::kAvx2)) isa = Isa::kScalar;
  if (isa != Isa::kAvx512 && isa != Isa::kAvx2) isa = Isa::kScalar;
  return isa;
}

bool ValidDType(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
}

bool ValidKind(QuantKind kind) { return kind == QuantKind::kNf4 || kind == QuantKind::kInt8; }

// Elements [first, last) covered by blocks [begin_block, end_block) of a valid shape, or an error.
absl::Status BlockRange(int64_t n, int64_t block_size, int64_t begin_block, int64_t end_block,
                        int64_t* first, int64_t* last) {
  const int64_t blocks = QuantNumBlocks(n, block_size);
  if (begin_block < 0 || end_block < begin_block || end_block > blocks) {
    return absl::InvalidArgumentError(absl::StrCat("block range [", begin_block, ", ", end_block,
                                                   ") is not within the tensor's ", blocks,
                                                   " blocks"));
  }
  if (begin_block == end_block) {
    *first = *last = 0;
    return absl::OkStatus();
  }
  *first = begin_block * block_size;  // begin_block < blocks, so this is < n
  *last = end_block == blocks ? n : end_block * block_size;
  return absl::OkStatus();
}

const char* NonFiniteName(const void* input, DType dtype, int64_t i) {
  float v;
  if (dtype == DType::kF32) {
    std::memcpy(&v, static_cast<const float*>(input) + i, 4);
  } else {
    uint16_t h;
    std::memcpy(&h, static_cast<const uint16_t*>(input) + i, 2);
    v = dtype == DType::kBF16 ? Bf16ToF32(h) : F16ToF32(h);
  }
  if (std::isnan(v)) return "NaN";
  return v > 0 ? "+Inf" : "-Inf";
}

}  // namespace

const char* QuantKindName(QuantKind kind) {
  switch (kind) {
    case QuantKind::kNf4:
      return "nf4";
    case QuantKind::kInt8:
      return "int8";
  }
  return "unknown";
}

absl::StatusOr<QuantKind> ParseQuantKind(std::string_view name) {
  if (name == "nf4") return QuantKind::kNf4;
  if (name == "int8") return QuantKind::kInt8;
  return absl::InvalidArgumentError(absl::StrCat("unknown quantization kind \"", std::string(name),
                                                 "\": use \"nf4\" or \"int8\""));
}

absl::Status ValidateQuantShape(QuantKind kind, int64_t n, int64_t block_size) {
  if (!ValidKind(kind)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown quantization kind ", static_cast<int>(kind), ": use nf4 (0) or int8 (1)"));
  }
  if (n < 0) {
    return absl::InvalidArgumentError(absl::StrCat("element count ", n, " is negative"));
  }
  if (block_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block size ", block_size, " is not positive: use e.g. ", kDefaultQuantBlockSize));
  }
  if (kind == QuantKind::kNf4 && block_size % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("block size ", block_size,
                     " is odd: nf4 packs two codes per byte and needs a positive "
                     "multiple of 2 (e.g. ",
                     kDefaultQuantBlockSize, ")"));
  }
  return absl::OkStatus();
}

int64_t QuantNumBlocks(int64_t n, int64_t block_size) {
  if (n <= 0 || block_size <= 0) return 0;
  return n / block_size + (n % block_size != 0 ? 1 : 0);
}

int64_t QuantCodeBytes(QuantKind kind, int64_t n) {
  if (n <= 0) return 0;
  return kind == QuantKind::kNf4 ? n / 2 + n % 2 : n;
}

absl::Status QuantizeBlocks(const void* input, DType dtype, const QuantizedView& out,
                            int64_t begin_block, int64_t end_block, Isa isa) {
  TSD_RETURN_IF_ERROR(ValidateQuantShape(out.kind, out.n, out.block_size));
  if (!ValidDType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("input dtype ", static_cast<int>(dtype), " is not fp32, bf16 or fp16"));
  }
  int64_t first = 0, last = 0;
  TSD_RETURN_IF_ERROR(BlockRange(out.n, out.block_size, begin_block, end_block, &first, &last));
  const int64_t count = last - first;
  if (count == 0) return absl::OkStatus();
  if (input == nullptr || out.codes == nullptr || out.absmax == nullptr) {
    return absl::InvalidArgumentError("quantize: input, codes and absmax must not be null");
  }
  isa = Supported(isa);
  const size_t in_size = DTypeSize(dtype);
  const void* in = static_cast<const unsigned char*>(input) + first * in_size;

  int64_t bad = -1;
  switch (isa) {
    case Isa::kAvx512:
      bad = detail::FindNonFiniteAvx512(in, dtype, count);
      break;
    case Isa::kAvx2:
      bad = detail::FindNonFiniteAvx2(in, dtype, count);
      break;
    default:
      bad = detail::FindNonFiniteScalar(in, dtype, count);
      break;
  }
  if (bad >= 0) {
    const int64_t element = first + bad;
    return absl::InvalidArgumentError(absl::StrCat(
        "element ", element, " (block ", element / out.block_size, ") of the input is ",
        NonFiniteName(in, dtype, bad), ": only finite values can be quantized (",
        QuantKindName(out.kind), "); fix or clip the weight first. Nothing was written"));
  }

  uint8_t* codes = out.codes + (out.kind == QuantKind::kNf4 ? first / 2 : first);
  float* absmax = out.absmax + begin_block;
  const int64_t bs = out.block_size;
  if (out.kind == QuantKind::kNf4) {
    switch (isa) {
      case Isa::kAvx512:
        detail::QuantizeNf4Avx512(in, dtype, count, bs, codes, absmax);
        break;
      case Isa::kAvx2:
        detail::QuantizeNf4Avx2(in, dtype, count, bs, codes, absmax);
        break;
      default:
        detail::QuantizeNf4Scalar(in, dtype, count, bs, codes, absmax);
        break;
    }
  } else {
    switch (isa) {
      case Isa::kAvx512:
        detail::QuantizeInt8Avx512(in, dtype, count, bs, codes, absmax);
        break;
      case Isa::kAvx2:
        detail::QuantizeInt8Avx2(in, dtype, count, bs, codes, absmax);
        break;
      default:
        detail::QuantizeInt8Scalar(in, dtype, count, bs, codes, absmax);
        break;
    }
  }
  return absl::OkStatus();
}

absl::Status Quantize(const void* input, DType dtype, const QuantizedView& out, Isa isa) {
  return QuantizeBlocks(input, dtype, out, 0, QuantNumBlocks(out.n, out.block_size), isa);
}

absl::Status DequantizeBlocks(const ConstQuantizedView& in, void* output, DType dtype,
                              int64_t begin_block, int64_t end_block, Isa isa) {
  TSD_RETURN_IF_ERROR(ValidateQuantShape(in.kind, in.n, in.block_size));
  if (!ValidDType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("output dtype ", static_cast<int>(dtype), " is not fp32, bf16 or fp16"));
  }
  int64_t first = 0, last = 0;
  TSD_RETURN_IF_ERROR(BlockRange(in.n, in.block_size, begin_block, end_block, &first, &last));
  const int64_t count = last - first;
  if (count == 0) return absl::OkStatus();
  if (output == nullptr || in.codes == nullptr || in.absmax == nullptr) {
    return absl::InvalidArgumentError("dequantize: codes, absmax and output must not be null");
  }
  const uint8_t* codes = in.codes + (in.kind == QuantKind::kNf4 ? first / 2 : first);
  const float* absmax = in.absmax + begin_block;
  void* out = static_cast<unsigned char*>(output) + first * DTypeSize(dtype);
  const int64_t bs = in.block_size;
  const Isa chosen = Supported(isa);
  if (in.kind == QuantKind::kNf4) {
    switch (chosen) {
      case Isa::kAvx512:
        detail::DequantizeNf4Avx512(codes, absmax, count, bs, out, dtype);
        break;
      case Isa::kAvx2:
        detail::DequantizeNf4Avx2(codes, absmax, count, bs, out, dtype);
        break;
      default:
        detail::DequantizeNf4Scalar(codes, absmax, count, bs, out, dtype);
        break;
    }
  } else {
    switch (chosen) {
      case Isa::kAvx512:
        detail::DequantizeInt8Avx512(codes, absmax, count, bs, out, dtype);
        break;
      case Isa::kAvx2:
        detail::DequantizeInt8Avx2(codes, absmax, count, bs, out, dtype);
        break;
      default:
        detail::DequantizeInt8Scalar(codes, absmax, count, bs, out, dtype);
        break;
    }
  }
  return absl::OkStatus();
}

absl::Status Dequantize(const ConstQuantizedView& in, void* output, DType dtype, Isa isa) {
  return DequantizeBlocks(in, output, dtype, 0, QuantNumBlocks(in.n, in.block_size), isa);
}

}  // namespace tsd::kernels
