// The C ABI of libtsd_quant.so (kernels/capi/tsd_quant.h): thin wrappers that turn the kernels'
// absl::Status into a return code and a message, so that ctypes can call them.
#include "kernels/capi/tsd_quant.h"

#include <cstring>
#include <string>

#include "kernels/cpu/quant.h"

#ifdef TSD_QUANT_WITH_CUDA
#include "kernels/cuda/dequant.h"
#endif

namespace {

using tsd::kernels::DType;
using tsd::kernels::QuantKind;

int Fail(const absl::Status& status, char* err, size_t err_len) {
  if (err != nullptr && err_len > 0) {
    const std::string msg(status.message());
    const size_t len = std::min(msg.size(), err_len - 1);
    std::memcpy(err, msg.data(), len);
    err[len] = '\0';
  }
  return -1;
}

}  // namespace

extern "C" int tsd_quant_quantize(int kind, const void* input, int dtype, int64_t n,
                                  int64_t block_size, uint8_t* codes, float* absmax, char* err,
                                  size_t err_len) {
  const tsd::kernels::QuantizedView out{static_cast<QuantKind>(kind), block_size, n, codes, absmax};
  const absl::Status s = tsd::kernels::Quantize(input, static_cast<DType>(dtype), out);
  return s.ok() ? 0 : Fail(s, err, err_len);
}

extern "C" int tsd_quant_dequantize(int kind, const uint8_t* codes, const float* absmax, int64_t n,
                                    int64_t block_size, void* output, int dtype, char* err,
                                    size_t err_len) {
  const tsd::kernels::ConstQuantizedView in{static_cast<QuantKind>(kind), block_size, n, codes,
                                            absmax};
  const absl::Status s = tsd::kernels::Dequantize(in, output, static_cast<DType>(dtype));
  return s.ok() ? 0 : Fail(s, err, err_len);
}

extern "C" const char* tsd_quant_cpu_isa(void) {
  return tsd::kernels::IsaName(tsd::kernels::BestIsa());
}

#ifdef TSD_QUANT_WITH_CUDA
extern "C" int tsd_quant_has_cuda(void) { return 1; }

extern "C" int tsd_quant_cuda_dequantize(int kind, const void* codes, const void* absmax, int64_t n,
                                         int64_t block_size, void* output, int dtype,
                                         void* stream) {
  return static_cast<int>(tsd::kernels::cuda::DequantizeAsync(
      static_cast<QuantKind>(kind), static_cast<const uint8_t*>(codes),
      static_cast<const float*>(absmax), n, block_size, output, static_cast<DType>(dtype),
      static_cast<cudaStream_t>(stream)));
}

extern "C" const char* tsd_quant_cuda_error_string(int code) {
  if (code == -1) return "built without CUDA";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
#else
extern "C" int tsd_quant_has_cuda(void) { return 0; }

extern "C" int tsd_quant_cuda_dequantize(int, const void*, const void*, int64_t, int64_t, void*,
                                         int, void*) {
  return -1;
}

extern "C" const char* tsd_quant_cuda_error_string(int code) {
  return code == -1 ? "built without CUDA" : "unknown error";
}
#endif
