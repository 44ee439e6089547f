// Tests of the CUDA dequantize kernels (kernels/cuda/dequant.h) against the CPU kernels
// (kernels/cpu/quant.h, themselves checked against the scalar reference in
// tests/cpp/kernels_quant_test.cc): bit-identical outputs for both formats and every output
// dtype, sizes with partial chunks and partial blocks up to 2^26 + 37 elements, block sizes on and
// off the kernel's fast path, unaligned buffers, codes and absmax that Quantize would not write
// (every byte value, subnormal and huge absmax). Skips, saying why, where no CUDA device is usable.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/quant.h"
#include "kernels/cuda/dequant.h"

namespace tsd::kernels {
namespace {

#define CUDA_ASSERT(expr)                                                      \
  do {                                                                         \
    const cudaError_t err_ = (expr);                                           \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_); \
  } while (false)

const char* DTypeName(DType d) {
  switch (d) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
  }
  return "?";
}

// A device buffer of `bytes` bytes, freed on destruction.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    err_ = cudaMalloc(&ptr_, std::max<size_t>(bytes, 1));
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  cudaError_t error() const { return err_; }
  unsigned char* get() const { return static_cast<unsigned char*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  cudaError_t err_ = cudaSuccess;
};

class CudaDequantTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      GTEST_SKIP() << "no usable CUDA device (cudaGetDeviceCount: " << cudaGetErrorString(err)
                   << "); run this on the GPU machine";
    }
    if (count == 0) GTEST_SKIP() << "no CUDA device on this machine; run this on the GPU machine";
  }

  // Copies codes/absmax to the device at the given byte offsets (0 = aligned), runs the CUDA
  // dequantize into an output at `out_offset` bytes, and compares it with the CPU's bytes.
  void Check(const std::vector<uint8_t>& codes, const std::vector<float>& absmax, QuantKind kind,
             int64_t n, int64_t bs, DType dtype, size_t codes_offset = 0, size_t out_offset = 0) {
    const std::string where = std::string(QuantKindName(kind)) + " n=" + std::to_string(n) +
                              " bs=" + std::to_string(bs) + " out=" + DTypeName(dtype) + " codes+" +
                              std::to_string(codes_offset) + " out+" + std::to_string(out_offset);
    const size_t out_bytes = static_cast<size_t>(n) * DTypeSize(dtype);
    std::vector<unsigned char> want(out_bytes);
    const ConstQuantizedView view{kind, bs, n, codes.data(), absmax.data()};
    const absl::Status s = Dequantize(view, want.data(), dtype);
    ASSERT_TRUE(s.ok()) << s;

    DeviceBuffer d_codes(codes.size() + codes_offset);
    DeviceBuffer d_absmax(absmax.size() * sizeof(float));
    DeviceBuffer d_out(out_bytes + out_offset + 64);
    CUDA_ASSERT(d_codes.error());
    CUDA_ASSERT(d_absmax.error());
    CUDA_ASSERT(d_out.error());
    CUDA_ASSERT(cudaMemcpy(d_codes.get() + codes_offset, codes.data(), codes.size(),
                           cudaMemcpyHostToDevice));
    CUDA_ASSERT(cudaMemcpy(d_absmax.get(), absmax.data(), absmax.size() * sizeof(float),
                           cudaMemcpyHostToDevice));
    // A sentinel around the output shows writes outside it.
    CUDA_ASSERT(cudaMemset(d_out.get(), 0xEE, d_out.bytes()));
    cudaStream_t stream = nullptr;
    CUDA_ASSERT(cudaStreamCreate(&stream));
    const cudaError_t launch = cuda::DequantizeAsync(
        kind, d_codes.get() + codes_offset, reinterpret_cast<const float*>(d_absmax.get()), n, bs,
        d_out.get() + out_offset, dtype, stream);
    ASSERT_EQ(launch, cudaSuccess) << where << ": " << cudaGetErrorString(launch);
    CUDA_ASSERT(cudaStreamSynchronize(stream));
    CUDA_ASSERT(cudaStreamDestroy(stream));
    std::vector<unsigned char> got(d_out.bytes());
    CUDA_ASSERT(cudaMemcpy(got.data(), d_out.get(), got.size(), cudaMemcpyDeviceToHost));

    for (size_t i = 0; i < out_offset; ++i) ASSERT_EQ(got[i], 0xEE) << where << ": wrote before";
    for (size_t i = out_offset + out_bytes; i < got.size(); ++i) {
      ASSERT_EQ(got[i], 0xEE) << where << ": wrote past the end";
    }
    if (std::memcmp(got.data() + out_offset, want.data(), out_bytes) != 0) {
      const size_t esize = DTypeSize(dtype);
      for (int64_t i = 0; i < n; ++i) {
        if (std::memcmp(got.data() + out_offset + i * esize, want.data() + i * esize, esize) != 0) {
          FAIL() << where << ": first difference at element " << i << " (block " << i / bs << ")";
        }
      }
    }
  }

  // Quantizes `values` on the CPU and checks every output dtype.
  void CheckQuantized(const std::vector<float>& values, QuantKind kind, int64_t bs) {
    const int64_t n = static_cast<int64_t>(values.size());
    std::vector<uint8_t> codes(static_cast<size_t>(QuantCodeBytes(kind, n)));
    std::vector<float> absmax(static_cast<size_t>(QuantNumBlocks(n, bs)));
    const absl::Status s = Quantize(values.data(), DType::kF32,
                                    QuantizedView{kind, bs, n, codes.data(), absmax.data()});
    ASSERT_TRUE(s.ok()) << s;
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      Check(codes, absmax, kind, n, bs, dtype);
      if (HasFatalFailure()) return;
    }
  }
};

// Normal values of mixed scales with zero blocks, -0, subnormals and large values planted.
std::vector<float> TestValues(int64_t n, int64_t bs, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t begin = 0; begin < n; begin += bs) {
    const uint32_t kind = rng() % 8;
    const float scale = std::ldexp(1.0f, static_cast<int>(rng() % 30) - 15);
    for (int64_t i = begin; i < std::min(n, begin + bs); ++i) {
      float x = normal(rng) * scale;
      if (kind == 0) x = (i % 2) ? -0.0f : 0.0f;
      if (kind == 1) x = std::numeric_limits<float>::denorm_min() * static_cast<float>(rng() % 7);
      if (kind == 2) x = (rng() % 2 ? 1.0f : -1.0f) * std::numeric_limits<float>::max();
      v[static_cast<size_t>(i)] = x;
    }
  }
  return v;
}

TEST_F(CudaDequantTest, SmallSizesEveryFormatAndDtype) {
  uint32_t seed = 1;
  for (QuantKind kind : {QuantKind::kNf4, QuantKind::kInt8}) {
    std::vector<int64_t> block_sizes = {2, 18, 32, 64, 96, 128, 4096};
    if (kind == QuantKind::kInt8) block_sizes.insert(block_sizes.end(), {1, 7, 16});
    for (int64_t bs : block_sizes) {
      for (int64_t n : {1, 2, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 1000, 4097, 100003}) {
        CheckQuantized(TestValues(n, bs, seed++), kind, bs);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST_F(CudaDequantTest, LargeTensorWithPartialLastBlock) {
  const int64_t n = (int64_t{1} << 26) + 37;
  for (QuantKind kind : {QuantKind::kNf4, QuantKind::kInt8}) {
    CheckQuantized(TestValues(n, 64, 11), kind, 64);
    if (HasFatalFailure()) return;
  }
}

TEST_F(CudaDequantTest, UnalignedBuffers) {
  for (QuantKind kind : {QuantKind::kNf4, QuantKind::kInt8}) {
    const int64_t n = 64 * 100 + 9, bs = 64;
    const std::vector<float> v = TestValues(n, bs, 5);
    std::vector<uint8_t> codes(static_cast<size_t>(QuantCodeBytes(kind, n)));
    std::vector<float> absmax(static_cast<size_t>(QuantNumBlocks(n, bs)));
    ASSERT_TRUE(
        Quantize(v.data(), DType::kF32, QuantizedView{kind, bs, n, codes.data(), absmax.data()})
            .ok());
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      Check(codes, absmax, kind, n, bs, dtype, /*codes_offset=*/1, /*out_offset=*/0);
      Check(codes, absmax, kind, n, bs, dtype, 0, /*out_offset=*/4);
      Check(codes, absmax, kind, n, bs, dtype, 3, 2 * DTypeSize(dtype));
      if (HasFatalFailure()) return;
    }
  }
}

TEST_F(CudaDequantTest, ArbitraryCodesAndAbsmax) {
  std::mt19937 rng(17);
  for (QuantKind kind : {QuantKind::kNf4, QuantKind::kInt8}) {
    for (int64_t bs : {2, 64, 100}) {
      const int64_t n = 50001;
      std::vector<uint8_t> codes(static_cast<size_t>(QuantCodeBytes(kind, n)));
      for (auto& c : codes) c = static_cast<uint8_t>(rng());
      std::vector<float> absmax(static_cast<size_t>(QuantNumBlocks(n, bs)));
      for (auto& a : absmax) {
        switch (rng() % 4) {
          case 0:
            a = std::numeric_limits<float>::denorm_min() * static_cast<float>(rng() % 5000);
            break;
          case 1:
            a = std::numeric_limits<float>::max() / static_cast<float>(1 + rng() % 3);
            break;
          case 2:
            a = 0.0f;
            break;
          default:
            a = std::ldexp(static_cast<float>(rng() % 100000) / 1e5f,
                           static_cast<int>(rng() % 40) - 20);
        }
      }
      for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
        Check(codes, absmax, kind, n, bs, dtype);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Argument checks come before any CUDA call, so this runs without a GPU too (the pointers are
// never dereferenced).
TEST(CudaDequantArguments, BadArgumentsLaunchNothing) {
  std::vector<unsigned char> host(1024);
  const uint8_t* codes = host.data();
  const float* absmax = reinterpret_cast<const float*>(host.data());
  void* out = host.data();
  EXPECT_EQ(
      cuda::DequantizeAsync(QuantKind::kNf4, codes, absmax, 10, 3, out, DType::kBF16, nullptr),
      cudaErrorInvalidValue);  // odd NF4 block size
  EXPECT_EQ(
      cuda::DequantizeAsync(QuantKind::kInt8, codes, absmax, 10, 0, out, DType::kBF16, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(
      cuda::DequantizeAsync(QuantKind::kInt8, codes, absmax, -1, 64, out, DType::kBF16, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(
      cuda::DequantizeAsync(QuantKind::kInt8, nullptr, absmax, 10, 64, out, DType::kBF16, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(cuda::DequantizeAsync(QuantKind::kInt8, codes, absmax, 10, 64, nullptr, DType::kBF16,
                                  nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::DequantizeAsync(static_cast<QuantKind>(5), codes, absmax, 10, 64, out,
                                  DType::kBF16, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::DequantizeAsync(QuantKind::kNf4, codes, absmax, 10, 64, out,
                                  static_cast<DType>(9), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::DequantizeAsync(QuantKind::kNf4, nullptr, nullptr, 0, 64, nullptr, DType::kBF16,
                                  nullptr),
            cudaSuccess);
}

}  // namespace
}  // namespace tsd::kernels
